"""Issue 68's determinism targets against a running server: one prompt answered --runs times
(200), each beside a random concurrent load (0..--max-load other requests of random lengths,
greedy and sampled), greedy and then seeded; prints how many distinct completions each gave
(target with --deterministic workers: 1 and 1; without: record it). --copies K sends the
prompt K times a round, each copy starting after a random 0-50 ms, so the copies land at other
rows and steps of the same load and all but the first hit the prefix cache: --runs answers in
--runs / K rounds.

    python -m scheduler_service.launch --model ~/Qwen3-8B --deterministic &   # or without
    python tests/gpu/bench_deterministic.py --target 127.0.0.1:50051 [--runs 200]

The overhead targets (<= 15% on nano-vllm's workload, <= 5% at batch 1) are client.bench's
throughput with and without --deterministic on the same host:
    python -m client.bench --target 127.0.0.1:50051 --runs 3 --json det.json
    python -m client.bench --target 127.0.0.1:50051 --num-seqs 1 --runs 3 --json det_b1.json
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import sys
import time

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from nanoserve.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402


def complete(stub, prompt: list[int], max_tokens: int, **sampling) -> tuple[int, ...]:
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
    return tuple(stub.Complete(req, timeout=600).token_ids)


def distinct(stub, pool, prompt: list[int], sampling: dict, args, rnd: random.Random) -> int:
    """Completions of `prompt` over args.runs runs, each beside a fresh random load."""
    seen = set()
    for _ in range(-(-args.runs // args.copies)):
        load = []
        for _ in range(rnd.randint(0, args.max_load)):
            other = [rnd.randrange(args.vocab) for _ in range(rnd.randint(16, args.max_load_len))]
            load.append(pool.submit(complete, stub, other, rnd.randint(1, args.max_tokens),
                                    temperature=rnd.choice([0.0, 0.6])))
        copies = [pool.submit(delayed, rnd.uniform(0, 0.05) if k else 0.0, stub, prompt,
                              args.max_tokens, sampling) for k in range(args.copies)]
        seen.update(f.result() for f in copies)
        for f in load:
            f.result()
    return len(seen)


def delayed(wait_s: float, stub, prompt: list[int], max_tokens: int, sampling: dict):
    time.sleep(wait_s)
    return complete(stub, prompt, max_tokens, **sampling)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-load", type=int, default=32, help="most concurrent other requests")
    p.add_argument("--copies", type=int, default=1,
                   help="the prompt's copies a round, beside the same load (runs / copies rounds)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rnd = random.Random(args.seed)
    with grpc.insecure_channel(args.target) as channel, \
            cf.ThreadPoolExecutor(args.max_load + args.copies) as pool:
        stub = generate_pb2_grpc.GenerationStub(channel)
        info = stub.GetModelInfo(generate_pb2.ModelInfoRequest(), timeout=10)
        args.vocab = min(10000, info.vocab_size)   # nano-vllm's ids, a tiny model's vocab
        args.max_load_len = min(1024, info.max_model_len - args.max_tokens - 1)
        prompt = [rnd.randrange(args.vocab) for _ in range(200)]
        stats = stub.GetStats(generate_pb2.StatsRequest(), timeout=10)
        out = {"deterministic": stats.deterministic, "runs": args.runs, "copies": args.copies,
               "max_tokens": args.max_tokens,
               "greedy_distinct": distinct(stub, pool, prompt, dict(temperature=0.0), args, rnd),
               "seeded_distinct": distinct(stub, pool, prompt, dict(temperature=0.8, seed=7),
                                           args, rnd)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
