"""A mixed step's GPU time against its parts (issue 67: interactive decode beside an embedding
flood with the scheduler's --max-background-prefill-tokens): the runner in-process, CUDA
graphs on, a decode step of --decode rows (contexts of 256), a prefill of --chunks prompts of
--chunk-len tokens alone, and both in one step; then the mixed step's top kernels.

    python tests/gpu/profile_mixed.py --model DIR [--decode 8] [--chunks 2] [--chunk-len 512]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from test_deterministic import Stepper  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402

BS = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cprofile", action="store_true", help="also the mixed step's host time under cProfile")
    ap.add_argument("--deterministic", action="store_true", help="the worker's --deterministic")
    ap.add_argument("--profile-decode", action="store_true",
                    help="also the decode step: which executor takes it, its graph's replay "
                         "alone, and its kernels (torch profiler), not only the mixed step's")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    r = ModelRunner(RunnerConfig(model_dir=args.model, device=args.device,
                                 dtype="bfloat16" if cuda else "float32",
                                 max_model_len=4096 if cuda else 512, kv_cache_gb=8,
                                 deterministic=args.deterministic))
    r.init_kv(2048 if cuda else 64, BS)
    s = Stepper(r)
    blocks = itertools.count()
    ids = itertools.count(1)
    vocab = min(r.vocab_size, 10000)
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def new(n: int):
        return (next(ids), prompt(n), 0, [next(blocks) for _ in range(-(-r.max_model_len // BS))])

    dec = [new(256) for _ in range(args.decode)]
    s(prefills=dec)
    pos = {d[0]: 256 for d in dec}

    def decode_rows():
        return [(sid, 1) for sid in pos]

    def timed(label: str, make) -> None:
        times = []
        for _ in range(args.reps):
            kw = make()
            sync()
            t0 = time.perf_counter()
            s(**kw)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
            for sid in pos:
                pos[sid] += 1 if kw.get("decodes") else 0
        times.sort()
        print(f"{label:40s} min / median / max {times[0]:.2f} / {times[len(times) // 2]:.2f} / "
              f"{times[-1]:.2f} ms", flush=True)

    chunk = lambda: [new(args.chunk_len) for _ in range(args.chunks)]  # noqa: E731
    timed(f"decode {args.decode} rows", lambda: dict(decodes=decode_rows()))
    timed(f"prefill {args.chunks} x {args.chunk_len}", lambda: dict(prefills=chunk()))
    timed(f"mixed: both", lambda: dict(prefills=chunk(), decodes=decode_rows()))
    if args.cprofile:
        import cProfile
        import pstats
        kw = [dict(prefills=chunk(), decodes=decode_rows()) for _ in range(3)]
        with cProfile.Profile() as cp:
            for k in kw:
                s(**k)
                sync()
        pstats.Stats(cp).sort_stats("cumulative").print_stats(30)
    from torch.profiler import ProfilerActivity, profile
    steps = [("mixed", lambda: dict(prefills=chunk(), decodes=decode_rows()))]
    if args.profile_decode:
        decode_executor(r, decode_rows(), args.reps)
    if args.profile_decode:
        steps.insert(0, ("decode", lambda: dict(decodes=decode_rows())))
    for label, make in steps:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            s(**make())
            sync()
        print(f"{label} step:")
        print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                        row_limit=12))


def decode_executor(r: ModelRunner, rows: list[tuple[int, int]], reps: int) -> None:
    """Which executor takes a decode step of these rows, and, where it is the decode graphs,
    its bucket's replay alone against the whole step (plan + load + replay + logits): what
    the step adds around the graph."""
    import numpy as np
    from nanoserve.v1 import worker_pb2
    from worker_service.cuda_graphs import DecodeGraphs
    req = worker_pb2.StepRequest(step_id=10**6)
    req.decode.seq_ids_u64 = np.array([s for s, _ in rows], "<u8").tobytes()
    req.decode.token_ids_i32 = np.array([t for _, t in rows], "<i4").tobytes()
    plan = r.table.plan(req)
    step = r.inputs(plan)
    taker = next(e for e in r.executors if e.fits(step))
    print(f"decode step of {len(rows)} rows taken by {type(taker).__name__}", flush=True)
    if not isinstance(taker, DecodeGraphs):
        return
    graph = taker.graphs[taker.load(step)].graph
    for label, fn in (("graph replay alone", graph.replay), ("forward (load + replay)",
                                                            lambda: r.forward(plan))):
        times = []
        for _ in range(reps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        times = sorted(times[3:])
        print(f"{label:40s} min / median / max {times[0]:.3f} / {times[len(times) // 2]:.3f} / "
              f"{times[-1]:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
