"""Time from a token's step end to its client, batch 1, through the whole control plane.

A null worker (client/null_stack.py) logs when each step's emulated device time ends
(NANOSERVE_NULL_STEP_LOG); one gRPC client streams R requests one after another and
stamps each token as it arrives. With one request at a time the steps and tokens pair
up in order: a request's prefill step gives its first token, each decode step the next.
Both clocks are time.perf_counter() (CLOCK_MONOTONIC) on the same host. Issue 72's
target: p50 <= 0.5 ms.

    python -m client.step_latency --step-ms 0.3 [--requests 4] [--output-len 512]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import grpc

from client.null_stack import NullStack
from nanoserve.v1 import generate_pb2, generate_pb2_grpc


def measure(step_ms: float, requests: int, output_len: int, prompt_len: int = 128
            ) -> list[float]:
    """Each token's step end -> arrival at the client, ms (first tokens excluded)."""
    with tempfile.TemporaryDirectory(prefix="nanoserve-step-log-") as tmp:
        log = os.path.join(tmp, "steps")
        os.environ["NANOSERVE_NULL_STEP_LOG"] = log   # inherited by the null worker
        try:
            with NullStack(step_ms=step_ms) as stack, grpc.insecure_channel(stack.target) as ch:
                stub = generate_pb2_grpc.GenerationStub(ch)
                runs = [_stream(stub, [r + 1] * prompt_len, output_len) for r in range(requests)]
                time.sleep(0.2)   # the last lines reach the log
        finally:
            del os.environ["NANOSERVE_NULL_STEP_LOG"]
        with open(log) as f:
            ends = [float(done) for _, done, n in (line.split() for line in f) if n == "1"]
    lat: list[float] = []
    at = 0
    for arrivals in runs:
        steps = ends[at:at + len(arrivals)]
        at += len(arrivals)
        lat += [(a - e) * 1e3 for a, e in zip(arrivals[1:], steps[1:])]
    return lat


def _stream(stub, prompt: list[int], n: int) -> list[float]:
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    arrivals: list[float] = []
    for chunk in stub.Generate(req, timeout=120):
        arrivals += [time.perf_counter()] * len(chunk.token_ids)
    return arrivals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--output-len", type=int, default=512)
    args = p.parse_args()
    lat = sorted(measure(args.step_ms, args.requests, args.output_len))
    q = lambda f: lat[min(int(f * len(lat)), len(lat) - 1)]   # noqa: E731
    print(f"step {args.step_ms:g} ms, batch 1, {len(lat)} tokens: step end -> client ms "
          f"p50 {q(0.5):.3f}  p90 {q(0.9):.3f}  p99 {q(0.99):.3f}")


if __name__ == "__main__":
    main()
