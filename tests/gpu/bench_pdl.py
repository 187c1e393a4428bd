"""Programmatic dependent launch (kernels/pdl.py), before and after, on the decode step the
worker replays: its CUDA graph, at batch 1 and 8.

    python tests/gpu/bench_pdl.py [--model DIR] [--quantization fp8 --fp8-kv] [--batches 1,8]

For each setting (pdl off / on; --max-rows: kernels of more rows launch without; unfused-quant:
FP8 GEMMs quantize their input themselves) the step (forward, LM head, greedy
sampling) is captured and replayed: ms per step over --replays replays, --sets times
(min / median / max), and the step's logits checked against the first setting's: the
settings change when kernels start and how a loop is scheduled, never a value, so the
logits must be equal bit for bit (the first replay's and the last's) and the tokens the
same.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

# name -> (PDL on, norms / SiLU hand FP8 GEMMs their input quantized: models/linear.py)
SETTINGS = {"base": (False, True), "pdl": (True, True), "unfused-quant": (True, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the random 0.6B)")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8"])
    ap.add_argument("--fp8-kv", action="store_true")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--sets", type=int, default=5)
    ap.add_argument("--max-rows", type=int, default=None, help="kernels.pdl.MAX_ROWS")
    args = ap.parse_args()
    import kernels.pdl
    if args.max_rows is not None:
        kernels.pdl.MAX_ROWS = args.max_rows
    from bench_decode_attention import capture_graph
    from kernels.attention import select_backend
    from kernels.sampling import gumbel_sample
    from models.linear import LinearBase
    from models.loader import load_model
    from paged_kv import PagedKV
    from test_model_gpu import main_checkpoint
    takes = LinearBase.takes_fp8_rows
    path = args.model or str(main_checkpoint())
    model, _ = load_model(path, dtype=torch.bfloat16, device="cuda",
                          attn_backend=select_backend("triton", "cuda"),
                          quantization=args.quantization)
    print(f"### {torch.cuda.get_device_name()}: {os.path.basename(path)}, weights "
          f"{args.quantization}, KV {'fp8' if args.fp8_kv else 'bf16'}; decode step from its "
          f"CUDA graph, ms (min / median / max of {args.sets} x {args.replays} replays)\n")
    print("| batch | setting | step ms | vs base | logits equal base | tokens equal |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        ctx = torch.randint(100, 1025, (batch,), generator=g).tolist()
        ids = torch.randint(0, 10000, (batch,), generator=g).cuda()
        kv = PagedKV(model, ctx, block_size=256, fp8=args.fp8_kv)
        if args.fp8_kv:
            kv.kv.copy_(torch.randn(kv.kv.shape, device="cuda").to(kv.kv.dtype))
            kv.scales.fill_(1.0)
        else:
            kv.kv.normal_()
        pos, meta = kv.metadata([(i, n - 1, n) for i, n in enumerate(ctx)], is_decode=True)
        temps = torch.zeros(batch, device="cuda")
        seeds = torch.zeros(batch, dtype=torch.int32, device="cuda")
        out: dict[str, torch.Tensor] = {}

        def step():
            logits = model.compute_logits(model(ids, pos, meta))
            out["logits"] = logits
            out["tokens"] = gumbel_sample(logits, temps, seeds, logprobs=False, greedy=True)[0]

        base = None
        for name in args.settings.split(","):
            kernels.pdl.ENABLED, fused_quant = SETTINGS[name]
            LinearBase.takes_fp8_rows = takes if fused_quant else lambda self, x: False
            with torch.inference_mode():
                graph = capture_graph(step)
                graph.replay()
                torch.cuda.synchronize()
                logits, tokens = out["logits"].clone(), out["tokens"].clone()
                times = []
                for _ in range(args.sets):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(args.replays):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / args.replays)
                stable = torch.equal(out["logits"], logits)   # (the last replay's: no race)
            del graph
            med = statistics.median(times)
            if base is None:
                base = (med, logits, tokens)
            same = torch.equal(logits, base[1]) and stable
            diff = "" if same else f" (max diff {(logits.float() - base[1].float()).abs().max():.3g})"
            print(f"| {batch} | {name} | {min(times):.3f} / {med:.3f} / {max(times):.3f} | "
                  f"{med / base[0]:.3f}x | {same}{diff} | {torch.equal(tokens, base[2])} |",
                  flush=True)
        del kv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
