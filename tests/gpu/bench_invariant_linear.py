"""The batch-invariant GEMM's tiles (kernels/batch_invariant.py, --deterministic): each candidate
config's time against cuBLAS at decode and prefill row counts, and whether it keeps a row's
bits whatever the rows beside it (on this GPU: the MMA instruction a tile shape compiles to is
the compiler's choice, so invariance is checked, not assumed).

Per shape (Qwen3-0.6B and 8B projections, the 8B LM head) and M, LAYERS weight copies are
multiplied back to back from one CUDA graph, so weights stream from HBM as in a step; us per
call. Invariance: rows 0..m-1 of a 300-row batch against the same rows computed in batches of
1, 7, 64, 65 and 300 rows, and with the rows shifted by 5 places (another place in the tile).
--cross: only whether every config gives the bits of every other (kernels/batch_invariant.py's
`tiles` follows the row count on that ground), bf16 and fp32, a line per shape.

    python tests/gpu/bench_invariant_linear.py [--m 1,8,64,256,2048] [--shapes all] [--cross]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode_attention import gpu_time_ms  # noqa: E402
from kernels.batch_invariant import invariant_linear  # noqa: E402

SHAPES = {  # name: (N, K, copies)
    "0.6B qkv": (4096, 1024, 28), "0.6B o": (1024, 2048, 28),
    "0.6B gate_up": (6144, 1024, 28), "0.6B down": (1024, 3072, 28),
    "8B qkv": (6144, 4096, 12), "8B o": (4096, 4096, 12),
    "8B gate_up": (24576, 4096, 6), "8B down": (4096, 12288, 6), "8B lm_head": (151936, 4096, 1),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for invariant_linear's `config`; None =
# kernels/batch_invariant's rule
CONFIGS = [None, (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3),
           (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 32, 128, 4, 5), (64, 64, 256, 4, 3),
           (64, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3),
           (256, 128, 64, 8, 3)]


def invariant(w: torch.Tensor, cfg) -> bool:
    x = torch.randn(305, w.shape[1], dtype=w.dtype, device=w.device)
    full = invariant_linear(x[:300], w, config=cfg)
    for m in (1, 7, 64, 65, 300):
        if not torch.equal(invariant_linear(x[:m], w, config=cfg), full[:m]):
            return False
    return torch.equal(invariant_linear(x[5:305], w, config=cfg)[:295],
                       invariant_linear(x[5:300], w, config=cfg))


def cross(w: torch.Tensor) -> list[str]:
    """The configs whose bits differ from the first's (300 rows), bf16 and fp32."""
    bad = []
    for dtype in (torch.bfloat16, torch.float32):
        wd = w.to(dtype)
        x = torch.randn(300, w.shape[1], dtype=dtype, device=w.device)
        ref = None
        for c in CONFIGS[1:] + [None]:
            y = invariant_linear(x, wd, config=c)
            if ref is None:
                ref = y
            elif not torch.equal(y, ref):
                bad.append(f"{dtype} {c}: max |d| {(y.float() - ref.float()).abs().max().item():.3g}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,8,64,256,2048")
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--cross", action="store_true", help="only: every config's bits against every other's")
    args = ap.parse_args()
    ms = [int(m) for m in args.m.split(",")]
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    dev = torch.device("cuda")
    if args.cross:
        for name in names:
            N, K, _ = SHAPES[name]
            bad = cross(torch.randn(N, K, dtype=torch.float32, device=dev) * 0.02)
            print(f"{name}: {'every config the same bits' if not bad else 'DIFFER ' + '; '.join(bad)}",
                  flush=True)
        return
    print(f"{torch.cuda.get_device_name()}, bf16; us per call (cuBLAS | configs: "
          f"{', '.join(str(c) for c in CONFIGS)}); 'x' = not batch-invariant\n")
    for name in names:
        N, K, copies = SHAPES[name]
        ws = [torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
        ok = {str(c): invariant(ws[0], c) for c in CONFIGS}
        for m in ms:
            x = torch.randn(m, K, dtype=torch.bfloat16, device=dev)
            row = [gpu_time_ms(lambda: [F.linear(x, w) for w in ws], reps=10) * 1e3 / copies]
            for c in CONFIGS:
                row.append(gpu_time_ms(lambda: [invariant_linear(x, w, config=c) for w in ws], reps=10) * 1e3 / copies)
            gbs = N * K * 2 / (min(row[1:]) * 1e-6) / 1e9
            cells = " | ".join(f"{t:.1f}{'' if ok[str(c)] else 'x'}" for t, c in zip(row[1:], CONFIGS))
            print(f"| {name} | {m} | {row[0]:.1f} | {cells} | best {gbs:.0f} GB/s |", flush=True)


if __name__ == "__main__":
    main()
