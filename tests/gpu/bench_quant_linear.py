"""W4A16 / W8A16 linear (kernels/quant_linear.py) against bf16 cuBLAS, at decode and prefill
token counts (issue 64: an int4 step should read a quarter of bf16's weight bytes).

    python tests/gpu/bench_quant_linear.py [--hbm-tbs 4.8] [--tokens 1,2,4,16,256]
    python tests/gpu/bench_quant_linear.py --sweep   # the GEMV's sizes at 8B, int4, 1 token

For Qwen3-8B's and Qwen3-0.6B's linear shapes: F.linear on bf16 weights vs quant_linear on
int4 (group 128, act-order and not) and int8 weights, each checked against quant_linear_ref,
timed from CUDA graph replays over enough weight copies that every call streams its weight
from HBM. GB/s = the packed weight's bytes (+ scales, zeros, g_idx) / us; % = of --hbm-tbs.
Each layer's group is decided once, as the model's layers do (models/linear.py), so the
calls capture. --sweep times the GEMV (1 token, int4 g128, 8B gate_up and down) over its
module-level sizes (GEMV_BLOCK_N, GEMV_BLOCK_KW, GEMV_WARPS, GEMV_PROGRAMS, GEMV_FACTOR).
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

import kernels.quant_linear as ql  # noqa: E402
from kernels.quant_linear import consecutive_group, quant_linear, quant_linear_ref  # noqa: E402
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
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    peak = args.hbm_tbs * 1e6   # bytes per us
    if args.sweep:
        return sweep(peak)
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
                group = consecutive_group(layer[3])
                out = quant_linear(x, *mats[0], bits, group_size=group)
                ref = quant_linear_ref(x, *mats[0], bits)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1e-2, (name, kind, t, err)
                per = lambda f, m: graph_us(lambda: [f(i) for i in range(len(m))],  # noqa: E731
                                            reps=20) / len(m)
                b_us = per(lambda i: F.linear(x, dense[i]), dense)
                q_us = per(lambda i: quant_linear(x, *mats[i], bits, group_size=group), mats)
                print(f"| {name} ({n} x {k}) | {kind} | {t} | {b_us:.1f} "
                      f"({100 * w.nbytes / b_us / peak:.0f}%) | {q_us:.1f} "
                      f"({nbytes / q_us / 1e3:.0f}, {100 * nbytes / q_us / peak:.0f}%) | "
                      f"{b_us / q_us:.2f}x |", flush=True)
            mats = None
            torch.cuda.empty_cache()


def sweep(peak: float) -> None:
    import itertools
    print("| layer | BLOCK_N | BLOCK_KW | warps | programs | factor | us | % of HBM |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in ("8B gate_up", "8B down"):
        n, k = SHAPES[name]
        layer = packed(n, k, 4, False, g)
        nbytes = sum(t.nbytes for t in layer)
        mats = [tuple(t.clone() for t in layer) for _ in range(hbm_copies(nbytes))]
        x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        ref = quant_linear_ref(x, *layer, 4).float()
        best = (1e9, None)
        for bn, kw, warps, programs, factor in itertools.product(
                (64, 128, 256), (8, 16, 32), (4, 8), (528, 1056), (True, False)):
            if factor is False and (bn, kw, warps, programs) != (128, 16, 8, 528):
                continue   # the unfactored form once, at the default sizes
            ql.GEMV_BLOCK_N, ql.GEMV_BLOCK_KW, ql.GEMV_WARPS = bn, kw, warps
            ql.GEMV_PROGRAMS, ql.GEMV_FACTOR = programs, factor
            try:
                out = quant_linear(x, *layer, 4, group_size=128).float()
                err = ((out - ref).norm() / ref.norm()).item()
                us = graph_us(lambda: [quant_linear(x, *m, 4, group_size=128) for m in mats],
                              reps=20) / len(mats)
            except Exception as e:   # (a size that does not compile or fit)
                print(f"| {name} | {bn} | {kw} | {warps} | {programs} | {factor} | "
                      f"{type(e).__name__} | |", flush=True)
                continue
            print(f"| {name} | {bn} | {kw} | {warps} | {programs} | {factor} | {us:.1f} | "
                  f"{100 * nbytes / us / peak:.0f}%{'' if err < 1e-2 else f' ERR {err:.2g}'} |",
                  flush=True)
            if err < 1e-2 and us < best[0]:
                best = (us, (bn, kw, warps, programs, factor))
        print(f"best {name}: {best[0]:.1f} us at {best[1]}", flush=True)
        mats = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
