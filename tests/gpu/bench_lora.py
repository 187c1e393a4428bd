"""The multi-LoRA path (models/lora.py LoraSlots.apply: kernels/lora.py's shrink + expand)
at Qwen3-8B shapes on a GPU: time per module against its base GEMM, and the bytes the
kernels must read (adapters used by the step + activations) over that time.

    python tests/gpu/bench_lora.py [--rank 16] [--slots 16] [--adapters 16]

Rows are spread evenly over `--adapters` slots. Each module's time includes the step's row
grouping (lora_rows) and h workspace memset, which a real step pays once, not per module. CUDA-event timing of 50 CUDA-graph replays
after 10 warm-ups, median of 5 such runs.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import types

from kernels.lora import lora_rows
from models.lora import LoraContext, LoraSlots
from models.parallel import TPGroup

# (name, K, output parts) per module group, Qwen3-8B, TP=1
MODULES = [("qkv", 4096, [4096, 1024, 1024]), ("o", 4096, [4096]),
           ("gate_up", 4096, [12288, 12288]), ("down", 12288, [4096])]


def timed(fn, reps: int = 50) -> float:
    """GPU time of fn replayed from a CUDA graph (as the decode step runs it: no Python
    launch cost), ms."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    fn = g.replay
    for _ in range(10):
        fn()
    runs = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        runs.append(a.elapsed_time(b) / reps)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--tokens", default="1,8,64,256,2048")
    args = p.parse_args()
    dev, dt, r, S = "cuda", torch.bfloat16, args.rank, args.slots
    print(f"{torch.cuda.get_device_name()}, rank {r}, {S} slots, rows over {args.adapters} adapters")
    print("| module | T | base GEMM us | LoRA us | LoRA / base | LoRA GB/s |")
    print("|---|---|---|---|---|---|")
    for T in map(int, args.tokens.split(",")):
        slot = (torch.arange(T, device=dev) % args.adapters).to(torch.int32)
        ctx = LoraContext()
        used = min(T, args.adapters)
        for name, K, parts in MODULES:
            N = sum(parts)
            x = torch.randn(T, K, device=dev, dtype=dt)
            w = torch.randn(N, K, device=dev, dtype=dt) * 0.01
            lora = LoraSlots(types.SimpleNamespace(weight=w, tp=TPGroup()), parts, False, S, r, ctx)
            lora.a.normal_(std=0.01)
            lora.b.normal_(std=0.01)
            lora.scale.fill_(1.0)
            y = torch.empty(T, N, device=dev, dtype=dt)

            def apply():
                ctx.rows = lora_rows(slot, S)   # per step, as the runner and graphs do
                lora.apply(x, y)

            base_us = timed(lambda: torch.matmul(x, w.t(), out=y)) * 1e3
            lora_us = timed(apply) * 1e3
            nbytes = used * (lora.a[0].numel() + lora.b[0].numel()) * 2 + 2 * T * (K + 2 * N) * 2
            print(f"| {name} | {T} | {base_us:.1f} | {lora_us:.1f} | {lora_us / base_us:.2f} | "
                  f"{nbytes / lora_us / 1e3:.0f} |")


if __name__ == "__main__":
    main()
