"""The fused sampling kernels at decode batches: GPU time per call, and what reading the
logits alone would take.

Logits [N, 151936] (Qwen3's vocab) in bf16, temperature 0.6, one call replayed from a
CUDA graph with L2 flushed (bench_decode_attention.gpu_time_ms), as a step runs it after
the LM head. Variants: the default (the sampled ids' logprobs too: what a step pays when
a request asks for them) and logprobs=False (the usual step); --module times another
implementation of `gumbel_sample` with the same call (an earlier version, for an A/B).
    python tests/gpu/bench_sampling.py [--n 1,32,64,131,256] [--module kernels.sampling]
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), ".."), os.path.dirname(__file__)]

from bench_decode_attention import gpu_time_ms  # noqa: E402

VOCAB = 151936


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="1,32,64,131,256", help="rows (decode batches) to time")
    ap.add_argument("--module", default="kernels.sampling", help="module holding gumbel_sample")
    ap.add_argument("--hbm-tbs", type=float, default=3.0)
    args = ap.parse_args()
    sample = importlib.import_module(args.module).gumbel_sample
    variants = {"logprobs": {}}
    if "logprobs" in inspect.signature(sample).parameters:
        variants["no logprobs"] = {"logprobs": False}
    print(f"{torch.cuda.get_device_name()}, {args.module}, bf16 logits [N, {VOCAB}], T = 0.6\n")
    print("| N | variant | us | logits read alone, us |\n|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in map(int, args.n.split(",")):
        logits = (torch.randn(n, VOCAB, device="cuda", generator=g) * 3).bfloat16()
        temps = torch.full((n,), 0.6, device="cuda")
        seeds = torch.randint(0, 2**31 - 1, (n,), device="cuda", generator=g, dtype=torch.int32)
        floor_us = logits.numel() * logits.element_size() / (args.hbm_tbs * 1e12) * 1e6
        for name, kw in variants.items():
            us = gpu_time_ms(lambda: sample(logits, temps, seeds, **kw)) * 1e3
            print(f"| {n} | {name} | {us:.1f} | {floor_us:.1f} |")


if __name__ == "__main__":
    main()
