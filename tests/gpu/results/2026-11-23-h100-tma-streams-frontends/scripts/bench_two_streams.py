"""Experiment: a decode step's batch cut into C chunks whose forwards run on C streams of one
CUDA graph, so one chunk's GEMMs (latency-bound at decode sizes) overlap another's attention
(bandwidth-bound). Graph-replay ms per step vs the whole batch on one stream.
PYTHONPATH=.:protos python tests/gpu/experiments/two_streams/bench_two_streams.py"""
import os
import sys

import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))   # tests/
sys.path.insert(0, os.path.join(HERE, "..", ".."))         # tests/gpu/
from kernels.attention import select_backend  # noqa: E402
from models.loader import load_model  # noqa: E402
from paged_kv import PagedKV  # noqa: E402
from profile_decode import _graph_step_ms  # noqa: E402
from test_model_gpu import main_checkpoint  # noqa: E402


def main() -> None:
    model, _ = load_model(str(main_checkpoint()), dtype=torch.bfloat16, device="cuda",
                          attn_backend=select_backend("triton", "cuda"))
    print(torch.cuda.get_device_name())
    print("| kv | batch | ctx | variant | ms/step (min of 3) | vs one stream |\n|---|---|---|---|---|---|")
    for fp8 in (True, False):
        for batch, hi in ((131, 1024), (131, 2048), (256, 2048), (64, 1024)):
            g = torch.Generator().manual_seed(0)
            ctx = torch.randint(100, hi + 1, (batch,), generator=g).tolist()
            ids = torch.randint(0, 10000, (batch,), generator=g).cuda()
            kv = PagedKV(model, ctx, block_size=256, fp8=fp8)
            if fp8:
                kv.kv.copy_(torch.randn(kv.kv.shape, device="cuda").to(kv.kv.dtype))
                kv.scales.fill_(1.0)
            else:
                kv.kv.normal_()

            def chunked(n):
                parts = [list(range(batch))[i::n] for i in range(n)]
                out = []
                for p in parts:
                    pos, meta = kv.metadata([(i, ctx[i] - 1, ctx[i]) for i in p], is_decode=True)
                    out.append((ids[p].clone(), pos, meta))
                return out

            def run(parts, streams):
                outs = []
                if streams is None:
                    return [model.compute_logits(model(*a)) for a in parts]
                main_s = torch.cuda.current_stream()
                for s in streams:
                    s.wait_stream(main_s)
                for a, s in zip(parts, streams):
                    with torch.cuda.stream(s):
                        outs.append(model.compute_logits(model(*a)))
                for s in streams:
                    main_s.wait_stream(s)
                return outs

            base = None
            for name, n, par in (("one stream", 1, False), ("2 chunks, one stream", 2, False),
                                 ("2 chunks, 2 streams", 2, True), ("3 chunks, 3 streams", 3, True),
                                 ("4 chunks, 4 streams", 4, True)):
                parts = chunked(n)
                streams = [torch.cuda.Stream() for _ in range(n)] if par else None
                with torch.inference_mode():
                    if par:   # same logits as the one-stream run
                        ref = torch.cat(run(parts, None))
                        got = torch.cat(run(parts, streams))
                        torch.cuda.synchronize()
                        assert torch.equal(ref, got), name
                    ms = min(_graph_step_ms(lambda: run(parts, streams)) for _ in range(3))
                base = base or ms
                print(f"| {'fp8' if fp8 else 'bf16'} | {batch} | U[100,{hi}] | {name} | "
                      f"{ms:.3f} | {ms / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
