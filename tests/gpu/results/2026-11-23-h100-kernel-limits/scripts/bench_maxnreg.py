import sys
import torch
import triton
from kernels import paged_attention as pa
from tests.gpu.bench_decode_attention import make_case, gpu_time_ms, CONTEXTS

peak = 3.35
x = torch.ones(1 << 28, dtype=torch.bfloat16, device="cuda")
for _ in range(20):
    x.sum()
LAST = {}


def decode(q, k_cache, v_cache, table, ctx, scale, k_scale=None, v_scale=None, bn=128, w=4, st=2, maxnreg=None):
    fp8 = k_scale is not None
    out = torch.empty_like(q)
    S, H, D = q.shape
    hkv = k_cache.shape[2]
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint16), v_cache.view(torch.uint16)
    kw = dict(maxnreg=maxnreg) if maxnreg else {}
    LAST["k"] = pa._decode_kernel[(S, hkv, 1)](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, out, table, ctx, out, out,
        H, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table.stride(0),
        scale * pa.LOG2E, 1, GROUP=H // hkv, GROUP_PAD=16, HEAD_DIM=D, BLOCK_D=D,
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=bn, SPLIT=False, PRECISION=pa._precision(q.dtype),
        FP8=fp8, Q_FP16=fp8, num_warps=w, num_stages=st, **kw)
    return out


variants = {"fp8": [(128, 4, 2, None), (128, 4, 2, 128), (128, 4, 2, 104), (128, 4, 2, 96), (128, 4, 2, 80),
                    (128, 8, 2, None), (128, 8, 2, 64), (128, 8, 2, 80), (64, 4, 2, 96), (64, 4, 2, 72), (128, 4, 3, 128)],
            "bf16": [(128, 4, 2, None), (128, 4, 2, 128), (128, 4, 1, 128), (128, 4, 1, None), (64, 4, 2, 96), (64, 4, 2, 80),
                     (64, 4, 3, 80), (128, 8, 2, 64), (64, 2, 2, 128)]}
print("| kv | batch | ctx | (block_n, warps, stages, maxnreg) | us | % peak | regs | spills | smem |")
print("|---|---|---|---|---|---|---|---|---|")
for kv in ("fp8", "bf16"):
    for batch, label in ((131, "U[100,1024]"), (131, "U[100,2048]"), (256, "U[100,2048]")):
        lo, hi = CONTEXTS[label]
        c = make_case(batch, lo, hi, 16, 8, fp8=kv == "fp8")
        kw = dict(k_scale=c.get("k_scale"), v_scale=c.get("v_scale"))
        args = (c["q"], c["k"], c["v"], c["table"], c["ctx"], c["scale"])
        ref = pa.paged_decode(*args, **kw)
        for bn, w, st, mr in variants[kv]:
            fn = lambda: decode(*args, **kw, bn=bn, w=w, st=st, maxnreg=mr)
            try:
                out = fn()
                torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
                ms = gpu_time_ms(fn)
                k = LAST["k"]
                info = (getattr(k, "n_regs", "?"), getattr(k, "n_spills", "?"), getattr(k.metadata, "shared", "?"))
            except Exception as e:
                print(f"| {kv} | {batch} | {label} | {(bn, w, st, mr)} | error {type(e).__name__}: {str(e)[:120]} |", flush=True)
                continue
            print(f"| {kv} | {batch} | {label} | {(bn, w, st, mr)} | {ms*1e3:.1f} | {100*c['bytes']/ms/1e6/(peak*1e3):.1f} | {info[0]} | {info[1]} | {info[2]} |", flush=True)
