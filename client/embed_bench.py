"""client.bench --embed: embeddings per second through gRPC `Embed` (issue 67).

Documents of --embed-len random token ids (ids < 10000, as the generation workload's), sent
as requests of --embed-batch inputs with --embed-concurrency requests in flight, against
--target (a server with --task embed) or a null worker started here (its made-up vectors:
what the control plane alone sustains). One warm-up request first; then embeddings/s,
prompt tokens/s and request latency percentiles. Distinct documents: no prefix-cache hits.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time


def add_flags(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("embedding mode (--embed: embeddings/s through Embed)")
    e.add_argument("--embed", action="store_true",
                   help="embed --num-seqs documents instead of the generation workload")
    e.add_argument("--embed-len", type=int, default=512, metavar="L", help="tokens a document")
    e.add_argument("--embed-batch", type=int, default=16, metavar="B",
                   help="documents a request")
    e.add_argument("--embed-concurrency", type=int, default=8, metavar="C",
                   help="requests in flight")
    e.add_argument("--embed-dimensions", type=int, default=0, metavar="D",
                   help="matryoshka size asked for (0: the model's)")


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def _measure(args: argparse.Namespace) -> dict:
    from client.client import AsyncClient
    rng = random.Random(args.seed)
    docs = [[rng.randrange(10000) for _ in range(args.embed_len)] for _ in range(args.num_seqs)]
    batches = [docs[i:i + args.embed_batch] for i in range(0, len(docs), args.embed_batch)]
    async with AsyncClient(args.target, api_key=args.api_key, timeout=args.timeout) as client:
        info = await client.model_info()
        warm = [[rng.randrange(10000) for _ in range(args.embed_len)]]
        await client.embed(warm, dimensions=args.embed_dimensions)
        latencies: list[float] = []
        sem = asyncio.Semaphore(args.embed_concurrency)

        async def one(batch: list[list[int]]) -> None:
            async with sem:
                t = time.perf_counter()
                out = await client.embed(batch, dimensions=args.embed_dimensions)
                latencies.append(time.perf_counter() - t)
                assert len(out) == len(batch)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(b) for b in batches))
        wall = time.perf_counter() - t0
    return {"model": info.model, "task": info.task, "documents": len(docs),
            "tokens_per_document": args.embed_len, "batch": args.embed_batch,
            "concurrency": args.embed_concurrency, "wall_s": wall,
            "embeddings_per_s": len(docs) / wall,
            "prompt_tok_per_s": len(docs) * args.embed_len / wall,
            "request_ms": {"p50": _percentile(latencies, 0.5) * 1e3,
                           "p99": _percentile(latencies, 0.99) * 1e3}}


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """--embed, against --target or a null worker started here."""
    if args.in_process:
        print("error: --embed needs gRPC (--target or --null-worker)", file=sys.stderr)
        return 2
    if args.null_worker:
        from client.null_stack import NullStack
        with NullStack(step_ms=args.step_ms, max_model_len=args.max_model_len,
                       scheduler_args=[*shlex.split(args.scheduler_args), "--task", "embed"],
                       worker_args=["--task", "embed"],
                       tokenizer_dir=args.null_tokenizer) as stack:
            args.target = stack.target
            report = asyncio.run(_measure(args))
        report["device"] = f"null worker, {args.step_ms:g} ms/step"
    else:
        report = asyncio.run(_measure(args))
        report["device"] = args.device_name or "unknown (--device-name)"
    report["command"] = shlex.join([sys.executable, "-m", "client.bench",
                                    *(sys.argv[1:] if argv is None else argv)])
    print(f"{report['documents']} documents x {report['tokens_per_document']} tokens "
          f"({report['batch']} a request, {report['concurrency']} in flight) on "
          f"{report['device']}: {report['embeddings_per_s']:,.1f} embeddings/s, "
          f"{report['prompt_tok_per_s']:,.0f} prompt tok/s, request p50 "
          f"{report['request_ms']['p50']:.1f} ms, p99 {report['request_ms']['p99']:.1f} ms")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")
    return 0
