"""Prototype: prefetch weight tensors into L2 (fire and forget), so decode GEMMs at small M
read them from L2 instead of HBM."""
import torch
import triton
import triton.language as tl

LINE = 128


@triton.jit
def _prefetch_kernel(P0, N0, P1, N1, P2, N2, P3, N3, LINES: tl.constexpr, MODE: tl.constexpr,
                     CHUNK: tl.constexpr = 16384):
    pid = tl.program_id(0)
    offs = (pid * LINES + tl.arange(0, LINES)).to(tl.int64) * 128
    for j in tl.static_range(4):
        if j == 0:
            base = P0; n = N0
        elif j == 1:
            base = P1; n = N1
        elif j == 2:
            base = P2; n = N2
        else:
            base = P3; n = N3
        if (MODE >= 2) or (pid * LINES * 128 < n):
            addr = base + tl.where(offs < n, offs, 0)
            if MODE >= 2:
                per = tl.arange(0, 128).to(tl.int64) * CHUNK + pid.to(tl.int64) * 128 * CHUNK
                ok = per < n
                a2 = base + tl.where(ok, per, 0)
                sz = tl.where(ok, tl.minimum(n - per, CHUNK), 16).to(tl.int32)
                if MODE == 2:
                    tl.inline_asm_elementwise("{ .reg .b64 p; createpolicy.fractional.L2::evict_last.b64 p, 1.0; cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, p; mov.u32 $0, 0; }",
                                              "=r,l,r", [a2, sz], dtype=tl.int32, is_pure=False, pack=1)
                else:
                    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                                              "=r,l,r", [a2, sz], dtype=tl.int32, is_pure=False, pack=1)
            elif MODE == 0:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
                                          "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;",
                                          "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(tensors, mode=0, lines=1024):
    ts = [t.view(torch.uint8).view(-1) for t in tensors] + []
    while len(ts) < 4:
        ts.append(ts[0][:0])
    n = max(t.numel() for t in ts)
    grid = triton.cdiv(n, 128 * 16384) if mode >= 2 else triton.cdiv(n, lines * LINE)
    _prefetch_kernel[(grid,)](
        ts[0], ts[0].numel(), ts[1], ts[1].numel(), ts[2], ts[2].numel(), ts[3], ts[3].numel(),
        LINES=lines, MODE=mode, num_warps=4)
