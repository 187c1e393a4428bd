"""client.bench --embed and --score: the pooling requests' figures through gRPC (issue 67).

--embed: embeddings per second through `Embed`. Documents of --embed-len random token ids
(ids < 10000, as the generation workload's), sent as requests of --embed-batch inputs with
--embed-concurrency requests in flight. One warm-up request first; then embeddings/s, prompt
tokens/s and request latency percentiles. Distinct documents: no prefix-cache hits.

--score: reranker latency through `Score`, one request at a time: a query of
--score-query-len tokens against --score-docs documents of --score-len tokens. `Score` takes
text, so both are random lowercase words, as many as the server's tokenizer (its `Tokenize`)
makes the asked length or a word less. --warmup requests, then --runs measured, each with a
fresh query (so no request finds another's query in the prefix cache): latency and
documents/s (min / median / max), and each request's prompt tokens and those served from the
prefix cache (its usage), beside what computing the shared prefix (the reranker's system
prompt, instruction and query) once a request would cache.

Against --target (a server with --task embed / score) or a null worker started here (its
made-up vectors and scores: what the control plane alone sustains).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import string
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

# As the generation workload (bench.PROMPT_ID_HIGH; bench imports this module, not the reverse).
ID_HIGH = 10000


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
    s = p.add_argument_group("reranking mode (--score: Score latency, one query x N documents)")
    s.add_argument("--score", action="store_true",
                   help="time Score requests one at a time (--warmup first, then --runs "
                        "measured) instead of the generation workload, with the prompt tokens "
                        "each computed and found in the prefix cache")
    s.add_argument("--score-docs", type=int, default=100, metavar="N", help="documents a request")
    s.add_argument("--score-len", type=int, default=256, metavar="L",
                   help="tokens a document (random words)")
    s.add_argument("--score-query-len", type=int, default=32, metavar="Q",
                   help="tokens of the query (random words, a fresh query each request)")


# ---------------------------------------------------------------------------- embeddings
def documents(rng: random.Random, n: int, length: int, high: int = ID_HIGH) -> list[list[int]]:
    """n documents of `length` random token ids < high (distinct: no prefix-cache hits)."""
    return [[rng.randrange(high) for _ in range(length)] for _ in range(n)]


@dataclass
class Sent:
    """What sending a set of Embed requests took."""
    documents: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)   # seconds, one per request answered
    errors: list[str] = field(default_factory=list)

    @property
    def per_s(self) -> float:
        return self.documents / self.wall_s if self.wall_s else 0.0


async def embed_all(client: Any, batches: list[list[list[int]]], concurrency: int,
                    dimensions: int = 0, priority: int | None = None) -> Sent:
    """Every batch through Embed, `concurrency` requests in flight. Shared by --embed and
    --mixed --flood-kind embed (the flood beside a generation stream)."""
    from client.client import NanoserveError
    sent = Sent(documents=sum(map(len, batches)))
    sem = asyncio.Semaphore(concurrency)

    async def one(batch: list[list[int]]) -> None:
        async with sem:
            t = time.perf_counter()
            try:
                out = await client.embed(batch, dimensions=dimensions, priority=priority)
            except NanoserveError as e:
                sent.errors.append(f"{e.code.name}: {e.message}")
                return
            sent.latencies.append(time.perf_counter() - t)
            assert len(out) == len(batch)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in batches))
    sent.wall_s = time.perf_counter() - t0
    return sent


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def _measure_embed(client: Any, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    docs = documents(rng, args.num_seqs, args.embed_len)
    batches = [docs[i:i + args.embed_batch] for i in range(0, len(docs), args.embed_batch)]
    await client.embed(documents(rng, 1, args.embed_len), dimensions=args.embed_dimensions)
    sent = await embed_all(client, batches, args.embed_concurrency, args.embed_dimensions)
    return {"documents": len(docs), "tokens_per_document": args.embed_len,
            "batch": args.embed_batch, "concurrency": args.embed_concurrency,
            "wall_s": sent.wall_s, "embeddings_per_s": sent.per_s,
            "prompt_tok_per_s": sent.per_s * args.embed_len,
            "request_ms": {"p50": _percentile(sent.latencies, 0.5) * 1e3,
                           "p99": _percentile(sent.latencies, 0.99) * 1e3},
            "failed": len(sent.errors), "errors": sent.errors[:3]}


def _describe_embed(r: dict) -> str:
    return (f"{r['documents']} documents x {r['tokens_per_document']} tokens "
            f"({r['batch']} a request, {r['concurrency']} in flight) on "
            f"{r['device']}: {r['embeddings_per_s']:,.1f} embeddings/s, "
            f"{r['prompt_tok_per_s']:,.0f} prompt tok/s, request p50 "
            f"{r['request_ms']['p50']:.1f} ms, p99 {r['request_ms']['p99']:.1f} ms")


# ---------------------------------------------------------------------------- scores
async def random_texts(client: Any, rng: random.Random, n: int, tokens: int
                       ) -> list[tuple[str, int]]:
    """n texts of random lowercase words, each as many words as the server's tokenizer makes
    at most `tokens` tokens (at least one word); with their token counts. Score takes text,
    and what a word costs depends on the vocabulary, so the server's Tokenize measures it."""
    pools = [[_word(rng) for _ in range(max(tokens, 1))] for _ in range(n)]   # a word >= 1 token

    async def fit(words: list[str]) -> tuple[str, int]:
        lo, hi = 1, len(words)   # the most words that fit, by bisection
        count = {}
        while lo < hi:
            mid = (lo + hi + 1) // 2
            count[mid] = len(await client.tokenize(" ".join(words[:mid])))
            lo, hi = (mid, hi) if count[mid] <= tokens else (lo, mid - 1)
        text = " ".join(words[:lo])
        return text, count[lo] if lo in count else len(await client.tokenize(text))

    return list(await asyncio.gather(*(fit(w) for w in pools)))


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))


async def _score(client: Any, query: str, docs: list[str]) -> tuple[list[float], Any]:
    """One Score request: (scores, usage). Client.score returns the scores alone; the usage
    (prompt and cached tokens) is the evidence of prefix sharing, hence the stub here."""
    from client.client import _score_request, _usage
    resp = await client._unary(client._stub.Score,
                               _score_request(query, docs, "", False, None, ""), None)
    return list(resp.scores), _usage(resp)


async def _shared_prefix(client: Any, query: str, docs: list[str]) -> tuple[int, int]:
    """(tokens every prompt of a request starts with: the reranker's system prompt,
    instruction and query; of them, those every request's prompts start with: all but the
    query), as the server builds the prompts and as its tokenizer counts them."""
    from scheduler_service.pooling import RERANK_PREFIX, rerank_middle
    prefix = len(await client.tokenize(RERANK_PREFIX))
    no_query, first, *rest = await asyncio.gather(
        client.tokenize(rerank_middle("", docs[0])),
        *(client.tokenize(rerank_middle(query, d)) for d in docs))
    within = min((_common(first, m) for m in rest), default=len(first))
    return prefix + within, prefix + min(_common(first, no_query), within)


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of a and b."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def query_computed_times(documents: int, cached: int, every_request: int,
                         query_blocks: int) -> tuple[float | None, bool]:
    """(how many of a request's documents computed the query's own full blocks, whether
    documents also hit blocks of each other's). The cache hits past the part every request
    shares are the query's blocks, found by all documents but those that computed them;
    more hits than documents - 1 can make are documents sharing blocks of their own (random
    texts may begin alike), and then the count is known only to be at least 1."""
    if not query_blocks:
        return None, False
    times = documents - max(cached - documents * every_request, 0) / query_blocks
    return max(times, 1.0), times < 1


async def _measure_score(client: Any, args: argparse.Namespace) -> dict:
    info = await client.model_info()
    rng = random.Random(args.seed)
    made = await random_texts(client, rng, args.score_docs, args.score_len)
    docs = [t for t, _ in made]
    queries = await random_texts(client, rng, args.warmup + args.runs, args.score_query_len)
    within, across = await _shared_prefix(client, queries[args.warmup][0], docs)
    # Only full blocks hit. Those of the part every request shares come from the requests
    # before (every document finds them); the query's own, from the request's first documents.
    bs, d = info.block_size, len(docs)
    every_request = across // bs * bs
    query_blocks = within // bs * bs - every_request
    for query, _ in queries[:args.warmup]:
        await _score(client, query, docs)
    runs = []
    for query, _ in queries[args.warmup:]:
        t = time.perf_counter()
        scores, usage = await _score(client, query, docs)
        latency = time.perf_counter() - t
        assert len(scores) == d and all(0.0 <= s <= 1.0 for s in scores), scores[:4]
        times, shared = query_computed_times(d, usage.cached_tokens, every_request, query_blocks)
        runs.append({"latency_ms": latency * 1e3, "documents_per_s": d / latency,
                     "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                     "query_computed_times": times, "documents_shared_blocks": shared})

    def spread(key: str) -> dict[str, float]:
        values = [r[key] for r in runs]
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    prompt = statistics.mean(r["prompt_tokens"] for r in runs)
    cached = statistics.mean(r["cached_tokens"] for r in runs)
    return {"documents": d,
            "tokens_per_document": statistics.mean(n for _, n in made),
            "query_tokens": statistics.mean(n for _, n in queries[args.warmup:]),
            "warmup": args.warmup, "block_size": bs,
            "latency_ms": spread("latency_ms"), "documents_per_s": spread("documents_per_s"),
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
            "shared_prefix_tokens": within, "shared_by_every_request_tokens": across,
            "query_block_tokens": query_blocks,
            "query_computed_times": spread("query_computed_times") if query_blocks else None,
            "documents_shared_blocks": any(r["documents_shared_blocks"] for r in runs),
            "runs": runs}


def _describe_score(r: dict) -> str:
    lat, dps, times = r["latency_ms"], r["documents_per_s"], r["query_computed_times"]
    shared = (f"the {r['query_block_tokens']} tokens of the query's own full "
              f"{r['block_size']}-token blocks computed by {times['median']:.1f} of the "
              f"{r['documents']} documents (median; 1 = once a request"
              + ("; documents also hit each other's blocks: 1 is a lower bound)"
                 if r.get("documents_shared_blocks") else ")") if times else
              f"no full {r['block_size']}-token block of the query's own to share "
              "(scheduler --block-size)")
    return "\n".join([
        f"1 query x {r['documents']} documents ({r['query_tokens']:.0f} + "
        f"{r['tokens_per_document']:.0f} tokens) on {r['device']}, {len(r['runs'])} "
        f"requests: latency min / median / max {lat['min']:.1f} / {lat['median']:.1f} / "
        f"{lat['max']:.1f} ms, {dps['median']:,.1f} documents/s (median)",
        f"prompt tokens a request {r['prompt_tokens']:,.0f}: {r['cached_tokens']:,.0f} from the "
        f"prefix cache, {r['computed_tokens']:,.0f} computed",
        f"shared prefix {r['shared_prefix_tokens']} tokens ({r['shared_by_every_request_tokens']} "
        f"the same in every request: system prompt, instruction); {shared}"])


# ---------------------------------------------------------------------------- both
def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """--embed or --score, against --target or a null worker started here serving that task."""
    from client.client import AsyncClient
    mode = "score" if args.score else "embed"
    if args.in_process:
        print(f"error: --{mode} needs gRPC (--target or --null-worker)", file=sys.stderr)
        return 2
    measure: Callable = _measure_score if args.score else _measure_embed
    describe: Callable[[dict], str] = _describe_score if args.score else _describe_embed

    async def measured() -> dict:
        async with AsyncClient(args.target, api_key=args.api_key, timeout=args.timeout,
                               tls_ca=args.tls_ca) as client:
            info = await client.model_info()
            if mode not in info.task.split(","):
                raise SystemExit(f"error: the server serves {info.task or 'generate'}; --{mode} "
                                 f"needs workers and scheduler started with --task {mode}")
            return {"model": info.model, "task": info.task, **await measure(client, args)}

    if args.null_worker:
        from client.null_stack import NullStack
        # the null model's tiny tokenizer has no one-token "yes" (Qwen3's, --null-tokenizer, has)
        words = ["--score-tokens", "y,n"] if args.score and not args.null_tokenizer else []
        with NullStack(step_ms=args.step_ms, max_model_len=args.max_model_len,
                       scheduler_args=[*shlex.split(args.scheduler_args), "--task", mode, *words],
                       worker_args=["--task", mode],
                       tokenizer_dir=args.null_tokenizer) as stack:
            args.target = stack.target
            report = asyncio.run(measured())
        report["device"] = f"null worker, {args.step_ms:g} ms/step"
    else:
        report = asyncio.run(measured())
        report["device"] = args.device_name or "unknown (--device-name)"
    report["command"] = shlex.join([sys.executable, "-m", "client.bench",
                                    *(sys.argv[1:] if argv is None else argv)])
    print(describe(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")
    if report.get("failed"):
        print(f"error: {report['failed']} request(s) failed, e.g. {report['errors'][0]}",
              file=sys.stderr)
        return 1
    return 0
