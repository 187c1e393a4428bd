import os
import sys
import torch
sys.path.insert(0, os.path.dirname(__file__))
import decode_heads as dh
from decode_heads import decode_heads
from kernels.paged_attention import paged_decode
from tests.gpu.bench_decode_attention import make_case, gpu_time_ms, CONTEXTS

peak = 3.35
x = torch.ones(1 << 28, dtype=torch.bfloat16, device="cuda")
for _ in range(20):
    x.sum()
variants = [(2, 128, 4, 2), (2, 256, 4, 2), (2, 256, 8, 2), (4, 128, 4, 2), (4, 256, 8, 2), (8, 128, 4, 2), (2, 128, 4, 3)]
print("| kv | batch | ctx | variant (heads, block_n, warps, stages) | us | % peak | regs | smem |")
print("|---|---|---|---|---|---|---|---|")
for kv in ("fp8", "bf16"):
    for batch, label in ((131, "U[100,1024]"), (131, "U[100,2048]"), (131, "1"), (256, "U[100,2048]"), (64, "U[100,2048]")):
        lo, hi = CONTEXTS[label]
        c = make_case(batch, lo, hi, 16, 8, fp8=kv == "fp8")
        kw = dict(k_scale=c.get("k_scale"), v_scale=c.get("v_scale"))
        args = (c["q"], c["k"], c["v"], c["table"], c["ctx"], c["scale"])
        ref = paged_decode(*args, **kw)
        ms = gpu_time_ms(lambda: paged_decode(*args, **kw))
        print(f"| {kv} | {batch} | {label} | production | {ms*1e3:.1f} | {100*c['bytes']/ms/1e6/(peak*1e3):.1f} | | |", flush=True)
        for h, bn, w, st in variants:
            fn = lambda: decode_heads(*args, heads=h, block_n=bn, num_warps=w, num_stages=st, **kw)
            try:
                out = fn()
                torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
                ms = gpu_time_ms(fn)
                regs, smem = getattr(dh.LAST, "n_regs", "?"), getattr(getattr(dh.LAST, "metadata", None), "shared", "?")
            except Exception as e:
                print(f"| {kv} | {batch} | {label} | {(h, bn, w, st)} | error {type(e).__name__}: {str(e)[:100]} |")
                continue
            print(f"| {kv} | {batch} | {label} | {(h, bn, w, st)} | {ms*1e3:.1f} | {100*c['bytes']/ms/1e6/(peak*1e3):.1f} | {regs} | {smem} |", flush=True)
