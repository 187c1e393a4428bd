"""W4A16 / W8A16 linear (kernels/quant_linear.py) against bf16 cuBLAS, at decode and prefill
token counts (issue 64: an int4 step should read a quarter of bf16's weight bytes).

    python tests/gpu/bench_quant_linear.py [--hbm-tbs 4.8] [--tokens 1,2,4,16,256]

For Qwen3-8B's and Qwen3-0.6B's linear shapes: F.linear on bf16 weights vs quant_linear on
int4 (group 128, act-order and not) and int8 weights, each checked against quant_linear_ref,
timed from CUDA graph replays over enough weight copies that every call streams its weight
from HBM. GB/s = the packed weight's bytes (+ scales, zeros, g_idx) / us; % = of --hbm-tbs.
Written without a GPU (2026-11-29): not run yet.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fp8_check import hbm_copies  # noqa: E402
from moe_check import graph_us  # noqa: E402

from kernels.quant_linear import quant_linear, quant_linear_ref  # noqa: E402
from models.quantized import pack_rows  # noqa: E402

SHAPES = {"8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096),
          "8B down": (4096, 12288), "0.6B qkv": (4096, 1024), "0.6B gate_up": (6144, 1024),
          "0.6B down": (1024, 3072)}
KINDS = {"int4 g128": (4, False), "int4 g128 act-order": (4, True), "int8 g128": (8, False)}


def packed(n: int, k: int, bits: int, act_order: bool, g: torch.Generator) -> tuple:
    """(qweight, scales, zeros, g_idx) of a random [k, n] layer, group 128."""
    q = torch.randint(0, 1 << bits, (k, n), device="cuda", generator=g, dtype=torch.int32)
    groups = k // 128
    scales = (torch.rand(groups, n, device="cuda", generator=g) * 0.01).bfloat16()
    zeros = torch.full((groups, n), float(1 << (bits - 1)), device="cuda").bfloat16()
    g_idx = torch.arange(k, device="cuda", dtype=torch.int32) // 128
    if act_order:
        g_idx = g_idx[torch.randperm(k, device="cuda", generator=g)].contiguous()
    return pack_rows(q, bits), scales, zeros, g_idx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hbm-tbs", type=float, default=4.8)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,16,256")
    args = ap.parse_args()
    peak = args.hbm_tbs * 1e6   # bytes per us
    print(f"### W4A16 / W8A16 linear, {torch.cuda.get_device_name()} (weights from HBM; % of "
          f"{args.hbm_tbs} TB/s)\n")
    print("| layer (N x K) | weights | tokens | bf16 us (%) | quant us (GB/s, %) | vs bf16 |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        dense = [w.clone() for _ in range(hbm_copies(w.nbytes))]
        for kind, (bits, act_order) in KINDS.items():
            layer = packed(n, k, bits, act_order, g)
            nbytes = sum(t.nbytes for t in layer)
            mats = [tuple(t.clone() for t in layer) for _ in range(hbm_copies(nbytes))]
            for t in map(int, args.tokens.split(",")):
                x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
                out = quant_linear(x, *mats[0], bits)
                ref = quant_linear_ref(x, *mats[0], bits)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1e-2, (name, kind, t, err)
                per = lambda f, m: graph_us(lambda: [f(i) for i in range(len(m))],  # noqa: E731
                                            reps=20) / len(m)
                b_us = per(lambda i: F.linear(x, dense[i]), dense)
                q_us = per(lambda i: quant_linear(x, *mats[i], bits), mats)
                print(f"| {name} ({n} x {k}) | {kind} | {t} | {b_us:.1f} "
                      f"({100 * w.nbytes / b_us / peak:.0f}%) | {q_us:.1f} "
                      f"({nbytes / q_us / 1e3:.0f}, {100 * nbytes / q_us / peak:.0f}%) | "
                      f"{b_us / q_us:.2f}x |", flush=True)
            mats = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
