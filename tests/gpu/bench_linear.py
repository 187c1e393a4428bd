"""Decode-sized GEMMs: cuBLAS (F.linear) against kernels/splitk_gemm.py's tilings.

For each Qwen3-0.6B projection (qkv, o, gate_up, down) and batch M, 28 weight copies (one
per layer, so weights stream from HBM as in a real step, not from L2) are multiplied
back to back inside one CUDA graph; us per call = replay time / 28, and GB/s = weight
bytes / that time. Prints every tiling tried at --sweep-m, then cuBLAS against the
heuristic's pick (`pick_config`) at every --m, then a whole step's GEMMs (the four
projections x 28 layers interleaved) both ways.
    python tests/gpu/bench_linear.py [--sweep-m 144] [--m 1,16,64,131,144,256]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode_attention import gpu_time_ms  # noqa: E402
from kernels.splitk_gemm import WORKSPACE, GemmConfig, pick_config, splitk_gemm  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LAYERS = 28


def per_call_us(calls) -> float:
    """GPU time of the calls run back to back from one graph, per call, in us."""
    return gpu_time_ms(lambda: [c() for c in calls], reps=20) * 1e3 / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep-m", type=int, default=144, help="batch at which to sweep tilings")
    ap.add_argument("--m", default="1,16,64,131,144,256", help="batches for cuBLAS vs pick")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, bf16, {LAYERS} weight copies per shape\n")
    weights = {s: [torch.randn(SHAPES[s], dtype=torch.bfloat16, device=dev) * 0.05
                   for _ in range(LAYERS)] for s in args.shapes.split(",")}

    if args.sweep_m:
        m = args.sweep_m
        print(f"### Tilings at M = {m} (us per call; cuBLAS first)\n")
        print("| shape | N x K | config | us | GB/s |\n|---|---|---|---|---|")
        grid = [GemmConfig(bm, bn, 64 if bm == 256 else 128, sk, 8 if bm * bn >= 16384 else 4, 3)
                for bm, bn, sk in itertools.product((32, 64, 128, 256), (32, 64, 128), (1, 2, 4, 8))]
        for name, ws in weights.items():
            n, k = ws[0].shape
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            ref = F.linear(x, ws[0])
            nbytes = ws[0].numel() * 2
            us = per_call_us([lambda w=w: F.linear(x, w) for w in ws])
            print(f"| {name} | {n} x {k} | cuBLAS | {us:.2f} | {nbytes / us / 1e3:.0f} |")
            results = []
            for c in grid:
                if c.split_k > 1 and k % (c.split_k * c.block_k):
                    continue
                try:
                    torch.testing.assert_close(splitk_gemm(x, ws[0], c), ref, atol=3e-2, rtol=2e-2)
                    us = per_call_us([lambda w=w: splitk_gemm(x, w, c) for w in ws])
                except Exception as e:   # a tiling that does not fit (shared memory, registers)
                    print(f"| {name} | {n} x {k} | {c} | failed: {type(e).__name__} | |")
                    continue
                results.append((us, c))
            for us, c in sorted(results, key=lambda r: r[0])[:8]:
                print(f"| {name} | {n} x {k} | {c} | {us:.2f} | {nbytes / us / 1e3:.0f} |")
        print()

    print("### cuBLAS with weights from HBM (28 copies) and from L2 (one copy, 28 times)\n")
    print("| shape | M | HBM us | L2 us | cuBLASLt HBM us |\n|---|---|---|---|---|")
    for name, ws in weights.items():
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, ws[0].shape[1], dtype=torch.bfloat16, device=dev)
            hbm = per_call_us([lambda w=w: F.linear(x, w) for w in ws])
            l2 = per_call_us([lambda: F.linear(x, ws[0])] * LAYERS)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            lt = per_call_us([lambda w=w: F.linear(x, w) for w in ws])
            torch.backends.cuda.preferred_blas_library("cublas")
            print(f"| {name} | {m} | {hbm:.2f} | {l2:.2f} | {lt:.2f} |")
    print()

    print("### cuBLAS vs pick_config (us per call)\n")
    print("| shape | M | cuBLAS us | pick us | speed-up | pick |\n|---|---|---|---|---|---|")
    for name, ws in weights.items():
        n, k = ws[0].shape
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            c = pick_config(m, n, k, sms)
            base = per_call_us([lambda w=w: F.linear(x, w) for w in ws])
            if c is None:
                print(f"| {name} | {m} | {base:.2f} | - | - | cuBLAS |")
                continue
            # the same result as cuBLAS up to fp32 summation order, and deterministic
            y = splitk_gemm(x, ws[0], c)
            torch.testing.assert_close(y, F.linear(x, ws[0]), atol=3e-2, rtol=2e-2)
            assert all(torch.equal(y, splitk_gemm(x, ws[0], c)) for _ in range(3))
            us = per_call_us([lambda w=w: splitk_gemm(x, w, c) for w in ws])
            print(f"| {name} | {m} | {base:.2f} | {us:.2f} | {base / us:.2f}x | {c} |")

    print("\n### A step's GEMMs: the four projections x 28 layers, interleaved (us per step)\n")
    print("| M | cuBLAS | pick | saved |\n|---|---|---|---|")
    for m in map(int, args.m.split(",")):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16, device=dev) for k in (1024, 2048, 3072)}
        layer = list(zip(*weights.values()))
        def step(gemm):
            return [lambda w=w, g=gemm: g(xs[w.shape[1]], w) for ws in layer for w in ws]
        def picked(x, w):
            c = pick_config(x.shape[0], w.shape[0], w.shape[1], sms)
            return F.linear(x, w) if c is None else splitk_gemm(x, w, c)
        calls = len(layer) * len(weights)
        base = per_call_us(step(F.linear)) * calls
        ours = per_call_us(step(picked)) * calls
        print(f"| {m} | {base:.0f} | {ours:.0f} | {base - ours:.0f} |")
    counters = WORKSPACE.count.get(dev)
    assert counters is None or not counters.any(), "a tile counter was left armed"


if __name__ == "__main__":
    main()
