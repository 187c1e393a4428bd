"""`client.bench --multi-turn T`: chat-like traffic whose prompts resend the conversation.

N conversations (--num-seqs) of T turns each: turn t's prompt is a system prompt shared by
all (--system-prompt-len tokens), the conversation so far (every earlier prompt and answer),
and a new user message (--min/max-input-len tokens); the answer is --min/max-output-len
tokens (ignore_eos). A turn's history is exactly what the server computed at the previous
turn, so it can come from the prefix cache, on the device or in its host tier (workers'
--host-kv-cache-gb), or is recomputed when evicted.

--concurrency C (default N: every conversation at once) sends at most C turns at a time,
as vLLM's multi-turn benchmark does (--num-clients): conversations take turns round-robin,
so each one's history sits idle while the others' turns run, the way a chat user reads and
types between turns. That idle history is what a device cache smaller than the live
histories evicts and a host tier keeps; with C = N every conversation is always in flight
and the device cache instead bounds the running batch.

Several replicas (--target H1:P1,H2:P2,... or --null-worker --replicas N), --routing:
`round_robin` (grpc's, per call), `prefix` (the client's prefix-affine choice,
client/routing.py), `single` (the first replica serves all: the hit rate to match), or
`compare` (the three in turn, each on fresh null-worker replicas or with its own seed
against --target, so no policy inherits another's cache) and a summary line per policy.

Printed: per turn, TTFT p50 / p90, the queue's part of it (arrival at the engine core to
the first step that scheduled the request: the server's usage.queue_ms) and the share of
prompt tokens served from the cache, from the host tier among them; overall output tok/s
and the host tier's blocks moved (GetStats).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    host_cached_tokens: int
    queue_s: float
    output_tokens: int
    ttft_s: float
    e2e_s: float


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def clients(args: Any) -> int:
    """Turns in flight at most: --concurrency, 0 meaning every conversation."""
    return min(args.concurrency or args.num_seqs, args.num_seqs)


@dataclass
class Conversation:
    """One conversation's state between its turns."""
    index: int
    rng: random.Random
    history: list[int]
    turn: int = 0


async def _turn(client: Any, c: Conversation, args: Any, vocab: int, max_model_len: int,
                turns: list[Turn]) -> bool:
    """Send c's next turn; False once the conversation is over (or outgrew the context)."""
    from client.client import SamplingParams, Usage
    rng = c.rng
    user = [rng.randrange(vocab) for _ in range(rng.randint(args.min_input_len,
                                                           args.max_input_len))]
    n_out = rng.randint(args.min_output_len, args.max_output_len)
    prompt = c.history + user
    if len(prompt) + n_out > max_model_len:
        return False
    params = SamplingParams(temperature=args.temperature, max_tokens=n_out, ignore_eos=True,
                            seed=rng.randrange(1 << 31))
    out: list[int] = []
    usage, first = Usage(), None
    t0 = time.perf_counter()
    async for chunk in client.generate(prompt, params):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
        out.extend(chunk.token_ids)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    turns.append(Turn(c.index, c.turn, len(prompt), usage.cached_tokens,
                      usage.host_cached_tokens, usage.queue_ms / 1e3, len(out),
                      (first or end) - t0, end - t0))
    c.history, c.turn = prompt + out, c.turn + 1
    return c.turn < args.multi_turn


async def _client(client: Any, ready: asyncio.Queue, args: Any, vocab: int,
                  max_model_len: int, turns: list[Turn]) -> None:
    """One of --concurrency clients: advance the longest-waiting conversation, one turn."""
    while not ready.empty():
        c = ready.get_nowait()
        if await _turn(client, c, args, vocab, max_model_len, turns):
            ready.put_nowait(c)   # to the back: every other waiting conversation goes first


async def _run(args: Any, target: str | None = None, routing: str = "round_robin",
               seed: int | None = None) -> dict:
    from client.client import AsyncClient
    seed = args.seed if seed is None else seed
    target = target or args.target
    if routing == "single":
        target, routing = target.split(",")[0], "round_robin"
    async with AsyncClient(target, timeout=args.timeout, api_key=args.api_key,
                           tls_ca=args.tls_ca, routing=routing) as client:
        info = await client.model_info()
        vocab = min(info.vocab_size, 10_000)
        rng = random.Random(seed)
        system = [rng.randrange(vocab) for _ in range(args.system_prompt_len)]
        before = await client.stats()
        turns: list[Turn] = []
        t0 = time.perf_counter()
        ready: asyncio.Queue = asyncio.Queue()
        for i in range(args.num_seqs):
            ready.put_nowait(Conversation(i, random.Random(seed * 1_000_003 + i),
                                          list(system)))
        await asyncio.gather(*(_client(client, ready, args, vocab, info.max_model_len, turns)
                               for _ in range(clients(args))))
        wall = time.perf_counter() - t0
        after = await client.stats()
    per_turn = []
    for t in range(args.multi_turn):
        rows = [x for x in turns if x.turn == t]
        if rows:
            per_turn.append({
                "turn": t + 1, "requests": len(rows),
                "prompt_tokens": statistics.mean(x.prompt_tokens for x in rows),
                "ttft_p50_ms": _p([x.ttft_s for x in rows], 0.5) * 1e3,
                "ttft_p90_ms": _p([x.ttft_s for x in rows], 0.9) * 1e3,
                "queue_p50_ms": _p([x.queue_s for x in rows], 0.5) * 1e3,
                "cached": sum(x.cached_tokens for x in rows) / sum(x.prompt_tokens for x in rows),
                "host_cached": sum(x.host_cached_tokens for x in rows) / sum(x.prompt_tokens
                                                                              for x in rows)})
    return {"model": info.model, "wall_s": wall,
            "output_tok_per_s": sum(x.output_tokens for x in turns) / wall,
            "ttft_p50_ms": _p([x.ttft_s for x in turns], 0.5) * 1e3,
            "queue_p50_ms": _p([x.queue_s for x in turns], 0.5) * 1e3,
            "cached": sum(x.cached_tokens for x in turns) / max(1, sum(x.prompt_tokens for x in turns)),
            "host_kv_blocks": after.num_host_kv_blocks,
            "host_offloaded_blocks": after.num_host_kv_offloaded_blocks - before.num_host_kv_offloaded_blocks,
            "host_restored_blocks": after.num_host_kv_restored_blocks - before.num_host_kv_restored_blocks,
            "per_turn": per_turn, "turns": [asdict(x) for x in turns]}


def _policy(args: Any, routing: str, seed: int) -> dict:
    """One policy's run: on --target, or on fresh null-worker replicas."""
    if not getattr(args, "null_worker", False):
        return asyncio.run(_run(args, args.target, routing, seed))
    import contextlib
    import shlex

    from client.null_stack import NullStack
    with contextlib.ExitStack() as stack:
        stacks = [stack.enter_context(NullStack(
            step_ms=args.step_ms, scheduler_args=shlex.split(args.scheduler_args),
            tokenizer_dir=args.null_tokenizer)) for _ in range(max(1, args.replicas))]
        return asyncio.run(_run(args, ",".join(s.target for s in stacks), routing, seed))


def run(args: Any) -> int:
    routing = getattr(args, "routing", "round_robin")
    policies = ["single", "round_robin", "prefix"] if routing == "compare" else [routing]
    reports = {p: _policy(args, p, args.seed + (k if args.target else 0))
               for k, p in enumerate(policies)}
    for p, report in reports.items():
        if len(policies) > 1:
            print(f"---- routing: {p}")
        _print(args, report)
    if len(policies) > 1:
        print("policy        prompt tokens from cache  TTFT p50 ms  TTFT p90 ms  output tok/s")
        for p, r in reports.items():
            ttft = [t["ttft_s"] for t in r["turns"]]
            print(f"{p:12s}  {r['cached']:24.1%}  {r['ttft_p50_ms']:11.1f}  "
                  f"{_p(ttft, 0.9) * 1e3:11.1f}  {r['output_tok_per_s']:12.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            body = reports[policies[0]] if len(policies) == 1 else {"policies": reports}
            json.dump({"config": vars(args), **body}, f, indent=2)
    return 0


def _print(args: Any, report: dict) -> None:
    print(f"model          {report['model']}   {args.num_seqs} conversations x {args.multi_turn} "
          f"turns, system prompt {args.system_prompt_len} tokens, "
          f"{clients(args)} at a time")
    print(f"output tok/s   {report['output_tok_per_s']:,.1f}   wall {report['wall_s']:.2f} s")
    print(f"TTFT p50 ms    {report['ttft_p50_ms']:.1f} (queued p50 {report['queue_p50_ms']:.1f})   "
          f"prompt tokens from the cache {report['cached']:.1%}")
    print(f"host tier      {report['host_kv_blocks']} blocks; moved out "
          f"{report['host_offloaded_blocks']}, back {report['host_restored_blocks']}")
    print("turn  requests  prompt tokens  TTFT p50 ms  TTFT p90 ms  queued p50 ms  cached  "
          "from host")
    for r in report["per_turn"]:
        print(f"{r['turn']:4d}  {r['requests']:8d}  {r['prompt_tokens']:13.0f}  "
              f"{r['ttft_p50_ms']:11.1f}  {r['ttft_p90_ms']:11.1f}  {r['queue_p50_ms']:13.1f}  "
              f"{r['cached']:6.1%}  {r['host_cached']:9.1%}")
    expected = args.num_seqs * args.multi_turn
    if len(report["turns"]) < expected:
        print(f"note: {expected - len(report['turns'])} turns did not fit the context")
