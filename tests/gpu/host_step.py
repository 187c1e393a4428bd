"""The host's side of a served decode step (issue 63): the runner in-process, CUDA graphs on,
stepped as the worker serves it (placeholder ids, the next step launched before the last
is answered), with the host time of each launch phase, of the answer, and the step period.
At batch 1 a 0.6B step's graph runs ~0.85 ms; where the host's launch takes longer the
device waits on it, and this says which phase to cut.

    python tests/gpu/host_step.py --model DIR [--rows 1] [--steps 300] [--cprofile 100]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from nanoserve.v1 import worker_pb2  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from worker_service.pending_step import PendingStep  # noqa: E402

BS = 256   # tokens a KV block
acc: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner, name: str, label: str) -> None:
    """Wrap owner.name so each call's host time goes to acc[label]."""
    f = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label].append(time.perf_counter() - t0)
    setattr(owner, name, wrapper)


def prefill(r: ModelRunner, rows: int, prompt: int) -> None:
    req = worker_pb2.StepRequest(step_id=1)
    width = -(-r.max_model_len // BS)
    g = torch.Generator().manual_seed(0)
    for i in range(rows):
        w = req.seqs.add(seq_id=i + 1, num_tokens=prompt, start_pos=0, sample=True,
                         reset_block_table=True,
                         block_table_i32=np.arange(i * width, (i + 1) * width, dtype="<i4").tobytes())
        w.sampling.temperature = 0.0
    req.token_ids_i32 = torch.randint(0, min(r.vocab_size, 10000), (rows * prompt,),
                                      generator=g).numpy().astype("<i4").tobytes()
    r.finish(r.launch(req))


def decode(step_id: int, rows: int) -> worker_pb2.StepRequest:
    """A decode step whose ids are all placeholders: last step's samples, as served."""
    req = worker_pb2.StepRequest(step_id=step_id)
    req.decode.seq_ids_u64 = np.arange(1, rows + 1, dtype="<u8").tobytes()
    req.decode.token_ids_i32 = np.full(rows, -1, "<i4").tobytes()
    return req


def run_steps(r: ModelRunner, first: int, n: int, rows: int, depth: int) -> list[float]:
    """n decode steps, `depth` in flight; returns the launch-to-launch periods (s) and
    fills acc with the phases' host times."""
    pending: collections.deque = collections.deque()
    starts = []
    for i in range(n):
        starts.append(time.perf_counter())
        t0 = time.perf_counter()
        pending.append(r.launch(decode(first + i, rows)))
        acc["launch (all of it)"].append(time.perf_counter() - t0)
        if len(pending) >= depth:
            t0 = time.perf_counter()
            resp = r.finish(pending.popleft())
            acc["finish (wait + answer)"].append(time.perf_counter() - t0)
            acc["gpu_ms (events)"].append(resp.gpu_ms / 1e3)
    while pending:
        r.finish(pending.popleft())
    return list(np.diff(starts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=1, help="decode rows a step")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--depth", type=int, default=2, help="steps in flight (the worker: 2+)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="then this many more steps under cProfile: its top functions")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    r = ModelRunner(RunnerConfig(model_dir=args.model, device=args.device,
                                 dtype="bfloat16" if cuda else "float32",
                                 max_model_len=4096 if cuda else 512, kv_cache_gb=2))
    r.init_kv(max(args.rows * (-(-r.max_model_len // BS)), 16), BS)
    prefill(r, args.rows, 256)
    run_steps(r, 2, 20, args.rows, args.depth)   # warm-up
    acc.clear()
    timed(r.table, "plan", "plan")
    for name in ("_before_forward", "inputs", "_sample", "_commit", "_after_step"):
        timed(r, name, name.strip("_"))
    for ex in r.executors:
        timed(ex, "run", f"forward: {type(ex).__name__}")
        if hasattr(ex, "load"):
            timed(ex, "load", f"  load: {type(ex).__name__}")
    timed(torch.cuda.CUDAGraph, "replay", "  graph replay (host)")
    timed(PendingStep, "copy_answer", "copy_answer")
    periods = run_steps(r, 100, args.steps, args.rows, args.depth)
    print(f"{args.rows} rows, {args.steps} steps, {args.depth} in flight; host ms a call, "
          f"min / median / max (calls a step)")
    rows = [("step period (launch to launch)", periods), *acc.items()]
    for label, xs in rows:
        xs = sorted(x * 1e3 for x in xs)
        print(f"  {label:34s} {xs[0]:7.3f} {xs[len(xs) // 2]:7.3f} {xs[-1]:7.3f}"
              f"   ({len(xs) / args.steps:.2f})")
    if args.cprofile:
        import cProfile
        import pstats
        with cProfile.Profile() as cp:
            run_steps(r, 100 + args.steps, args.cprofile, args.rows, args.depth)
        pstats.Stats(cp).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
