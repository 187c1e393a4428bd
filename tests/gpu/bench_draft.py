"""Speculative decoding with a draft model, its parts on one GPU (issue 47): what a step of
the target costs, what drafting k tokens adds, and the speed-up those give at a few mean
acceptance lengths (computed from the measured parts, labelled so).

One ModelRunner holds the target and the draft model or EAGLE-3 head
(worker_service/drafter.py), as the worker does; one sequence of --context tokens decodes at batch 1, its KV rewound each step so the
context stays fixed. Each figure is the median wall time of runner.step (launch + answer,
host work included) over --iters steps, after warm-up:
  target step        1 row, no drafts (the draft's mirror of the row included)
  verify step        1 + k rows (k proposals), no drafts (mirror of 1 + k rows included)
  the loop           what the worker runs under --speculative draft: each step verifies the
                     last step's k drafts and asks for k more (its context grows); its rows
                     are those drafts, so the mirror skips them (drafter.py)
The mirror (the draft model run on the step's rows to keep its KV) is timed alone too.
    python tests/gpu/bench_draft.py --target DIR --draft DIR [-k 4] [--context 256]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from nanoserve.v1 import worker_pb2  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402

BLOCK = 256


def decode_req(step_id: int, tokens: list[int], num_samples: int, num_drafts: int,
               kv_len: int) -> worker_pb2.StepRequest:
    req = worker_pb2.StepRequest(step_id=step_id)
    d = req.decode
    d.seq_ids_u64 = np.array([1], "<u8").tobytes()
    d.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    d.num_tokens_i32 = np.array([len(tokens)], "<i4").tobytes()
    d.num_samples_i32 = np.array([num_samples], "<i4").tobytes()
    if num_drafts:
        d.num_drafts_i32 = np.array([num_drafts], "<i4").tobytes()
    d.kv_len_i32 = np.array([0, kv_len], "<i4").tobytes()
    return req


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graphs_match_eager(runner, seq: dict, step: list, k: int) -> bool:
    """One loop step's drafts twice from the same state: with the drafter's CUDA graphs,
    then eager (the same KV positions written from the same inputs)."""
    outs = []
    saved = runner.drafter.executors   # [graphs, eager]
    for executors in (saved, saved[-1:]):
        runner.drafter.executors = executors
        step[0] += 1
        d = seq["drafts"]
        req = decode_req(step[0], [seq["newest"], *d], 1 + len(d), k, seq["known"] - 1)
        resp = runner.step(req)
        outs.append(np.frombuffer(resp.draft_token_ids_i32, "<i4").tolist())
    runner.drafter.executors = saved
    if outs[0] != outs[1]:
        print(f"graphs {outs[0]} vs eager {outs[1]}")
    return outs[0] == outs[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run on tiny checkpoints")
    args = ap.parse_args()
    k, ctx = args.k, args.context
    runner = ModelRunner(RunnerConfig(args.target, device=args.device, max_model_len=4096,
                                      max_num_seqs=16, draft_model=args.draft))
    runner.init_kv(-(-(ctx + (args.iters + 20) * (k + 1) + 8) // BLOCK), BLOCK)
    req = worker_pb2.StepRequest(step_id=1)
    w = req.seqs.add(seq_id=1, num_tokens=ctx, start_pos=0, sample=True, reset_block_table=True,
                     block_table_i32=np.arange(runner.num_blocks, dtype="<i4").tobytes())
    w.sampling.temperature = 0.0
    req.token_ids_i32 = np.random.default_rng(0).integers(0, 320, ctx).astype("<i4").tobytes()
    first = runner.step(req)
    step = [1]
    seq = {"known": ctx + 1, "newest": int(np.frombuffer(first.sampled_token_ids_i32, "<i4")[0]),
           "drafts": [], "accepted": []}

    def loop():
        """A step of the speculative loop: verify the last drafts, draft k more."""
        step[0] += 1
        d = seq["drafts"]
        resp = runner.step(decode_req(step[0], [seq["newest"], *d], 1 + len(d), k,
                                      seq["known"] - 1))
        sampled = np.frombuffer(resp.sampled_token_ids_i32, "<i4").tolist()
        a = 0
        while a < len(d) and d[a] == sampled[a]:
            a += 1
        seq["accepted"].append(a)
        seq["known"] += a + 1
        seq["newest"] = sampled[a]
        seq["drafts"] = [t for t in np.frombuffer(resp.draft_token_ids_i32, "<i4").tolist() if t >= 0]

    def run(rows: int, drafts: int):
        def go():
            step[0] += 1
            runner.step(decode_req(step[0], [7] * rows, rows, drafts, ctx))
        return go

    def mirror(rows: int):
        """The drafter's mirror of a step of `rows` rows (after the target's forward of it,
        whose features an EAGLE-3 head reads)."""
        plan = runner.table.plan(decode_req(0, [7] * rows, rows, 0, ctx))
        samples = torch.full((rows,), 7, dtype=torch.int64, device=runner.device)
        fwd = runner.forward(plan)

        def go():
            runner.drafter.mirror(runner.inputs(plan), runner.table, fwd, samples)
        return go

    with torch.inference_mode():
        for fn in (run(1, 0), run(1 + k, 0), mirror(1), mirror(1 + k)):
            median_ms(fn, 5)   # warm-up
        t1 = median_ms(run(1, 0), args.iters)
        tv = median_ms(run(1 + k, 0), args.iters)
        seq["known"] = ctx + 1   # the loop from the prompt's sample (its KV as the prefill left it)
        median_ms(loop, 5)
        tvd = median_ms(loop, args.iters)
        same = graphs_match_eager(runner, seq, step, k)
        m1 = median_ms(mirror(1), args.iters)   # (plans rewinding the context: after the loop)
        mv = median_ms(mirror(1 + k), args.iters)
    target1, targetv = t1 - m1, tv - mv
    drafting = tvd - targetv   # what the loop adds to the target's verify step
    per_token = drafting / k
    mean_len = 1 + np.mean(seq["accepted"][-args.iters:])
    dev = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
    print(f"### Draft model parts: {dev}, target {os.path.basename(args.target)}, draft "
          f"{os.path.basename(args.draft)}, batch 1, context {ctx}, k = {k} (median of "
          f"{args.iters} steps, ms)\n")
    print("| part | ms |\n|---|---|")
    for name, v in [("target step, 1 row (mirror excluded)", target1),
                    (f"target verify step, {1 + k} rows (mirror excluded)", targetv),
                    ("draft mirror, 1 row", m1), (f"draft mirror, {1 + k} rows", mv),
                    (f"the loop's step: verify {k} drafts, draft {k} (mean acceptance length "
                     f"{mean_len:.2f})", tvd),
                    (f"of which drafting (the loop's step - the target's verify step)", drafting)]:
        print(f"| {name} | {v:.3f} |")
    print(f"\ndraft cost per proposed token: {per_token:.3f} ms = "
          f"{100 * per_token / target1:.1f}% of a target step (issue target <= "
          f"{'3% for an EAGLE-3 head' if hasattr(runner.drafter, 'head') else '8% for a draft model'})")
    print(f"the loop at its measured acceptance: {1e3 * mean_len / tvd:,.0f} tok/s, "
          f"{mean_len * target1 / tvd:.2f}x plain\n")
    print("computed (not measured) speed-up over plain decoding at batch 1, from the parts:")
    print("| mean acceptance length (tokens per verify step) | tok/s | speed-up |\n|---|---|---|")
    for length in sorted({2, 3, 4, k + 1}):
        if length <= k + 1:
            print(f"| {length} | {1e3 * length / tvd:,.0f} | {length * target1 / tvd:.2f}x |")
    print(f"| plain (no speculation) | {1e3 / target1:,.0f} | 1.00x |")
    print(f"\nthe drafter's CUDA graphs against eager, one loop step: "
          f"{'the same drafts' if same else 'DRAFTS DIFFER'}")


if __name__ == "__main__":
    main()
