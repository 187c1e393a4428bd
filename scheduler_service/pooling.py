"""Embeddings and reranker scores through a frontend, whatever protocol they came in on.

A pooling request is one sequence per input: its prompt is prefilled like a generation's
(chunked, prefix-cached, batched with other traffic under the same budgets, priorities
and key quotas) and its one "sample" is the worker's pooled answer (worker.proto's
WorkerPooling): the embedding (last token, L2-normalised, first `dimensions` values) or
P(yes) against P(no) at the last position of a reranker's judgement prompt. Nothing
decodes, nothing is detokenized.

Prompts follow Qwen3's models:
* embed: the text tokenized with the model's special tokens (Qwen3-Embedding's tokenizer
  appends <|endoftext|>, whose hidden state is the embedding); queries carry their
  instruction in the text ("Instruct: {task}\\nQuery:{query}"), as the model card says.
* score: Qwen3-Reranker's prompt, built as its model card does: a fixed prefix, then
  "<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}", then a fixed suffix;
  every document of a request shares the prefix, instruction and query, which the prefix
  cache computes once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from nanoserve.v1 import worker_pb2
from scheduler_service import metrics
from scheduler_service.api_keys import OPEN, ApiKey
from scheduler_service.engine_client import EngineUnavailable
from scheduler_service.generation import Generation, RequestError, core_error, invalid
from scheduler_service.sequence import SamplingOptions

EMBED = worker_pb2.WorkerPooling.KIND_EMBED
SCORE = worker_pb2.WorkerPooling.KIND_SCORE

MAX_INPUTS = 2048   # inputs (or documents) per request

RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
                 "the Query and the Instruct provided. Note that the answer can only be \"yes\" "
                 "or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def rerank_middle(query: str, document: str, instruction: str = "") -> str:
    """The part of Qwen3-Reranker's prompt between its fixed prefix and suffix."""
    return (f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}")


@dataclass
class Pooled:
    """One request's answers, in input order, and its usage."""
    values: list[bytes]     # float32 little-endian, one run per input
    prompt_tokens: int
    cached_tokens: int


class Pooling:
    """The pooling request path shared by the gRPC and HTTP APIs."""

    def __init__(self, gen: Generation, tasks: tuple[str, ...], hidden_size: int,
                 score_tokens: tuple[str, str] = ("yes", "no")):
        self.gen = gen
        self.tasks = tasks
        self.hidden_size = hidden_size
        self.score_tokens = score_tokens

    def require(self, task: str) -> None:
        """INVALID_ARGUMENT unless this deployment serves `task`."""
        if task not in self.tasks:
            served = ",".join(self.tasks)
            raise invalid(f"this deployment serves {served} (--task {served}), not {task}: "
                          f"{_WHAT[task]} need a server started with --task {task}")

    # ---- prompts ----------------------------------------------------------------------

    @property
    def _limit(self) -> int:
        lim = self.gen.limits
        return min(lim.max_model_len, lim.max_kv_tokens)

    def embed_prompt(self, text: str | None = None, ids: list[int] | None = None,
                     truncate: bool = False) -> list[int]:
        """An input to embed as token ids (text with the model's special tokens), checked;
        truncate: a long one keeps its first tokens and a trailing special token."""
        if ids is None:
            if not text:
                raise invalid("empty input")
            ids = self.gen.tokenizer.encode(text)
        elif not ids:
            raise invalid("empty input")
        else:
            vocab = self.gen.limits.vocab_size
            if bad := [t for t in ids if not 0 <= t < vocab]:
                raise invalid(f"token id {bad[0]} out of vocabulary (size {vocab})")
        limit = self._limit
        if len(ids) > limit:
            if not truncate:
                raise invalid(f"input has {len(ids)} tokens; the limit is {limit} (context "
                              f"length {self.gen.limits.max_model_len}; or ask for truncate)")
            tail = [ids[-1]] if ids[-1] in self.gen.tokenizer.eos_token_ids else []
            ids = ids[:limit - len(tail)] + tail
        return list(ids)

    def score_ids(self) -> tuple[int, int]:
        """The (yes, no) token ids the reranker compares (--score-tokens)."""
        ids = []
        for word in self.score_tokens:
            got = self.gen.tokenizer.encode(word, add_special_tokens=False)
            if len(got) != 1:
                raise RequestError("FAILED_PRECONDITION", f"score token {word!r} is {len(got)} "
                                   "tokens in this model's vocabulary, not one (--score-tokens)")
            ids.append(got[0])
        return ids[0], ids[1]

    def score_prompt(self, query: str, document: str, instruction: str = "",
                     truncate: bool = False) -> list[int]:
        """Qwen3-Reranker's prompt for one (query, document) pair, as its model card builds
        it; truncate: a long one loses its document's end."""
        if not query:
            raise invalid("empty query")
        enc = self.gen.tokenizer.encode
        prefix = enc(RERANK_PREFIX, add_special_tokens=False)
        suffix = enc(RERANK_SUFFIX, add_special_tokens=False)
        middle = enc(rerank_middle(query, document, instruction), add_special_tokens=False)
        room = self._limit - len(prefix) - len(suffix)
        if len(middle) > room:
            if not truncate:
                raise invalid(f"query and document are {len(prefix) + len(middle) + len(suffix)} "
                              f"tokens; the limit is {self._limit} (or ask for truncate)")
            keep = len(enc(rerank_middle(query, "", instruction), add_special_tokens=False))
            if keep > room:   # (the document goes, the instruction and query must stay)
                raise invalid(f"the reranker's prompt without its document is "
                              f"{len(prefix) + keep + len(suffix)} tokens; the limit is "
                              f"{self._limit}")
            middle = middle[:room]
        return prefix + middle + suffix

    # ---- running ----------------------------------------------------------------------

    def options(self, kind: int, key: ApiKey = OPEN, priority: int | None = None,
                dimensions: int = 0, deadline: float = 0.0) -> SamplingOptions:
        """A pooling request's options (its key's priority rules applied)."""
        if kind == EMBED and not 0 <= dimensions <= self.hidden_size:
            raise invalid(f"dimensions must be in [1, {self.hidden_size}] (unset: all), "
                          f"got {dimensions}")
        opts = SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True, pooling=kind,
                               dimensions=dimensions if kind == EMBED else 0,
                               score_ids=self.score_ids() if kind == SCORE else (),
                               deadline=deadline)
        self.gen.apply_key(key, opts, priority)
        return opts

    async def run(self, prompts: list[list[int]], opts: SamplingOptions) -> Pooled:
        """Every prompt as a sequence of its own, at once; their answers in order
        (RequestError on the first failure: the rest are aborted)."""
        gen = self.gen
        if not prompts:
            raise invalid("no inputs")
        if len(prompts) > MAX_INPUTS:
            raise invalid(f"at most {MAX_INPUTS} inputs per request, got {len(prompts)}")
        if not gen.accepting:
            raise RequestError("UNAVAILABLE", "server is shutting down")
        start = time.monotonic()
        streams = []
        gen.in_flight += 1
        gen.idle.clear()
        outcome = ("abort", "CANCELLED")
        try:
            try:
                for ids in prompts:
                    streams += gen.engine.submit(ids, dataclasses.replace(opts))
            except EngineUnavailable as e:
                raise RequestError("UNAVAILABLE", str(e)) from None
            results = await asyncio.gather(*(self._answer(s) for s in streams))
            outcome = ("stop", "OK")
        except RequestError as e:
            outcome = ("error", e.code)
            raise
        finally:
            for s in streams:
                gen.engine.release(s, abort=s.finish is None and s.error is None)
            metrics.request_ended(*outcome)
            gen.in_flight -= 1
            if not gen.in_flight:
                gen.idle.set()
        metrics.E2E.observe(time.monotonic() - start)
        prompt_tokens = sum(map(len, prompts))
        metrics.PROMPT_TOKENS.inc(prompt_tokens)
        return Pooled([v for v, _ in results], prompt_tokens, sum(c for _, c in results))

    async def _answer(self, stream) -> tuple[bytes, int]:
        """(values, cached prompt tokens) of one pooling sequence, once it ends."""
        while stream.finish is None and stream.error is None:
            await stream.next(self.gen.turns)
        if stream.error is not None:
            raise core_error(*stream.error)
        if stream.pooled is None:
            raise RequestError("INTERNAL", "the workers answered no pooled values")
        return stream.pooled, stream.finish[1]


_WHAT = {"generate": "completions and chat", "embed": "embeddings", "score": "scores and reranking"}
