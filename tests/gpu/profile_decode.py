"""Per-kernel GPU time of one decode step (torch.profiler): unfused, fused, fused + fp8 KV.

Random-weight Qwen3-0.6B (tests/gpu/test_model_gpu.py makes it), bf16, batch 131 (the
nano-vllm workload's mean decode batch), contexts U[100, 1024], page 256. A step is what
the worker runs: the forward, the LM head, and the fused sampling at temperature 0.6
(no logprobs, as the benchmark asks; its kernels are the `_gumbel_*` rows). Prints for each
variant a markdown table (kernel, calls, total us per step) and the step's GPU busy time
next to its bandwidth floor. Fused = Triton SiLU-and-mul and q/k norm + rotary in one
kernel; unfused = NANOSERVE_FUSED_KERNELS=0; fp8 = an fp8 KV cache (kernels/kv_quant.py).
The floor is (weight bytes + the batch's KV bytes, of the variant's KV dtype) / --hbm-tbs.
Each variant also replays the step from a CUDA graph (as the worker does) and prints its
wall time beside the kernels' sum: the difference is what launches and tails cost.
    python tests/gpu/profile_decode.py [--batch 131] [--hbm-tbs 3.0]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=131)
    ap.add_argument("--hbm-tbs", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    import models.activation
    from kernels.attention import select_backend
    from kernels.sampling import gumbel_sample
    from models.loader import load_model
    from paged_kv import PagedKV
    from test_model_gpu import main_checkpoint
    model, _ = load_model(str(main_checkpoint()), dtype=torch.bfloat16, device="cuda",
                          attn_backend=select_backend("triton", "cuda"))
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 1025, (args.batch,), generator=g).tolist()
    ids = torch.randint(0, 10000, (args.batch,), generator=g).cuda()
    temps = torch.full((args.batch,), 0.6, device="cuda")
    seeds = torch.randint(0, 2**31 - 1, (args.batch,), generator=g, dtype=torch.int32).cuda()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{torch.cuda.get_device_name()}, batch {args.batch}, contexts U[100,1024] "
          f"(mean {sum(ctx) / len(ctx):.0f}); weights {weight_bytes / 1e9:.2f} GB")

    for name, fused, fp8 in (("unfused", False, False), ("fused", True, False),
                             ("fused, fp8 KV", True, True)):
        kv = PagedKV(model, ctx, block_size=256, fp8=fp8)
        if fp8:
            kv.kv.copy_(torch.randn(kv.kv.shape, device="cuda").to(kv.kv.dtype))
            kv.scales.fill_(1.0)
        else:
            kv.kv.normal_()
        pos, meta = kv.metadata([(i, n - 1, n) for i, n in enumerate(ctx)], is_decode=True)
        shape = kv.kv.shape       # [2, layers, blocks, page, kv heads, head dim]
        row = shape[4] * shape[5] * kv.kv.element_size() + (4 if fp8 else 0)
        kv_bytes = sum(ctx) * 2 * shape[1] * row
        floor_ms = (weight_bytes + kv_bytes) / (args.hbm_tbs * 1e12) * 1e3

        def step():
            logits = model.compute_logits(model(ids, pos, meta))
            return gumbel_sample(logits, temps, seeds, logprobs=False)

        models.activation.FUSED = fused
        with torch.inference_mode():
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
        per = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name][0] += 1
                per[e.name][1] += e.device_time
        total = sum(t for _, t in per.values()) / args.steps
        calls = sum(c for c, _ in per.values()) / args.steps
        print(f"\n### {name} (NANOSERVE_FUSED_KERNELS={int(fused)}): {calls:.0f} kernels, "
              f"GPU busy {total / 1e3:.2f} ms/step; KV {kv_bytes / 1e9:.2f} GB -> floor "
              f"{floor_ms:.2f} ms at {args.hbm_tbs} TB/s: {total / 1e3 / floor_ms:.2f}x floor\n")
        graph_ms = _graph_step_ms(step)
        print(f"CUDA graph replay: {graph_ms:.2f} ms/step = {graph_ms / floor_ms:.2f}x floor; "
              f"{graph_ms - total / 1e3:+.2f} ms vs the kernels' sum "
              f"({(graph_ms * 1e3 - total) / calls:+.2f} us per kernel)\n")
        print("| kernel | calls/step | us/step | % |\n|---|---|---|---|")
        for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"| {name[:90]} | {c / args.steps:.0f} | {t / args.steps:.0f} | "
                  f"{100 * t / args.steps / total:.1f} |")


def _graph_step_ms(step, replays: int = 50) -> float:
    """Wall time of the step replayed from a CUDA graph, as the worker runs decode: the
    kernels' sum plus the gaps between them (launch latency, tails)."""
    from bench_decode_attention import capture_graph
    with torch.inference_mode():
        graph = capture_graph(step)
        for _ in range(5):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


if __name__ == "__main__":
    main()
