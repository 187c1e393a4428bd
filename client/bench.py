"""Benchmark client: nano-vllm's reference workload through gRPC, or in-process.

    # a running server (gRPC path: client -> scheduler -> worker), five times
    python -m client.bench --target 127.0.0.1:50051 --runs 5 --json grpc.json
    # the control plane alone, on any machine: a null worker at 7 ms/step (0 = its ceiling)
    python -m client.bench --null-worker --step-ms 7 --runs 5 --json null.json
    # the same workload with the Engine driving a local ModelRunner (no gRPC at all)
    python -m client.bench --in-process --model ~/qwen3-0.6b --json local.json
    # online: Poisson arrivals at 20 requests/s
    python -m client.bench --target 127.0.0.1:50051 --request-rate 20
    # ... from 4 client processes (default: one per 4 cores of this host, 1 to 4)
    python -m client.bench --target 127.0.0.1:50051 --request-rate 20 --client-procs 4
    # issue 67: embeddings/s; one query x 100 documents of 256 tokens through Score; an
    # interactive stream beside an embedding flood (the server: --task embed, score, generate,embed)
    python -m client.bench --target 127.0.0.1:50051 --embed --num-seqs 4096
    python -m client.bench --target 127.0.0.1:50051 --score --runs 20
    python -m client.bench --target 127.0.0.1:50051 --mixed --flood-kind embed --num-seqs 8192
    # what CI runs: a tiny workload
    python -m client.bench --target ... --num-seqs 6 --min-input-len 5 --max-input-len 20 \\
        --min-output-len 5 --max-output-len 15 --warmup 1

The workload is nano-vllm's bench.py, draw for draw (256 sequences, prompt lengths and
max_tokens uniform in [100, 1024], token ids randint(0, 10000), ignore_eos, temperature
0.6): seed 0 gives its 133,966 output tokens. With --runs N, runs after the first keep
the lengths but shift every prompt id, so none finds its prompt in the prefix cache (as
nano-vllm's runs, each a fresh process, never do). Running it both ways prices the service
boundary; the decode breakdown (the engine's per-step timers) says where a decode step's
wall time goes and how long the GPU sits idle in each (idle = step wall - GPU busy). Each
gRPC run also reports the CPU seconds of the processes it can see (its own; with
--null-worker the null worker's and each control-plane process's, and the control
plane's CPU per output token), and how fast this host ran a fixed Python loop right
after the run: the 2-core VM's speed moves by 2x within an hour, so compare runs at the
same host speed.

Offline mode submits every request at once and times first submit -> last finish;
a small warm-up batch runs first and is excluded, from the timing and from the decode
breakdown (the engine counters are diffed around the measured run). TTFT is submit ->
first token; inter-token latency is the gap between streamed chunks, spread over the
chunk's tokens. Both are measured where the tokens arrive: at the gRPC client, or in the
Engine's on_updates callback in-process.

The gRPC mode imports no torch; --in-process imports worker_service lazily.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import shlex
import os
import platform
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Mapping, Sequence

from client.client import Stats
from client.proc_cpu import diff as proc_cpu_diff, host_cores, own_cpu_s, python_speed
from scheduler_service.speculation import METHODS

# nano-vllm draws prompt token ids as randint(0, 10000); kept so seed 0 reproduces its workload.
PROMPT_ID_HIGH = 10000
PERCENTILES = (50, 90, 99)
# Engine counters (Stats RPC / EngineStats) that the decode breakdown diffs.
DECODE_FIELDS = tuple(f.name for f in fields(Stats) if f.name.startswith(("num_decode_", "decode_"))
                      or f.name in ("num_fast_forward_tokens", "num_spec_proposed_tokens",
                                    "num_spec_accepted_tokens", "num_spec_runs"))
PREDICTIONS = ("exact", "half", "wrong")


# ---------------------------------------------------------------------------- workload
@dataclass
class WorkloadConfig:
    num_seqs: int = 256
    min_input_len: int = 100
    max_input_len: int = 1024
    min_output_len: int = 100
    max_output_len: int = 1024
    temperature: float = 0.6
    seed: int = 0
    request_rate: float = 0.0   # requests/s with Poisson arrivals; 0 = offline (all at once)
    json_schema: str | None = None    # constrain requests to this JSON Schema (its text)
    constrained_fraction: float = 1.0  # of the requests, spread evenly


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int             # already capped by the context left (what the server would do)
    json_schema: str | None = None   # the output format, if this request is constrained
    prediction: list[int] | None = None   # --prediction: the expected output, proposed ahead
    answer: list[int] | None = None       # --prediction: the greedy run's output (the check)
    adapter: str = ""                     # --adapters: the LoRA adapter it names ("" = base)


def _read_text(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def make_workload(cfg: WorkloadConfig, vocab_size: int, max_model_len: int) -> list[BenchRequest]:
    """nano-vllm's draws in nano-vllm's order: all prompts (length, then ids), then all
    max_tokens. Ids >= vocab_size (tiny test models only) wrap around instead of clamping,
    so a tiny vocabulary still sees varied ids and the random stream stays the same."""
    rng = random.Random(cfg.seed)
    prompts = [[rng.randint(0, PROMPT_ID_HIGH) for _ in range(rng.randint(cfg.min_input_len,
                                                                           cfg.max_input_len))]
               for _ in range(cfg.num_seqs)]
    max_tokens = [rng.randint(cfg.min_output_len, cfg.max_output_len) for _ in range(cfg.num_seqs)]
    out = []
    for ids, n in zip(prompts, max_tokens):
        if len(ids) >= max_model_len:
            raise SystemExit(f"error: a {len(ids)}-token prompt leaves no room in the "
                             f"{max_model_len}-token context")
        ids = [t if t < vocab_size else t % vocab_size for t in ids]
        out.append(BenchRequest(ids, min(n, max_model_len - len(ids))))
    if cfg.json_schema:   # request i is constrained when i * fraction crosses an integer
        f = cfg.constrained_fraction
        for i, r in enumerate(out):
            if int((i + 1) * f) > int(i * f):
                r.json_schema = cfg.json_schema
    return out


def for_run(workload: list[BenchRequest], run: int, vocab_size: int) -> list[BenchRequest]:
    """Run `run` of a series: the same lengths, every prompt id shifted (run 0: nano-vllm's
    own ids). A repeat of the same prompts would find them in the prefix cache, left there
    by the run before: prefill would be cheaper than in nano-vllm's bench, whose every run
    is a fresh process with an empty cache."""
    if run == 0:
        return workload
    high = min(vocab_size, PROMPT_ID_HIGH + 1)
    shift = run * 3571   # (a tiny test vocabulary may map a run onto another: no matter)
    return [replace(r, prompt_ids=[(t + shift) % high for t in r.prompt_ids])
            for r in workload]


def warmup_workload(n: int, cfg: WorkloadConfig, vocab_size: int) -> list[BenchRequest]:
    """n requests with prompts as long as the workload's but short outputs: the prefill
    batches then reach the measured run's sizes, so kernels JIT-compiled (Triton) or
    autotuned per shape are ready before the clock starts. Short prompts were not enough:
    on a fresh H100 the first measured prefill still paid ~1 s of compilation."""
    rng = random.Random(cfg.seed + 1)
    high = min(vocab_size, PROMPT_ID_HIGH)
    return [BenchRequest([rng.randrange(high)
                          for _ in range(rng.randint(cfg.min_input_len, cfg.max_input_len))],
                         rng.randint(1, min(16, cfg.max_output_len))) for _ in range(n)]


def with_adapters(workload: list[BenchRequest], names: str | None) -> list[BenchRequest]:
    """--adapters a,b,c: request i names adapter i mod 3 (its LoRA fine-tune)."""
    adapters = [n for n in (names or "").split(",") if n]
    for i, r in enumerate(workload if adapters else ()):
        r.adapter = adapters[i % len(adapters)]
    return workload


def with_predictions(workload: list[BenchRequest], answers: list[list[int]], mode: str,
                     vocab_size: int, seed: int) -> list[BenchRequest]:
    """--prediction: each request's greedy answer (exact), the answer with every other run
    of 16 tokens replaced by random ids (half), or another request's answer (wrong:
    unrelated text; random ids when there is only one request)."""
    rng = random.Random(seed + 3)
    out = []
    for i, (r, answer) in enumerate(zip(workload, answers)):
        if mode == "half":
            pred = [t if (j // 16) % 2 == 0 else rng.randrange(vocab_size)
                    for j, t in enumerate(answer)]
        elif mode == "wrong":
            pred = (answers[(i + 1) % len(answers)] if len(answers) > 1
                    else [rng.randrange(vocab_size) for _ in answer])
        else:
            pred = list(answer)
        out.append(replace(r, prediction=pred, answer=list(answer)))
    return out


def greedy_mismatches(workload: list[BenchRequest], traces: list[Trace]) -> int | None:
    """--prediction: requests whose output differs from the greedy run's (speculation must
    change nothing; on a GPU a batch of another shape may still flip a near-tie)."""
    if not workload or workload[0].answer is None:
        return None
    bad = [(r, t) for r, t in zip(workload, traces) if t.tokens != r.answer]
    if bad:
        r, t = bad[0]
        at = next(i for i, (a, b) in enumerate(zip(r.answer + [-1], t.tokens + [-2])) if a != b)
        print(f"first mismatch at {at}: greedy {r.answer[max(at - 3, 0):at + 8]} "
              f"got {t.tokens[max(at - 3, 0):at + 8]}", file=sys.stderr)
    return len(bad)


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0 offline, else a
    Poisson process (exponential gaps) with its own seeded stream."""
    if rate <= 0:
        return [0.0] * n
    rng = random.Random(seed + 2)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------------------- measurements
@dataclass
class Trace:
    """Where one request's tokens arrived (perf_counter seconds)."""
    submit: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    finish: float | None = None
    error: str | None = None
    tokens: list[int] | None = None   # the output ids, where asked for (--prediction)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.submit if self.chunks else None

    def itls(self) -> list[float]:
        """One gap per token after the first: a chunk of k tokens that came g seconds after
        the previous chunk counts as k gaps of g/k."""
        out: list[float] = []
        for (prev, _), (t, n) in zip(self.chunks, self.chunks[1:]):
            out.extend([(t - prev) / n] * n)
        return out


def percentiles(values: Sequence[float], qs: Sequence[int] = PERCENTILES
                ) -> dict[str, float | None]:
    """Linear-interpolated percentiles (numpy's default), plus the mean; None when empty
    (e.g. no inter-token gaps when every request asks for one token)."""
    if not values:
        return {**{f"p{q}": None for q in qs}, "mean": None}
    xs = sorted(values)
    out = {}
    for q in qs:
        pos = (len(xs) - 1) * q / 100
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    out["mean"] = sum(xs) / len(xs)
    return out


@dataclass
class DecodeBreakdown:
    """Engine decode-step timers summed over the measured run (ms), diffed from two
    snapshots so the warm-up and anything before it do not count."""
    steps: int = 0
    seqs: int = 0
    fast_forward_tokens: int = 0   # output tokens a format forced, run without a step each
    spec_proposed: int = 0         # speculative decoding: proposed tokens, accepted ones and
    spec_accepted: int = 0         # the (sequence, step) pairs that verified proposals
    spec_runs: int = 0
    wall_ms: float = 0.0
    schedule_ms: float = 0.0
    rpc_ms: float = 0.0
    worker_ms: float = 0.0
    gpu_ms: float = 0.0
    postprocess_ms: float = 0.0

    @classmethod
    def diff(cls, before: Mapping[str, float], after: Mapping[str, float]) -> "DecodeBreakdown":
        d = {k: after.get(k, 0) - before.get(k, 0) for k in DECODE_FIELDS}   # (0: not reported)
        return cls(steps=int(d["num_decode_steps"]), seqs=int(d["num_decode_seqs"]),
                   fast_forward_tokens=int(d["num_fast_forward_tokens"]),
                   spec_proposed=int(d["num_spec_proposed_tokens"]),
                   spec_accepted=int(d["num_spec_accepted_tokens"]),
                   spec_runs=int(d["num_spec_runs"]),
                   **{k.removeprefix("decode_"): v for k, v in d.items() if k.startswith("decode_")})

    @property
    def gpu_timed(self) -> bool:
        """The worker reports GPU time only on CUDA (0 on CPU)."""
        return self.gpu_ms > 0

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        parts = {k: getattr(self, f"{k}_ms") / n
                 for k in ("wall", "schedule", "rpc", "worker", "gpu", "postprocess")}
        parts["idle"] = max(parts["wall"] - parts["gpu"], 0.0)
        return parts

    def summary(self) -> dict[str, Any]:
        per = self.per_step()
        return {
            "steps": self.steps,
            "mean_batch": self.seqs / self.steps if self.steps else 0.0,
            "fast_forward_tokens": self.fast_forward_tokens,
            "spec_proposed_tokens": self.spec_proposed,
            "spec_accepted_tokens": self.spec_accepted,
            # tokens per verified (sequence, step): accepted proposals + the step's own
            "mean_acceptance_length": (1 + self.spec_accepted / self.spec_runs
                                       if self.spec_runs else None),
            "gpu_timed": self.gpu_timed,
            "idle_ms_per_step": per["idle"],
            # idle <= wall by construction; dividing first keeps idle == wall at exactly 100
            "idle_pct": 100 * (per["idle"] / per["wall"]) if per["wall"] > 0 else 0.0,
            "per_step_ms": per,
            "totals_ms": {k: getattr(self, f"{k}_ms")
                          for k in ("wall", "schedule", "rpc", "worker", "gpu", "postprocess")},
        }


class Progress:
    """One-line `\\r` bar on stderr: tokens done / expected, throughput so far.

    `add` is a bare counter bump (called per chunk, possibly from the engine thread);
    drawing happens on a timer, off the measured path's hot loop."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total, self.enabled, self.width = total, enabled, width
        self.done = 0
        self.start = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n

    def draw(self) -> None:
        if not self.enabled:
            return
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(frac * self.width)
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        sys.stderr.write(f"\r[{bar:<{self.width}}] {self.done}/{self.total} tok "
                         f"{rate:,.0f} tok/s {elapsed:.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw()
            sys.stderr.write("\n")
            sys.stderr.flush()


@dataclass
class RunOutcome:
    """What a mode hands back to be summarized."""
    mode: str
    model: str
    device: str | None
    max_model_len: int
    traces: list[Trace]
    wall_s: float
    breakdown: DecodeBreakdown
    extra: dict[str, Any] = field(default_factory=dict)
    cpu_s: dict[str, float] | None = None   # CPU seconds per process over the run (gRPC modes)
    host_speed: float | None = None         # proc_cpu.python_speed() right after the run


def summarize(outcome: RunOutcome, workload: list[BenchRequest]) -> dict[str, Any]:
    traces = outcome.traces
    output_tokens = sum(t.num_tokens for t in traces)
    prompt_tokens = sum(len(r.prompt_ids) for r in workload)
    wall = outcome.wall_s
    ttft = [t.ttft() for t in traces if t.ttft() is not None]
    itl = [g for t in traces for g in t.itls()]
    return {
        "num_requests": len(traces),
        "failed": sum(t.error is not None for t in traces),
        "errors": sorted({t.error for t in traces if t.error})[:5],
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.max_tokens for r in workload),
        "prompt_tokens": prompt_tokens,
        "wall_s": wall,
        "output_tok_per_s": output_tokens / wall if wall > 0 else 0.0,
        "total_tok_per_s": (output_tokens + prompt_tokens) / wall if wall > 0 else 0.0,
        "ttft_ms": _ms(percentiles(ttft)),
        "itl_ms": _ms(percentiles(itl)),
        # > 1: the server put several tokens in one message (it coalesces when it falls
        # behind); each message costs gRPC CPU on both ends (python -m client.grpc_floor).
        "tokens_per_message": output_tokens / max(sum(len(t.chunks) for t in traces), 1),
        "decode": outcome.breakdown.summary(),
        "cpu": cpu_summary(outcome.cpu_s, output_tokens, wall, outcome.host_speed),
    }


# Processes of a null-worker run that are not the control plane.
NOT_CONTROL_PLANE = ("bench client", "null worker")


def cpu_summary(cpu_s: dict[str, float] | None, output_tokens: int, wall: float,
                host_speed: float | None = None) -> dict[str, Any] | None:
    """Where the host's CPU went in a run: seconds per process, the cores it had, how fast
    one of them ran Python just after (M loop iterations/s), and the control plane's CPU
    per output token (null-worker runs, where the bench started it)."""
    if cpu_s is None:
        return None
    control = [v for k, v in cpu_s.items() if k not in NOT_CONTROL_PLANE]
    return {"seconds": cpu_s, "cores": host_cores(), "wall_s": wall, "host_speed": host_speed,
            "control_plane_us_per_token": (sum(control) / output_tokens * 1e6
                                           if control and output_tokens else None)}


def _ms(p: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else v * 1e3 for k, v in p.items()}


def format_report(report: dict[str, Any]) -> str:
    r, d = report["results"], report["results"]["decode"]
    def pct(p: dict[str, float | None]) -> str:
        return "  ".join(f"p{q} " + ("     n/a" if p[f"p{q}"] is None else f"{p[f'p{q}']:8.2f}")
                         for q in PERCENTILES)

    mode = report["mode"] + (f" @ {report['workload']['request_rate']:g} req/s"
                             if report["workload"]["request_rate"] > 0 else " (offline)")
    lines = [
        f"mode           {mode}",
        f"model          {report['model']}   device {report['device'] or 'unknown'}",
        f"requests       {r['num_requests']}   failed {r['failed']}",
        f"output tokens  {r['output_tokens']}   (expected {r['expected_output_tokens']}; "
        f"prompt tokens {r['prompt_tokens']})",
        f"wall           {r['wall_s']:.3f} s",
        f"output tok/s   {r['output_tok_per_s']:,.1f}",
        f"total tok/s    {r['total_tok_per_s']:,.1f}",
        f"TTFT ms        {pct(r['ttft_ms'])}",
        f"ITL ms         {pct(r['itl_ms'])}",
        f"streamed       {r['tokens_per_message']:.2f} tokens per message",
        f"decode steps   {d['steps']}   mean batch {d['mean_batch']:.1f}"
        + (f"   fast-forward tokens {d['fast_forward_tokens']:,} "
           f"({100 * d['fast_forward_tokens'] / max(r['output_tokens'], 1):.0f}% of output)"
           if d.get("fast_forward_tokens") else ""),
    ]
    if report.get("greedy_mismatches") is not None:
        lines.append(f"prediction     {report['config']['prediction']}: "
                     f"{report['greedy_mismatches']} of {r['num_requests']} outputs differ from "
                     "the greedy run without it")
    if d.get("mean_acceptance_length") is not None:
        lines.append(f"speculation    {d['spec_accepted_tokens']:,} of {d['spec_proposed_tokens']:,} "
                     f"proposed tokens accepted   mean acceptance length "
                     f"{d['mean_acceptance_length']:.2f} tokens per verified step")
    if d["gpu_timed"]:
        lines.append(f"GPU idle       {d['idle_pct']:.1f}% of decode wall, "
                     f"{d['idle_ms_per_step']:.3f} ms/step (step wall - GPU busy)")
    else:
        lines.append("GPU idle       n/a: the worker reports no GPU time (CPU device)")
    per = d["per_step_ms"]
    cols = ("wall", "schedule", "rpc", "worker", "gpu", "postprocess", "idle")
    lines.append("per decode step (ms):")
    lines.append("  " + " ".join(f"{c:>11}" for c in cols))
    lines.append("  " + " ".join(f"{per[c]:11.3f}" for c in cols))
    if r.get("cpu"):
        c = r["cpu"]
        lines.append("CPU s          " + "  ".join(f"{k} {v:.2f}" for k, v in c["seconds"].items())
                     + f"   (host: {c['cores']} cores x {c['wall_s']:.2f} s wall"
                     + (f", {c['host_speed']:.1f} M Python loop iterations/s after"
                        if c.get("host_speed") else "") + ")")
        if c["control_plane_us_per_token"] is not None:
            lines.append(f"control plane  {c['control_plane_us_per_token']:.1f} us of CPU "
                         "per output token")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- gRPC mode
async def _settled_stats(client: Any, timeout: float = 5.0) -> dict[str, float]:
    """A Stats snapshot once the engine is idle and its counters stopped moving: with two
    steps in flight, the step after a sequence's last one may still be running (and not
    yet counted) when the last token reaches us."""
    prev = None
    deadline = time.monotonic() + timeout
    while True:
        s = await client.stats()
        snap = {k: getattr(s, k) for k in DECODE_FIELDS}
        idle = s.num_running == 0 and s.num_waiting == 0
        if (idle and snap == prev) or time.monotonic() > deadline:
            return snap
        prev = snap if idle else None
        await asyncio.sleep(0.02)


async def _grpc_request(client: Any, req: BenchRequest, temperature: float, trace: Trace,
                        progress: Progress | None, start_at: float = 0.0) -> None:
    from client.client import NanoserveError, SamplingParams
    delay = start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    params = SamplingParams(temperature=temperature, max_tokens=req.max_tokens, ignore_eos=True,
                            json_schema=req.json_schema, prediction=req.prediction)
    trace.submit = time.perf_counter()
    try:
        async for chunk in client.generate(req.prompt_ids, params, adapter=req.adapter):
            now = time.perf_counter()
            if chunk.token_ids:
                trace.chunks.append((now, len(chunk.token_ids)))
                if trace.tokens is not None:
                    trace.tokens.extend(chunk.token_ids)
                if progress is not None:
                    progress.add(len(chunk.token_ids))
    except NanoserveError as e:
        trace.error = f"{e.code.name}: {e.message}"
    trace.finish = time.perf_counter()


async def _run_grpc_async(args: argparse.Namespace, wcfg: WorkloadConfig,
                          cpu_probe: Callable[[], dict[str, float]] | None = None
                          ) -> tuple[list[RunOutcome], list[BenchRequest]]:
    """cpu_probe: CPU seconds so far per process, read before and after each run (default:
    the bench client's own)."""
    from client.client import AsyncClient
    cpu_probe = cpu_probe or (lambda: {"bench client": own_cpu_s()})

    async with contextlib.AsyncExitStack() as stack:
        # One channel is one HTTP/2 connection, which the kernel hands to one frontend
        # process: requests go round-robin over --connections channels.
        channels = [await stack.enter_async_context(AsyncClient(
            args.target, timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca))
            for _ in range(args.connections)]
        client = channels[0]
        info = await client.model_info()
        workload = run_0 = with_adapters(make_workload(wcfg, info.vocab_size, info.max_model_len),
                                         args.adapters)
        if args.warmup > 0:
            warm = with_adapters(warmup_workload(args.warmup, wcfg, info.vocab_size), args.adapters)
            traces = [Trace() for _ in warm]
            await asyncio.gather(*(_grpc_request(client, r, wcfg.temperature, t, None)
                                   for r, t in zip(warm, traces)))
            _raise_if_failed(traces, "warm-up")
        if args.prediction:   # a first greedy run gives the answers the predictions come from
            traces = [Trace(tokens=[]) for _ in run_0]
            await asyncio.gather(*(_grpc_request(client, r, 0.0, t, None)
                                   for r, t in zip(run_0, traces)))
            _raise_if_failed(traces, "the greedy run for --prediction")
            run_0 = with_predictions(run_0, [t.tokens for t in traces], args.prediction,
                                     info.vocab_size, wcfg.seed)
        outcomes = []
        for run in range(args.runs):
            workload = run_0 if args.prediction else for_run(run_0, run, info.vocab_size)
            before = await _settled_stats(client)
            cpu_before = cpu_probe()
            progress = Progress(sum(r.max_tokens for r in workload), enabled=not args.no_progress)
            offsets = arrival_offsets(len(workload), wcfg.request_rate, wcfg.seed)
            traces = [Trace(tokens=[] if args.prediction else None) for _ in workload]
            if args.client_procs > 1:
                waiter = asyncio.ensure_future(_run_in_procs(args, wcfg.temperature, workload,
                                                             offsets, traces, progress))
            else:
                waiter = _send_all(channels, workload, offsets, wcfg.temperature, traces,
                                   progress, time.perf_counter())
            while not waiter.done():
                progress.draw()
                await asyncio.wait([waiter], timeout=0.2)
            await waiter
            progress.close()
            after = await _settled_stats(client)
            cpu = proc_cpu_diff(cpu_before, cpu_probe())
            speed = python_speed()
            wall = max(t.finish for t in traces) - min(t.submit for t in traces)
            outcomes.append(RunOutcome(
                mode="grpc", model=info.model, device=args.device_name,
                max_model_len=info.max_model_len, traces=traces, wall_s=wall,
                breakdown=DecodeBreakdown.diff(before, after),
                extra={"target": args.target, "model_info": asdict(info),
                       "greedy_mismatches": greedy_mismatches(workload, traces)}, cpu_s=cpu,
                host_speed=speed))
    return outcomes, workload


def _send_all(channels: list[Any], requests: list[BenchRequest], offsets: list[float],
              temperature: float, traces: list[Trace], progress: Progress | None,
              start: float) -> asyncio.Future:
    """Every request sent at start + its offset, dealt out over `channels` in turn."""
    return asyncio.gather(*(
        _grpc_request(channels[i % len(channels)], r, temperature, t, progress, start + off)
        for i, (r, t, off) in enumerate(zip(requests, traces, offsets))))


async def _run_in_procs(args: argparse.Namespace, temperature: float,
                        workload: list[BenchRequest], offsets: list[float], traces: list[Trace],
                        progress: Progress) -> None:
    """One run's requests sent from --client-procs processes, dealt out in turn. One Python
    process streams only so many messages a second (client.grpc_floor: ~120-150 us of CPU
    each on the 2-core CI VM), so at high token rates a single client process, not the
    server, can be what delays tokens. Each process connects and says so; then all get one
    start time and send their requests at start + offset. perf_counter is CLOCK_MONOTONIC,
    one clock for every process on the host, so their stamps merge into `traces` as they are."""
    import multiprocessing
    mp = multiprocessing.get_context("spawn")      # no forking a process that runs gRPC
    loop = asyncio.get_running_loop()
    n = args.client_procs
    opts = dict(timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca)
    shares = [range(p, len(workload), n) for p in range(n)]
    pipes, procs = [], []
    try:
        for share in shares:
            mine, theirs = mp.Pipe()
            procs.append(mp.Process(target=_client_proc, daemon=True, args=(
                theirs, args.target, opts, args.connections, temperature,
                [workload[i] for i in share], [offsets[i] for i in share])))
            procs[-1].start()
            pipes.append(mine)
        for msg in await asyncio.gather(*(loop.run_in_executor(None, c.recv) for c in pipes)):
            if msg != "ready":
                raise RuntimeError(f"a client process failed: {msg}")
        start = time.perf_counter() + 0.05
        for c in pipes:
            c.send(start)
        results = await asyncio.gather(*(loop.run_in_executor(None, c.recv) for c in pipes))
        for share, result in zip(shares, results):
            if isinstance(result, str):
                raise RuntimeError(f"a client process failed: {result}")
            for i, trace in zip(share, result):
                traces[i] = trace
                progress.add(trace.num_tokens)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


def _client_proc(conn: Any, target: str, opts: dict, connections: int, temperature: float,
                 requests: list[BenchRequest], offsets: list[float]) -> None:
    """Body of one --client-procs process (see _run_in_procs): sends back one Trace per
    request, or a string saying what failed."""
    async def main() -> list:
        from client.client import AsyncClient
        async with contextlib.AsyncExitStack() as stack:
            chans = [await stack.enter_async_context(AsyncClient(target, **opts))
                     for _ in range(connections)]
            for c in chans:
                await c.model_info()                # connected before the clock starts
            conn.send("ready")
            start = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            traces = [Trace() for _ in requests]
            await _send_all(chans, requests, offsets, temperature, traces, None, start)
            return traces
    try:
        conn.send(asyncio.run(main()))
    except Exception as e:     # the parent raises it: a bench that lost requests must fail
        conn.send(f"{type(e).__name__}: {e}")


def run_grpc(args: argparse.Namespace, wcfg: WorkloadConfig,
             cpu_probe: Callable[[], dict[str, float]] | None = None
             ) -> tuple[list[RunOutcome], list[BenchRequest]]:
    return asyncio.run(_run_grpc_async(args, wcfg, cpu_probe))


def run_null(args: argparse.Namespace, wcfg: WorkloadConfig
             ) -> tuple[list[RunOutcome], list[BenchRequest]]:
    """The control plane alone: a null worker and the real scheduler started here, then
    the gRPC mode against them."""
    from client.null_stack import NullStack
    with NullStack(step_ms=args.step_ms, max_model_len=args.max_model_len,
                   scheduler_args=shlex.split(args.scheduler_args) + [
                       "--speculative", args.speculative,
                       "--num-speculative-tokens", str(args.num_speculative_tokens),
                       "--speculative-max-batch", str(args.speculative_max_batch)],
                   tokenizer_dir=args.null_tokenizer,
                   worker_args=["--prefill-us-per-token", str(args.prefill_us_per_token)]) as stack:
        args.target = stack.target
        args.device_name = f"null worker, {args.step_ms:g} ms/step"
        outcomes, workload = run_grpc(
            args, wcfg, lambda: {**stack.cpu_s(), "bench client": own_cpu_s()})
    for o in outcomes:
        o.mode = "null-worker"
        o.extra["step_ms"] = args.step_ms
    return outcomes, workload


# ---------------------------------------------------------------------------- in-process mode
class _Collector:
    """The Engine's on_output callback: stamps token arrivals on the engine's thread (the
    same point where the engine core would hand them to a frontend)."""

    def __init__(self) -> None:
        self.traces: dict[int, Trace] = {}
        self.progress: Progress | None = None
        self.remaining = 0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def expect(self, traces: dict[int, Trace], progress: Progress | None) -> None:
        with self._lock:
            self.traces, self.progress = traces, progress
            self.remaining = len(traces)
            self.done.clear()

    def on_output(self, out: Any) -> None:
        now = time.perf_counter()
        for seq_id, token in zip(out.seq_ids, out.token_ids):
            trace = self.traces.get(seq_id)
            if trace is not None:
                trace.chunks.append((now, 1))
                if trace.tokens is not None:
                    trace.tokens.append(token)
        if self.progress is not None:
            self.progress.add(len(out.seq_ids))
        ended = [(seq_id, None) for seq_id, *_ in out.finished]
        ended += [(seq_id, f"{code}: {message}") for seq_id, code, message in out.errors]
        for seq_id, error in ended:
            trace = self.traces.get(seq_id)
            if trace is None:
                continue
            trace.error = error
            trace.finish = now
            with self._lock:
                self.remaining -= 1
                if self.remaining == 0:
                    self.done.set()


class _EngineThread:
    """The Engine on an event loop of its own thread; submit from any thread."""

    def __init__(self, group: Any, block_size: int, num_kv_blocks: int, make_engine: Callable):
        self.loop = asyncio.new_event_loop()
        self.engine = None
        started = threading.Event()

        async def main() -> None:
            info = await group.connect(block_size, num_kv_blocks)
            self.engine = make_engine(info)
            started.set()
            await self.engine.run()

        def target() -> None:
            try:
                self.loop.run_until_complete(main())
            finally:
                started.set()

        self.thread = threading.Thread(target=target, name="engine", daemon=True)
        self.thread.start()
        started.wait()
        if self.engine is None:
            raise SystemExit("error: the engine did not start (see the traceback above)")

    def submit(self, seq: Any) -> None:
        self.loop.call_soon_threadsafe(self.engine.add, seq)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.engine.stop)
        self.thread.join()


def _engine_stats(engine: Any) -> dict[str, float]:
    return {k: getattr(engine.stats, k) for k in DECODE_FIELDS}


def _settled_engine_stats(engine: Any, timeout: float = 5.0) -> dict[str, float]:
    """engine.stats once the loop is idle and its counters stopped moving (see _settled_stats)."""
    prev = None
    deadline = time.monotonic() + timeout
    while True:
        snap = _engine_stats(engine)
        idle = engine.num_pending() == 0
        if (idle and snap == prev) or time.monotonic() > deadline:
            return snap
        prev = snap if idle else None
        time.sleep(0.02)


def _device_name(device: Any) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def run_in_process(args: argparse.Namespace, wcfg: WorkloadConfig
                   ) -> tuple[list[RunOutcome], list[BenchRequest]]:
    # Imported here: the gRPC mode must not pay for (or need) torch.
    from scheduler_service.engine import Engine
    from scheduler_service.scheduler import SchedulerConfig
    from scheduler_service.constraints import grammar_for
    from scheduler_service.sequence import SamplingOptions
    from scheduler_service.sequence import Sequence as EngineSequence
    from scheduler_service.speculation import Speculator
    from worker_service.local_group import LocalWorkerGroup
    from worker_service.model_runner import ModelRunner, RunnerConfig

    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        device = "cuda:0"   # ModelRunner's torch.cuda.set_device wants an index
    runner = ModelRunner(RunnerConfig(
        model_dir=args.model, device=device, dtype=args.dtype,
        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gb=args.kv_cache_gb,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_prefill_graph_tokens=args.max_prefill_graph_tokens,
        enforce_eager=args.enforce_eager))
    group = LocalWorkerGroup(runner)
    collector = _Collector()

    def make_engine(info: Any) -> Any:
        config = SchedulerConfig(
            num_kv_blocks=info.num_kv_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=min(args.max_model_len or info.max_model_len, info.max_model_len),
            eos_token_id=info.eos_token_id)
        ff = None
        if args.fast_forward:
            from scheduler_service.fast_forward import FastForward
            ff = FastForward.for_model(args.model, info)
        return Engine(group, info, config, collector.on_output, overlap=not args.no_overlap,
                      fast_forward=ff, speculator=Speculator(spec_config(args), ff and ff.allowed))

    runner_thread = _EngineThread(group, args.block_size, args.num_kv_blocks, make_engine)
    engine, info = runner_thread.engine, runner_thread.engine.info
    max_model_len = engine.config.max_model_len
    seq_ids = itertools.count(1)

    def engine_alive() -> bool:
        return runner_thread.thread.is_alive()   # an uncaught error ends it silently

    def submit_all(reqs: list[BenchRequest], offsets: list[float], progress: Progress | None,
                   temperature: float = wcfg.temperature, keep_tokens: bool = False) -> list[Trace]:
        """Submit at the given offsets (redrawing the bar meanwhile), wait for all."""
        seqs = [EngineSequence(next(seq_ids), r.prompt_ids, SamplingOptions(
            temperature=temperature, max_tokens=r.max_tokens, ignore_eos=True,
            grammar=grammar_for("json_schema", r.json_schema) if r.json_schema else "",
            prediction=tuple(r.prediction or ())))
            for r in reqs]
        traces = {s.seq_id: Trace(tokens=[] if keep_tokens else None) for s in seqs}
        collector.expect(traces, progress)
        draw = progress.draw if progress is not None else (lambda: None)
        start = time.perf_counter()
        for seq, off in zip(seqs, offsets):
            while (delay := start + off - time.perf_counter()) > 0:
                draw()
                time.sleep(min(delay, 0.1))
            traces[seq.seq_id].submit = time.perf_counter()
            runner_thread.submit(seq)
        while not collector.done.wait(0.2):
            draw()
            if not engine_alive():
                raise SystemExit("error: the engine loop died (see the traceback above)")
        return list(traces.values())

    try:
        if args.warmup > 0:
            warm = warmup_workload(args.warmup, wcfg, info.vocab_size)
            _raise_if_failed(submit_all(warm, [0.0] * len(warm), None), "warm-up")
        workload = run_0 = make_workload(wcfg, info.vocab_size, max_model_len)
        if args.prediction:   # a first greedy run gives the answers the predictions come from
            traces = submit_all(run_0, [0.0] * len(run_0), None, 0.0, keep_tokens=True)
            _raise_if_failed(traces, "the greedy run for --prediction")
            run_0 = with_predictions(run_0, [t.tokens for t in traces], args.prediction,
                                     info.vocab_size, wcfg.seed)
        outcomes = []
        for run in range(args.runs):
            workload = run_0 if args.prediction else for_run(run_0, run, info.vocab_size)
            before = _settled_engine_stats(engine)
            progress = Progress(sum(r.max_tokens for r in workload), enabled=not args.no_progress)
            traces = submit_all(workload, arrival_offsets(len(workload), wcfg.request_rate,
                                                          wcfg.seed), progress,
                                keep_tokens=bool(args.prediction))
            progress.close()
            after = _settled_engine_stats(engine)
            wall = max(t.finish for t in traces) - min(t.submit for t in traces)
            outcomes.append(RunOutcome(
                mode="in-process", model=info.model, device=_device_name(runner.device),
                max_model_len=max_model_len, traces=traces, wall_s=wall,
                breakdown=DecodeBreakdown.diff(before, after),
                extra={"dtype": str(runner.dtype).removeprefix("torch."),
                       "attention_backend": runner.backend.name,
                       "kv_cache_dtype": runner.kv_cache_dtype_name,
                       "num_kv_blocks": info.num_kv_blocks,
                       "greedy_mismatches": greedy_mismatches(workload, traces)}))
    finally:
        runner_thread.stop()
    return outcomes, workload


def _raise_if_failed(traces: list[Trace], what: str) -> None:
    errors = [t.error for t in traces if t.error]
    if errors:
        raise SystemExit(f"error: {what}: {len(errors)} request(s) failed, e.g. {errors[0]}")


# ---------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m client.bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("where to run (one of)")
    where.add_argument("--target", metavar="HOST:PORT",
                       help="a running nanoserve scheduler (the full gRPC path)")
    where.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                       help="with --target: API key (default: $NANOSERVE_API_KEY)%(default).0s")
    where.add_argument("--tls-ca", metavar="PEM",
                       help="with --target: connect with TLS, trusting this root certificate")
    where.add_argument("--connections", type=int, default=1, metavar="N",
                       help="gRPC modes: spread the requests over N channels (connections); "
                            "the server pins a connection to one frontend process, so use "
                            "N >= its --frontends to load them all (default 1)")
    where.add_argument("--client-procs", type=int, default=0, metavar="P",
                       help="gRPC modes: send the requests from P processes, dealt out in "
                            "turn, each with --connections channels: one Python process "
                            "handles only so many stream messages a second (python -m "
                            "client.grpc_floor), so at high token rates one client process "
                            "can be what delays the tokens it times (default 0 = one per 4 "
                            "cores of this host, 1 to 4; the report records the number used)")
    where.add_argument("--in-process", action="store_true",
                       help="build a ModelRunner here and drive the Engine with it (no gRPC)")
    where.add_argument("--null-worker", action="store_true",
                       help="start a null worker (no model, fixed step time) and the real "
                            "control plane here, and run through gRPC: what the control plane "
                            "costs, on any machine")
    nw = p.add_argument_group("null worker")
    nw.add_argument("--step-ms", type=float, default=7.0,
                    help="the null worker's emulated device time per step (0 = the control "
                         "plane's ceiling)")
    nw.add_argument("--prefill-us-per-token", type=float, default=0.0,
                    help="the null worker's emulated time per prefill token, on top of "
                         "--step-ms (0: every step the same)")
    nw.add_argument("--null-tokenizer", metavar="DIR",
                    help="the null model's tokenizer from this model directory (default: a "
                         "tiny BPE); Qwen3's prices grammar masks (--json-schema) as served")
    nw.add_argument("--scheduler-args", default="",
                    help="extra flags for the scheduler it starts, e.g. '--frontends 2'")
    w = p.add_argument_group("workload (defaults: nano-vllm's bench.py)")
    w.add_argument("--num-seqs", type=int, default=256)
    w.add_argument("--min-input-len", type=int, default=100)
    w.add_argument("--max-input-len", type=int, default=1024)
    w.add_argument("--min-output-len", type=int, default=100)
    w.add_argument("--max-output-len", type=int, default=1024)
    w.add_argument("--temperature", type=float, default=0.6)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--request-rate", type=float, default=0.0, metavar="R",
                   help="online mode: Poisson arrivals at R requests/s (0 = offline: all at once)")
    w.add_argument("--multi-turn", type=int, default=0, metavar="T",
                   help="chat-like traffic instead (client/multi_turn.py): --num-seqs "
                        "conversations of T turns, each prompt resending the conversation; "
                        "prints TTFT per turn and the prefix cache's hit rate (gRPC only)")
    w.add_argument("--routing", default="round_robin",
                   choices=["single", "round_robin", "prefix", "compare"],
                   help="--multi-turn over several replicas (--target H1:P1,H2:P2,... or "
                        "--null-worker --replicas N): grpc's round robin, the client's "
                        "prefix-affine choice (client/routing.py), the first replica alone, "
                        "or all three in turn (fresh replicas each with --null-worker)")
    w.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="--multi-turn --null-worker: start N null-worker replicas")
    w.add_argument("--system-prompt-len", type=int, default=0, metavar="N",
                   help="--multi-turn: a system prompt of N tokens shared by every conversation")
    w.add_argument("--concurrency", type=int, default=0, metavar="C",
                   help="--multi-turn: at most C turns in flight, conversations taking turns "
                        "round-robin so each history idles between its turns (vLLM's "
                        "--num-clients); 0 = every conversation at once")
    w.add_argument("--adapters", metavar="NAMES", default=None,
                   help="comma-separated LoRA adapter names (the server's --lora-modules): "
                        "requests name them in turn (gRPC modes)")
    w.add_argument("--json-schema", metavar="FILE",
                   help="constrain requests to this JSON Schema (structured output); with "
                        "ignore_eos, pick one that does not end early (client/bench_schema.json: "
                        "an array of strings) so lengths match the free run")
    w.add_argument("--constrained-fraction", type=float, default=1.0, metavar="F",
                   help="with --json-schema: the fraction of requests constrained (spread evenly)")
    w.add_argument("--runs", type=int, default=1, metavar="N",
                   help="measured runs of the workload (one warm-up before them); the report "
                        "gives each and min / median / max")
    w.add_argument("--warmup", type=int, default=8, metavar="N",
                   help="requests run first and excluded from every number (the workload's "
                        "prompt lengths, <= 16 output tokens: compiles kernels at real shapes)")

    ip = p.add_argument_group("in-process engine (mirrors the worker/scheduler flags)")
    ip.add_argument("--model", help="model directory (required with --in-process)")
    ip.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    ip.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ip.add_argument("--attention-backend", default="auto",
                    choices=["auto", "flash_attn", "triton", "torch"])
    ip.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ip.add_argument("--quantization", default="auto", choices=["auto", "none", "fp8"],
                    help="weights (worker --quantization)")
    ip.add_argument("--block-size", type=int, default=256)
    ip.add_argument("--num-kv-blocks", type=int, default=0, help="0 = all that fit")
    ip.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ip.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size on CPU")
    ip.add_argument("--max-num-seqs", type=int, default=256)
    ip.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ip.add_argument("--max-prefill-graph-tokens", type=int, default=2048,
                    help="one-sequence prefills up to this many tokens replay a CUDA graph "
                         "(0: all prefills eager)")
    ip.add_argument("--no-overlap", action="store_true",
                    help="one step in flight (the engine waits for each step's ids)")
    ip.add_argument("--fast-forward", action=argparse.BooleanOptionalAction, default=True,
                    help="with --json-schema: forced tokens without a step each, as the "
                         "scheduler's default (through gRPC the scheduler's flag decides)")
    ip.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ip.add_argument("--max-model-len", type=int, default=4096,
                    help="context length (capped by the model's)")

    sp = p.add_argument_group("speculative decoding")
    sp.add_argument("--speculative", default="off", choices=METHODS,
                    help="in-process / null worker: the scheduler's --speculative (a running "
                         "server: start it with the flag)")
    sp.add_argument("--num-speculative-tokens", type=int, default=8, metavar="K")
    sp.add_argument("--speculative-max-batch", type=int, default=32, metavar="N")
    sp.add_argument("--prediction", choices=PREDICTIONS, default=None,
                    help="send each request a prediction of its output (greedy, so "
                         "--temperature is 0): a first unmeasured greedy run gets the answers; "
                         "exact sends them, half replaces every other 16-token run with random "
                         "ids, wrong sends another request's answer. The measured runs repeat "
                         "the same prompts (their prefill hits the prefix cache)")
    from client import embed_bench, mixed
    mixed.add_flags(p)
    embed_bench.add_flags(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the full report (and the command) here")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--timeout", type=float, default=None, help="gRPC deadline per request (s)")
    o.add_argument("--device-name", default=None,
                   help="gRPC mode: the server's device, for the report (the API does not say)")
    return p


SPREAD_METRICS = {   # name in the spread table -> where it is in a run's results
    "output tok/s": ("output_tok_per_s",),
    "step wall ms": ("decode", "per_step_ms", "wall"),
    "GPU busy ms": ("decode", "per_step_ms", "gpu"),
    "idle %": ("decode", "idle_pct"),
    "TTFT p99 ms": ("ttft_ms", "p99"),
    "ITL p99 ms": ("itl_ms", "p99"),
    "tokens/message": ("tokens_per_message",),
    "ctl CPU us/tok": ("cpu", "control_plane_us_per_token"),
    "host M loop/s": ("cpu", "host_speed"),
}


def spread(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """min / median / max over runs of each SPREAD_METRICS entry (None where unmeasured)."""
    out = {}
    for name, path in SPREAD_METRICS.items():
        values = []
        for r in runs:
            v: Any = r
            for key in path:   # None where a mode does not measure it
                v = v.get(key) if isinstance(v, dict) else None
            if v is not None:
                values.append(v)
        values.sort()
        out[name] = ({"min": values[0], "median": values[len(values) // 2], "max": values[-1]}
                     if values else {"min": None, "median": None, "max": None})
    return out


def format_spread(runs: list[dict[str, Any]], table: dict[str, dict]) -> str:
    lines = [f"{len(runs)} runs:   " + "   ".join(f"{r['output_tok_per_s']:,.0f}" for r in runs)
             + " output tok/s",
             f"{'':14}{'min':>12}{'median':>12}{'max':>12}"]
    for name, v in table.items():
        if v["median"] is not None:
            lines.append(f"{name:14}" + "".join(f"{v[k]:12,.3f}" for k in ("min", "median", "max")))
    return "\n".join(lines)


def spec_config(args: argparse.Namespace) -> Any:
    from scheduler_service.speculation import SpecConfig
    return SpecConfig(method=args.speculative, num_tokens=args.num_speculative_tokens,
                      max_batch=args.speculative_max_batch)


def default_client_procs() -> int:
    """One sending process per 4 cores, 1 to 4: on a GPU host (16 cores) one process falls
    behind the online token rate (tests/gpu/RESULTS.md: ITL p99 +9-17% from one process,
    within 1% of in-process from four); on a 2-core box more would only compete with the
    server for the cores."""
    return max(1, min(4, host_cores() // 4))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if sum(map(bool, (args.target, args.in_process, args.null_worker))) != 1:
        parser.error("give exactly one of --target HOST:PORT, --in-process or --null-worker")
    if args.in_process and not args.model:
        parser.error("--in-process needs --model DIR")
    if not (1 <= args.min_input_len <= args.max_input_len and
            1 <= args.min_output_len <= args.max_output_len and args.num_seqs >= 1):
        parser.error("need 1 <= min <= max for input and output lengths, and --num-seqs >= 1")
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    if args.connections < 1 or args.client_procs < 0:
        parser.error("--connections must be >= 1 and --client-procs >= 0")
    if sum(map(bool, (args.embed, args.score, args.mixed, args.multi_turn))) > 1:
        parser.error("give at most one of --embed, --score, --mixed and --multi-turn")
    if args.flood_kind != "generate" and not args.mixed:
        parser.error("--flood-kind is for --mixed")
    if min(args.score_docs, args.score_len, args.score_query_len) < 1:
        parser.error("--score-docs, --score-len and --score-query-len must be >= 1")
    if args.embed or args.score:
        from client import embed_bench
        return embed_bench.run(args, argv)
    if args.multi_turn:
        if args.in_process:
            parser.error("--multi-turn needs a server (--target or --null-worker)")
        if args.concurrency < 0:
            parser.error("--concurrency must be >= 0 (0: every conversation at once)")
        from client import multi_turn
        return multi_turn.run(args)
    if args.concurrency:
        parser.error("--concurrency is for --multi-turn")
    if args.adapters and (args.in_process or args.null_worker):
        parser.error("--adapters needs a server (--target)")
    if args.client_procs > 1 and args.in_process:
        parser.error("--client-procs is for the gRPC modes (--target, --null-worker)")
    if args.client_procs == 0:
        args.client_procs = 1 if args.in_process or args.prediction else default_client_procs()
    try:
        spec_config(args)
    except ValueError as e:
        parser.error(str(e))
    if args.prediction:
        args.temperature = 0.0
        if args.client_procs > 1:
            parser.error("--prediction runs from one client process (--client-procs 1)")
    wcfg = WorkloadConfig(num_seqs=args.num_seqs, min_input_len=args.min_input_len,
                          max_input_len=args.max_input_len, min_output_len=args.min_output_len,
                          max_output_len=args.max_output_len, temperature=args.temperature,
                          seed=args.seed, request_rate=args.request_rate,
                          json_schema=_read_text(args.json_schema),
                          constrained_fraction=args.constrained_fraction)
    if args.mixed:
        if args.in_process:
            parser.error("--mixed needs gRPC (--target or --null-worker)")
        from client import mixed
        return mixed.run(args, lambda vocab, max_len: [
            (r.prompt_ids, r.max_tokens) for r in make_workload(wcfg, vocab, max_len)], argv)
    run: Callable = (run_in_process if args.in_process else run_null if args.null_worker
                     else run_grpc)
    outcomes, workload = run(args, wcfg)
    runs = [summarize(o, workload) for o in outcomes]
    median = sorted(range(len(runs)), key=lambda i: runs[i]["output_tok_per_s"])[len(runs) // 2]
    outcome = outcomes[median]
    report = {
        "command": shlex.join([sys.executable, "-m", "client.bench",
                               *(sys.argv[1:] if argv is None else argv)]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "mode": outcome.mode,
        "model": outcome.model,
        "device": outcome.device,
        "max_model_len": outcome.max_model_len,
        "config": vars(args),
        "workload": asdict(wcfg),
        "results": runs[median],          # the median run by output tok/s
        "runs": runs,
        "spread": spread(runs),
        **outcome.extra,
    }
    print(format_report(report))
    if len(runs) > 1:
        print(format_spread(runs, report["spread"]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, allow_nan=False, default=_json_default)
            f.write("\n")
    for r in runs:
        if r["failed"]:
            print(f"error: {r['failed']} request(s) failed, e.g. {r['errors'][0]}", file=sys.stderr)
            return 1
        if r["output_tokens"] != r["expected_output_tokens"]:
            print(f"error: {r['output_tokens']} output tokens, expected "
                  f"{r['expected_output_tokens']} (ignore_eos: every request should run to "
                  "max_tokens)", file=sys.stderr)
            return 1
    return 0


def _json_default(obj: Any) -> Any:
    return str(obj)


if __name__ == "__main__":
    sys.exit(main())
