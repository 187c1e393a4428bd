"""client.bench --mixed: an interactive stream measured while a low-priority flood runs.

    python -m client.bench --null-worker --step-ms 7 --mixed --json mixed.json
    python -m client.bench --target 127.0.0.1:50051 --mixed --interactive-concurrency 4
    python -m client.bench --target 127.0.0.1:50051 --mixed --flood-kind embed --num-seqs 8192

Four phases against one server (a --target, or a null worker and scheduler started here):
  idle      the interactive stream alone: --interactive-concurrency requests in flight
            (closed loop), --interactive-requests in all
  flood     the flood alone: the workload (nano-vllm's lengths by default), sent at once;
            with --flood-kind embed, --num-seqs documents of --embed-len tokens through Embed
            (--embed-batch a request, --embed-concurrency in flight: a server serving both,
            --task generate,embed)
  priority  both: the flood at --flood-priority, the interactive stream at
            --interactive-priority (lower runs earlier), until the flood is done
  fcfs      the same with both at the flood's priority: one class of service, where the
            interactive requests queue behind the flood
Reported: the interactive stream's TTFT and ITL (p50, p99) per phase and as a multiple of
idle; the flood's output tok/s (embeddings/s) per phase and as a fraction of the flood alone
(issue 65's targets: TTFT p99 <= 1.5x idle, ITL p99 <= 1.3x idle, flood >= 90% of alone;
issue 67's: ITL p99 beside an embedding flood <= 1.5x idle).
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
from dataclasses import dataclass, field
from typing import Any, Callable

# The flood: (prompt ids, max_tokens) per request, given (vocab size, context length). bench.py
# passes its workload here (this module must not import it: bench imports this one).
MakeFlood = Callable[[int, int], list[tuple[list[int], int]]]
# What the flood's rate counts, by --flood-kind (the report's key and the printed unit).
RATE = {"generate": ("output_tok_per_s", "output tok/s"),
        "embed": ("embeddings_per_s", "embeddings/s")}


@dataclass
class Trace:
    """Where one request's tokens arrived (perf_counter seconds), as bench.Trace."""
    submit: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)   # (arrival, tokens)
    finish: float = 0.0
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    def ttft(self) -> float:
        return self.chunks[0][0] - self.submit

    def itls(self) -> list[float]:
        """A chunk of k tokens g seconds after the previous one: k gaps of g / k."""
        return [(t - prev) / n for (prev, _), (t, n) in zip(self.chunks, self.chunks[1:])
                for _ in range(n)]


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 and p99 (linear interpolation), None when empty."""
    xs = sorted(values)
    out: dict[str, float | None] = {}
    for q in (50, 99):
        if not xs:
            out[f"p{q}"] = None
            continue
        k = (len(xs) - 1) * q / 100
        lo = int(k)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    return out


def add_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("mixed mode (--mixed: priorities under a flood)")
    m.add_argument("--mixed", action="store_true",
                   help="measure an interactive stream beside a low-priority flood (the "
                        "workload, or Embed requests: --flood-kind): idle, flood alone, both "
                        "with priorities, both as one class")
    m.add_argument("--interactive-concurrency", type=int, default=4, metavar="B",
                   help="interactive requests in flight at once (1-8 in the issue)")
    m.add_argument("--interactive-requests", type=int, default=32, metavar="N",
                   help="interactive requests measured when idle")
    m.add_argument("--interactive-input-len", type=int, default=256)
    m.add_argument("--interactive-output-len", type=int, default=64)
    m.add_argument("--interactive-priority", type=int, default=0)
    m.add_argument("--flood-priority", type=int, default=10)
    m.add_argument("--flood-kind", choices=tuple(RATE), default="generate",
                   help="what the flood sends: the generation workload, or --num-seqs documents "
                        "of --embed-len tokens through Embed (--embed-batch, --embed-concurrency; "
                        "the server needs --task generate,embed)")


async def _request(client: Any, req: tuple[list[int], int], temperature: float, priority: int,
                   trace: Trace) -> None:
    from client.client import NanoserveError, SamplingParams
    prompt, max_tokens = req
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    trace.submit = time.perf_counter()
    try:
        async for chunk in client.generate(prompt, params, priority=priority):
            if chunk.token_ids:
                trace.chunks.append((time.perf_counter(), len(chunk.token_ids)))
    except NanoserveError as e:
        trace.error = f"{e.code.name}: {e.message}"
    trace.finish = time.perf_counter()


async def _interactive(client: Any, args: argparse.Namespace, vocab: int, priority: int,
                       done: asyncio.Event | None, count: int, seed: int) -> list[Trace]:
    """A closed loop of --interactive-concurrency requests: until `done` is set (or
    `count` requests were sent, when done is None)."""
    rng = random.Random(seed)
    traces: list[Trace] = []

    async def lane() -> None:
        while (done is None and len(traces) < count) or (done is not None and not done.is_set()):
            prompt = [rng.randrange(vocab) for _ in range(args.interactive_input_len)]
            trace = Trace()
            traces.append(trace)
            await _request(client, (prompt, args.interactive_output_len),
                           args.temperature, priority, trace)

    await asyncio.gather(*(lane() for _ in range(args.interactive_concurrency)))
    return traces


def _flood_work(args: argparse.Namespace, info: Any, make_flood: MakeFlood) -> list:
    """The flood's requests: generation (prompt, max_tokens) pairs, or Embed batches."""
    if args.flood_kind == "embed":
        from client.embed_bench import ID_HIGH, documents
        docs = documents(random.Random(args.seed), args.num_seqs, args.embed_len,
                         min(info.vocab_size, ID_HIGH))
        return [docs[i:i + args.embed_batch] for i in range(0, len(docs), args.embed_batch)]
    return make_flood(info.vocab_size, info.max_model_len)


async def _flood(client: Any, args: argparse.Namespace, work: list,
                 priority: int) -> tuple[float, int]:
    """All of the flood at `priority`: (its rate, failed requests); the rate is output tok/s,
    or embeddings/s for an embedding flood."""
    if args.flood_kind == "embed":
        from client.embed_bench import embed_all
        sent = await embed_all(client, work, args.embed_concurrency, args.embed_dimensions,
                               priority)
        return sent.per_s, len(sent.errors)
    traces = [Trace() for _ in work]
    await asyncio.gather(*(_request(client, r, args.temperature, priority, t)
                           for r, t in zip(work, traces)))
    wall = max(t.finish for t in traces) - min(t.submit for t in traces)
    return sum(t.num_tokens for t in traces) / wall, sum(t.error is not None for t in traces)


def _latency(traces: list[Trace]) -> dict[str, Any]:
    ok = [t for t in traces if t.error is None and t.chunks]
    return {"requests": len(ok), "failed": len(traces) - len(ok),
            "ttft_ms": {k: v and v * 1e3 for k, v in
                        percentiles([t.ttft() for t in ok]).items()},
            "itl_ms": {k: v and v * 1e3 for k, v in
                       percentiles([g for t in ok for g in t.itls()]).items()}}


async def _run(args: argparse.Namespace, make_flood: MakeFlood) -> dict[str, Any]:
    from client.client import AsyncClient
    async with AsyncClient(args.target, timeout=args.timeout, api_key=args.api_key,
                           tls_ca=args.tls_ca) as client:
        info = await client.model_info()
        needs = {"generate", args.flood_kind} - set((info.task or "generate").split(","))
        if needs:
            raise SystemExit(f"error: the server serves {info.task}; --mixed --flood-kind "
                             f"{args.flood_kind} needs --task generate,{args.flood_kind}")
        vocab = min(info.vocab_size, 10000)
        work = _flood_work(args, info, make_flood)
        rate = RATE[args.flood_kind][0]
        hi, lo = args.interactive_priority, args.flood_priority
        await _interactive(client, args, vocab, hi, None, args.interactive_concurrency, 99)  # warm
        report: dict[str, Any] = {"flood_kind": args.flood_kind}
        report["idle"] = _latency(await _interactive(client, args, vocab, hi, None,
                                                     args.interactive_requests, 1))
        per_s, failed = await _flood(client, args, work, lo)
        report["flood"] = {rate: per_s, "failed": failed}
        for phase, prio in (("priority", hi), ("fcfs", lo)):
            done = asyncio.Event()
            side = asyncio.ensure_future(_interactive(client, args, vocab, prio, done, 0, 2))
            await asyncio.sleep(0)
            per_s, failed = await _flood(client, args, work, lo)
            done.set()
            lat = _latency(await side)
            lat[f"flood_{rate}"] = per_s
            lat["flood_failed"] = failed
            report[phase] = lat
    idle = report["idle"]
    for phase in ("priority", "fcfs"):
        r = report[phase]
        r["ttft_p99_vs_idle"] = _ratio(r["ttft_ms"]["p99"], idle["ttft_ms"]["p99"])
        r["itl_p99_vs_idle"] = _ratio(r["itl_ms"]["p99"], idle["itl_ms"]["p99"])
        r["flood_vs_alone"] = _ratio(r[f"flood_{rate}"], report["flood"][rate])
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def format_report(r: dict[str, Any]) -> str:
    def ms(p: dict) -> str:
        return " / ".join("-" if p[k] is None else f"{p[k]:.1f}" for k in ("p50", "p99"))
    idle = r["idle"]
    rate, unit = RATE[r.get("flood_kind", "generate")]
    lines = [f"interactive alone: TTFT p50/p99 {ms(idle['ttft_ms'])} ms, ITL p50/p99 "
             f"{ms(idle['itl_ms'])} ms ({idle['requests']} requests)",
             f"flood alone: {r['flood'][rate]:,.0f} {unit}"]
    for phase in ("priority", "fcfs"):
        p = r[phase]
        lines.append(
            f"{phase:8} TTFT p50/p99 {ms(p['ttft_ms'])} ms ({_x(p['ttft_p99_vs_idle'])} idle), "
            f"ITL p50/p99 {ms(p['itl_ms'])} ms ({_x(p['itl_p99_vs_idle'])} idle), "
            f"{p['requests']} interactive; flood {p[f'flood_{rate}']:,.0f} {unit} "
            f"({_x(p['flood_vs_alone'])} alone)")
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def run(args: argparse.Namespace, make_flood: MakeFlood, argv: list[str] | None = None) -> int:
    """--mixed, against --target or a null worker started here."""
    if args.null_worker:
        from client.null_stack import NullStack
        task = ["--task", f"generate,{args.flood_kind}"] if args.flood_kind != "generate" else []
        with NullStack(step_ms=args.step_ms, max_model_len=args.max_model_len,
                       scheduler_args=[*shlex.split(args.scheduler_args), *task],
                       tokenizer_dir=args.null_tokenizer,
                       worker_args=["--prefill-us-per-token", str(args.prefill_us_per_token),
                                    *task]) as stack:
            args.target = stack.target
            report = asyncio.run(_run(args, make_flood))
        report["device"] = (f"null worker, {args.step_ms:g} ms/step"
                            + (f" + {args.prefill_us_per_token:g} us/prefill token"
                               if args.prefill_us_per_token else ""))
    else:
        report = asyncio.run(_run(args, make_flood))
    report["command"] = shlex.join([sys.executable, "-m", "client.bench",
                                    *(sys.argv[1:] if argv is None else argv)])
    print(format_report(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")
    failed = report["flood"]["failed"] + sum(report[p]["failed"] + report[p]["flood_failed"]
                                             for p in ("priority", "fcfs")) + report["idle"]["failed"]
    if failed:
        print(f"error: {failed} request(s) failed", file=sys.stderr)
        return 1
    return 0
