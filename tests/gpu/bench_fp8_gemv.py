"""e4m3 weights at decode token counts: what the model runs and how near HBM speed (issue 44).

    python tests/gpu/bench_fp8_gemv.py [--tokens 1,8,16,131] [--sweep] [--shapes ...]

For Qwen3-8B's four projection shapes, each kernel checked against its reference and timed
from CUDA graph replays over enough weight copies that every call streams its weight from
HBM: kernels/gemv.py (one token, weight-only), fp8_small_m_linear (x quantized per token +
the small-M kernel: the model's path for 2-16 tokens) at its default tiles, x quant +
torch._scaled_mm (the path above 16 tokens), and fp8_linear (what the model runs at that
token count). --sweep adds the best small-M tilings (past 16 tokens also the token tile
and warps: the kernel walks token tiles fastest, so a weight tile is read once). GB/s = weight bytes / us; % of
--hbm-tbs.
"""
from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import torch  # noqa: E402
from bench_gemv import SHAPES as GEMV_SHAPES  # noqa: E402
from fp8_check import hbm_copies  # noqa: E402
from moe_check import graph_us  # noqa: E402

from kernels.fp8_linear import (fp8_linear, fp8_linear_ref, fp8_small_m_linear,  # noqa: E402
                                fp8_weight_only_ref, quantize_rows, quantize_rows_)
from kernels.gemv import gemv  # noqa: E402

# Qwen3-8B's projections (its LM head stays bf16 under --quantization fp8)
SHAPES = {k: v for k, v in GEMV_SHAPES.items() if k.startswith("8B") and "lm_head" not in k}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hbm-tbs", type=float, default=3.35)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,8,16,131")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    peak = args.hbm_tbs * 1e6
    print(f"### e4m3 weights at decode sizes, {torch.cuda.get_device_name()} (us, % of "
          f"{args.hbm_tbs} TB/s)\n")
    print("| layer (N x K) | tokens | gemv | small-M (quant incl.) | quant + _scaled_mm | "
          "fp8_linear (model) | best small-M tiles (bn, bk[, bt], stages[, warps]): us |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        q, s = quantize_rows(w)
        mats = [(q.clone(), s.clone()) for _ in range(hbm_copies(q.nbytes))]

        def per(f):
            return graph_us(lambda: [f(i) for i in range(len(mats))], reps=20) / len(mats)

        def cell(us: float) -> str:
            return f"{us:.1f} ({100 * q.nbytes / us / peak:.0f}%)"

        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
            ref = fp8_linear_ref(x, q, s)
            assert rel(fp8_small_m_linear(x, q, s), ref) < 1e-2
            assert rel(fp8_linear(x, q, s), ref) < 1e-2
            gv = "-"
            if t == 1:
                assert rel(gemv(x, q, s), fp8_weight_only_ref(x, q, s)) < 1e-2
                gv = cell(per(lambda i: gemv(x, *mats[i])))
            small = per(lambda i: fp8_small_m_linear(x, *mats[i]))

            def scaled(i):
                xq, xs = quantize_rows_(x)
                return torch._scaled_mm(xq, mats[i][0].T, scale_a=xs,
                                        scale_b=mats[i][1].reshape(1, -1), out_dtype=x.dtype)
            mm = per(scaled)
            model = per(lambda i: fp8_linear(x, *mats[i]))
            best = ""
            if args.sweep:
                res = []
                if t <= 16:
                    grid = [dict(block_n=bn, block_k=bk, num_stages=ns) for bn, bk, ns in
                            itertools.product((32, 64, 128), (128, 256, 512), (3, 4, 5))]
                else:   # past 16 tokens: wider token tiles, more warps
                    grid = [dict(block_n=bn, block_k=bk, block_t=bt, num_stages=ns, num_warps=nw)
                            for bn, bk, bt, ns, nw in itertools.product(
                                (64, 128), (128, 256), (32, 64, 128), (3, 4), (4, 8))]
                for kw in grid:
                    try:
                        assert rel(fp8_small_m_linear(x, q, s, **kw), ref) < 1e-2
                        res.append((per(lambda i: fp8_small_m_linear(x, *mats[i], **kw)),
                                    tuple(kw.values())))
                    except Exception:  # noqa: BLE001 - out of shared memory / registers
                        continue
                res.sort()
                best = "; ".join(f"{c}: {u:.1f}" for u, c in res[:3])
            print(f"| {name} ({n} x {k}) | {t} | {gv} | {cell(small)} | {cell(mm)} | "
                  f"{cell(model)} | {best} |", flush=True)
        del mats
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
