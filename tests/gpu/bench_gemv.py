"""Decode GEMV (kernels/gemv.py) against what the model ran before it, at decode token counts.

    python tests/gpu/bench_gemv.py [--sweep] [--hbm-tbs 3.35]

For Qwen3-8B's and Qwen3-0.6B's linear shapes and LM head, bf16 and e4m3 weights, 1, 2, 4, 8
and 16 tokens: cuBLAS (F.linear; bf16) or fp8_linear (quantization + the small-M kernel; fp8) vs
gemv at its default tiles, and for bf16 the small-M kernel unscaled (kernels/small_m.py),
each checked against gemv_ref, timed from CUDA graph replays over enough weight copies that
every call streams its weight from HBM. GB/s = weight bytes / us; % = of --hbm-tbs. --sweep
adds the best (block_n, block_k, warps) over a grid at 1 token; --small-m-sweep the small-M
kernel's best (block_n, block_k, stages) at 2+ tokens (bf16; as the model runs them: qkv and
gate_up with the norm in the prologue, gate_up gated; in the model 0.6B's o and down take 16
programs of 64 rows at the default tiles). --tokens picks the token counts.
"""
from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fp8_check import hbm_copies  # noqa: E402
from moe_check import graph_us  # noqa: E402

from kernels.fp8_linear import fp8_linear, quantize_rows  # noqa: E402
from kernels.small_m import small_m_linear  # noqa: E402
from kernels.gemv import GemvNorm, gemv, gemv_ref  # noqa: E402

SHAPES = {"8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096),
          "8B down": (4096, 12288), "8B lm_head": (151936, 4096),
          "0.6B qkv": (4096, 1024), "0.6B o": (1024, 2048), "0.6B gate_up": (6144, 1024),
          "0.6B down": (1024, 3072), "0.6B lm_head": (151936, 1024)}
# --small-m-sweep's (block_k, num_stages) for block_n 16, 32 and 64
SMALL_M_GRID = ((128, 5), (256, 3), (256, 4), (256, 5), (512, 3), (512, 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--hbm-tbs", type=float, default=3.35)
    ap.add_argument("--small-m-sweep", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8,16")
    args = ap.parse_args()
    peak = args.hbm_tbs * 1e6   # bytes per us
    print(f"### Decode GEMV, {torch.cuda.get_device_name()} (weights from HBM; % of "
          f"{args.hbm_tbs} TB/s)\n")
    print("| layer (N x K) | weights | tokens | before us (GB/s, %) | gemv us (GB/s, %) | "
          "speed-up | small-M bf16 us (%) | best tiles (GEMV at 1 token: bn, bk, warps; small-M: bn, bk, "
          "stages): us, % |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        for kind in ("bf16", "fp8"):
            if kind == "fp8":
                if "lm_head" in name:
                    continue   # the LM head stays bf16 under --quantization fp8
                q, s = quantize_rows(w)
                mats = [(q.clone(), s.clone()) for _ in range(hbm_copies(q.nbytes))]
            else:
                mats = [(w.clone(), None) for _ in range(hbm_copies(w.nbytes))]
            nbytes = mats[0][0].nbytes
            for t in map(int, args.tokens.split(",")):
                x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
                out = gemv(x, *mats[0])
                ref = gemv_ref(x, *mats[0])
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1e-2, (name, kind, t, err)
                if kind == "fp8":
                    before = lambda i: fp8_linear(x, *mats[i])  # noqa: E731
                else:
                    before = lambda i: F.linear(x, mats[i][0])  # noqa: E731
                per = lambda f: graph_us(lambda: [f(i) for i in range(len(mats))],  # noqa: E731
                                         reps=20) / len(mats)
                b_us = per(before)
                g_us = per(lambda i: gemv(x, *mats[i]))
                small = "-"
                if kind == "bf16":
                    y = small_m_linear(x, mats[0][0])
                    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
                    s_us = per(lambda i: small_m_linear(x, mats[i][0]))
                    small = f"{s_us:.1f} ({100 * nbytes / s_us / peak:.0f}%)"
                best = ""
                if args.sweep and t == 1:
                    res = []
                    for bn, bk, nw in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8)):
                        try:
                            us = per(lambda i: gemv(x, *mats[i], block_n=bn, block_k=bk,
                                                    num_warps=nw))
                        except Exception:  # noqa: BLE001 - out of registers / shared memory
                            continue
                        res.append((us, (bn, bk, nw)))
                    res.sort()
                    best = "; ".join(f"{c}: {u:.1f}, {100 * nbytes / u / peak:.0f}%"
                                     for u, c in res[:3])
                if args.small_m_sweep and t > 1 and kind == "bf16":
                    res = []
                    # as the model runs them: qkv and gate_up with the norm (and residual
                    # add) in the prologue, gate_up with the SwiGLU in the epilogue
                    gated = "gate_up" in name
                    norm = None
                    if gated or "qkv" in name:
                        norm = GemvNorm(torch.ones(k, device="cuda", dtype=x.dtype), 1e-6,
                                        torch.randn_like(x), torch.empty_like(x))
                    for bn, (bk, st) in itertools.product((16, 32, 64), SMALL_M_GRID):
                        def run(i, bn=bn, bk=bk, st=st):
                            return small_m_linear(x, mats[i][0], gated=gated, norm=norm,
                                                  block_n=bn, block_k=bk, num_stages=st)
                        try:   # (out of shared memory raises here, outside a capture)
                            run(0)
                            us = per(run)
                        except Exception:  # noqa: BLE001 - out of shared memory
                            continue
                        res.append((us, (bn, bk, st)))
                    res.sort()
                    default = {c: u for u, c in res}.get((32 if gated else 64, 256,
                                                          4 if norm else 5))
                    best = "; ".join(f"{c}: {u:.1f}, {100 * nbytes / u / peak:.0f}%"
                                     for u, c in res[:3]) + f"; default {default:.1f}"
                print(f"| {name} ({n} x {k}) | {kind} | {t} | {b_us:.1f} ({nbytes / b_us / 1e3:.0f}, "
                      f"{100 * nbytes / b_us / peak:.0f}%) | {g_us:.1f} ({nbytes / g_us / 1e3:.0f}, "
                      f"{100 * nbytes / g_us / peak:.0f}%) | {b_us / g_us:.2f}x | {small} | {best} |",
                      flush=True)
            del mats
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
