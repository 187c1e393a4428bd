"""Structured output on a GPU, through gRPC against a running scheduler (run.sh structured).

Prints a short Markdown report:
  * validity: concurrent requests sampled at temperature 1 under a bounded JSON Schema,
    a regex and a choice; every completion that ends with "stop" must parse / match;
  * time to first token: unconstrained, a schema never seen before (compile included),
    the same schema again (cached), sequential requests, median and p90 over --ttft-runs;
  * the server's fast-forward tokens and mismatches (exit 1 on any mismatch).
The throughput side is client.bench --json-schema (run.sh runs it next to this).

    python tests/gpu/structured_check.py --target 127.0.0.1:50051
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, ".")
from client.client import Client, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)"
CHOICES = ["red", "green", "blue sky"]


def valid(kind: str, text: str) -> bool:
    try:
        if kind == "json_schema":
            v = json.loads(text)
            return (set(v) == {"name", "age", "tags"} and isinstance(v["name"], str)
                    and len(v["name"]) <= 12 and isinstance(v["age"], int)
                    and 0 <= v["age"] <= 120 and set(v["tags"]) <= {"a", "b", "c"})
        if kind == "regex":
            return re.fullmatch(REGEX, text) is not None
        return text in CHOICES
    except (ValueError, TypeError, KeyError):
        return False


def validity(client: Client, n: int, hi: int) -> list[str]:
    kinds = {"json_schema": dict(json_schema=SCHEMA), "regex": dict(regex=REGEX),
             "choice": dict(choice=CHOICES)}
    rows = ["| format | requests | ended stop | valid of stopped |", "|---|---|---|---|"]
    for kind, fmt in kinds.items():
        def one(seed: int):
            prompt = [random.Random(seed).randrange(hi) for _ in range(64)]
            return client.complete(prompt, SamplingParams(temperature=1.0, seed=seed,
                                                          max_tokens=400, **fmt),
                                   skip_special_tokens=True)
        with ThreadPoolExecutor(n) as pool:
            done = list(pool.map(one, range(n)))
        stopped = [d for d in done if d.finish_reason == "stop"]
        good = sum(valid(kind, d.text) for d in stopped)
        rows.append(f"| {kind} | {n} | {len(stopped)} | {good}/{len(stopped)} |")
    return rows


def ttft(client: Client, params: SamplingParams, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    for chunk in client.generate(prompt, params):
        if chunk.token_ids:
            return (time.perf_counter() - t0) * 1e3
    return float("nan")


def first_tokens(client: Client, runs: int, hi: int) -> list[str]:
    rng = random.Random(0)
    out = {"free": [], "new schema": [], "cached schema": []}
    for i in range(runs):
        prompts = [[rng.randrange(hi) for _ in range(256)] for _ in range(3)]  # no cache hits
        new = dict(SCHEMA, properties={**SCHEMA["properties"], f"field_{i}_{rng.random()}":
                                       {"type": "integer"}})
        out["free"].append(ttft(client, SamplingParams(max_tokens=2), prompts[0]))
        out["new schema"].append(ttft(client, SamplingParams(max_tokens=2, json_schema=new), prompts[1]))
        out["cached schema"].append(ttft(client, SamplingParams(max_tokens=2, json_schema=SCHEMA),
                                         prompts[2]))
    base = statistics.median(out["free"])
    rows = ["| request | TTFT ms p50 | p90 | p50 over free |", "|---|---|---|---|"]
    for name, xs in out.items():
        xs = sorted(xs)
        rows.append(f"| {name} | {statistics.median(xs):.2f} | {xs[int(0.9 * len(xs))]:.2f} | "
                    f"{statistics.median(xs) - base:+.2f} |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--requests", type=int, default=64, help="per format in the validity check")
    p.add_argument("--ttft-runs", type=int, default=30)
    args = p.parse_args()
    with Client(args.target, timeout=600) as client:
        hi = min(100_000, client.model_info().vocab_size)   # prompt ids below this
        print("### Validity (temperature 1, random weights)\n")
        print("\n".join(validity(client, args.requests, hi)))
        print("\n### Time to first token (sequential, 256-token prompts)\n")
        print("\n".join(first_tokens(client, args.ttft_runs, hi)))
        st = client.stats()
    # A fast-forward token the worker's sample contradicts means the two matchers disagree.
    print(f"\nfast-forward tokens {st.num_fast_forward_tokens:,}, "
          f"mismatches {st.num_fast_forward_mismatches} (0, 0 under --no-fast-forward)")
    return 1 if st.num_fast_forward_mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
