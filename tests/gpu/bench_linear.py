"""Decode-sized GEMMs through cuBLAS: how far a step's projections are from their weights'
bandwidth, and how much of that is DRAM (weights from HBM vs from L2).

For each Qwen3-0.6B projection (qkv, o, gate_up, down) and batch M, 28 weight copies (one
per layer, so weights stream from HBM as in a real step) are multiplied back to back in
one CUDA graph; us per call = replay time / 28. The same weight 28 times is served from
L2 after the first call; a third column runs cuBLASLt (torch's preferred_blas_library).
A split-K Triton GEMM was measured against these figures and lost at every batch >= 64
(commit 94e2123, tests/gpu/results/2026-11-23-h100-splitk-gemm/).
    python tests/gpu/bench_linear.py [--m 1,64,144,256]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from bench_decode_attention import gpu_time_ms  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LAYERS = 28


def per_call_us(calls) -> float:
    """GPU time of the calls run back to back from one graph, per call, in us."""
    return gpu_time_ms(lambda: [c() for c in calls], reps=20) * 1e3 / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,64,144,256", help="batches (decode buckets) to time")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, bf16, {LAYERS} weight copies per shape\n")
    print("| shape | N x K | M | HBM us | GB/s | L2 us | cuBLASLt HBM us |\n"
          "|---|---|---|---|---|---|---|")
    from_hbm: dict[int, float] = {}   # M -> a step's projections, us
    from_l2: dict[int, float] = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.05 for _ in range(LAYERS)]
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            hbm = per_call_us([lambda w=w: F.linear(x, w) for w in ws])
            l2 = per_call_us([lambda: F.linear(x, ws[0])] * LAYERS)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            lt = per_call_us([lambda w=w: F.linear(x, w) for w in ws])
            torch.backends.cuda.preferred_blas_library("cublas")
            from_hbm[m] = from_hbm.get(m, 0.0) + hbm * LAYERS
            from_l2[m] = from_l2.get(m, 0.0) + l2 * LAYERS
            print(f"| {name} | {n} x {k} | {m} | {hbm:.2f} | {n * k * 2 / hbm / 1e3:.0f} | "
                  f"{l2:.2f} | {lt:.2f} |")
    floor = sum(n * k * 2 for n, k in SHAPES.values()) * LAYERS / 3.0e12 * 1e6
    print(f"\nA step's projections (x {LAYERS} layers), us: "
          + ", ".join(f"M={m}: {from_hbm[m]:.0f} from HBM, {from_l2[m]:.0f} from L2"
                      for m in from_hbm)
          + f"; their weights at 3.0 TB/s: {floor:.0f}")


if __name__ == "__main__":
    main()
