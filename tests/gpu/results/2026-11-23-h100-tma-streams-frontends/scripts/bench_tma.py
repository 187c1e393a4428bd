"""Production paged_decode vs the TMA prototype (graph-timed, L2 flushed), H100/H200.
PYTHONPATH=.:protos python tests/gpu/experiments/tma_decode/bench_tma.py"""
import os, sys
import torch
sys.path.insert(0, os.path.dirname(__file__))
from paged_attention_tma import decode_tma, descriptors
from kernels.paged_attention import paged_decode
from tests.gpu.bench_decode_attention import make_case, gpu_time_ms, CONTEXTS

peak = 4.8 if "H200" in torch.cuda.get_device_name() else 3.35
x = torch.ones(1 << 28, dtype=torch.bfloat16, device="cuda")
for _ in range(30):
    x.sum()
variants = [(128, 4, 2), (128, 4, 3), (128, 8, 2), (64, 4, 2), (64, 4, 3), (256, 8, 2)]
print(torch.cuda.get_device_name())
print("| kv | batch | ctx | variant (block_n, warps, stages) | us | % peak |\n|---|---|---|---|---|---|")
for kv in ("fp8", "bf16"):
    for batch, label in ((131, "U[100,1024]"), (131, "U[100,2048]"), (131, "1"), (256, "U[100,2048]"), (64, "U[100,2048]")):
        lo, hi = CONTEXTS[label]
        c = make_case(batch, lo, hi, 16, 8, fp8=kv == "fp8")
        kw = dict(k_scale=c.get("k_scale"), v_scale=c.get("v_scale"))
        args = (c["q"], c["k"], c["v"], c["table"], c["ctx"], c["scale"])
        ref = paged_decode(*args, **kw)
        ms = gpu_time_ms(lambda: paged_decode(*args, **kw))
        print(f"| {kv} | {batch} | {label} | production | {ms*1e3:.1f} | {100*c['bytes']/ms/1e6/(peak*1e3):.1f} |", flush=True)
        for bn, w, st in variants:
            try:
                descs = descriptors(c["k"], c["v"], bn)
                fn = lambda: decode_tma(*args, **kw, block_n=bn, num_warps=w, num_stages=st, descs=descs)
                torch.testing.assert_close(fn(), ref, atol=2e-2, rtol=2e-2)
                ms = gpu_time_ms(fn)
            except Exception as e:
                print(f"| {kv} | {batch} | {label} | {(bn, w, st)} | error {type(e).__name__}: {str(e)[:150]} |", flush=True)
                continue
            print(f"| {kv} | {batch} | {label} | {(bn, w, st)} | {ms*1e3:.1f} | {100*c['bytes']/ms/1e6/(peak*1e3):.1f} |", flush=True)
