"""One request's path through a frontend, whatever protocol it came in on.

A protocol adapter (the gRPC servicer in frontend.py, an HTTP API beside it) turns its
request into prompt ids (`prompt_from_*`) and `SamplingOptions` (checked by
`check_sampling`; from the public nanoserve.v1 SamplingParams by `sampling_from_proto`,
which both the gRPC and the HTTP API use), then iterates `Generation.stream`: text and
token deltas as the engine core produces them, detokenized incrementally with stop strings
applied, the last one carrying the finish reason and usage. Failures are `RequestError`s
carrying a gRPC status code name, which each adapter maps to its own error shape. Whatever
ends the iteration (finished, the client went away, an error), the engine core forgets
the sequence.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from nanoserve.adapter_root import DISABLED, confined
from nanoserve.v1 import generate_pb2
from scheduler_service import metrics
from scheduler_service.api_keys import OPEN, ApiKey
from scheduler_service.constraints import FormatError, grammar_from_proto
from scheduler_service.detokenizer import IncrementalDetokenizer
from scheduler_service.engine_client import EngineClient, EngineUnavailable
from scheduler_service.sequence import SamplingOptions
from scheduler_service.tokenizer import Tokenizer
from scheduler_service.turn_budget import TurnBudget

log = logging.getLogger("nanoserve.frontend")


class RequestError(Exception):
    """A request that cannot be served; `code` is a grpc.StatusCode name; `retry_after`:
    seconds after which it may be served (a key over its quota: Retry-After)."""

    def __init__(self, code: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


_RETRY = re.compile(r"\(retry after (\d+) s\)$")


def core_error(code: str, message: str) -> RequestError:
    """An error the engine core sent; a quota's carries its retry time in the message."""
    m = _RETRY.search(message) if code == "RESOURCE_EXHAUSTED" else None
    return RequestError(code, message, int(m.group(1)) if m else None)


MAX_N = 16               # completions per request
MAX_TOP_LOGPROBS = 20    # alternatives per token
MAX_LOGIT_BIAS = 1024    # ids a request may bias


def invalid(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)


@dataclass
class Limits:
    max_model_len: int
    vocab_size: int
    max_kv_tokens: int           # a prompt must fit the whole KV cache
    default_max_tokens: int = 256
    structured_output: bool = True   # the workers follow grammars
    max_stop_strings: int = 16


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int            # prompt tokens served from the prefix cache
    accepted_prediction_tokens: int = 0   # of the request's prediction, proposed tokens the
    rejected_prediction_tokens: int = 0   # model confirmed / did not (speculation.py)
    host_cached_tokens: int = 0   # of cached_tokens, those copied back from the host tier
    queue_ms: float = 0.0         # arrival at the engine core -> first scheduled (longest of n)


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None   # "stop" | "length" on a completion's last delta
    usage: Usage | None = None         # on the request's last delta (sums over completions)
    index: int = 0                     # which of the request's n completions
    # One (ids, logprobs) per token when top_logprobs was asked for, most likely first.
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)


def check_sampling(opts: SamplingOptions, max_tokens: int | None, prompt_len: int,
                   limits: Limits, stop: list[str]) -> SamplingOptions:
    """Validate (INVALID_ARGUMENT) and complete opts: max_tokens defaults to the server's
    default and is capped by the context left after the prompt."""
    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise invalid(msg)

    check(math.isfinite(opts.temperature) and opts.temperature >= 0,
          f"temperature must be >= 0, got {opts.temperature}")
    check(math.isfinite(opts.top_p) and 0 < opts.top_p <= 1, f"top_p must be in (0, 1], got {opts.top_p}")
    check(opts.top_k >= 0, f"top_k must be >= 0, got {opts.top_k}")
    check(math.isfinite(opts.min_p) and 0 <= opts.min_p <= 1, f"min_p must be in [0, 1], got {opts.min_p}")
    check(1 <= opts.n <= MAX_N, f"n must be in [1, {MAX_N}], got {opts.n}")
    check(math.isfinite(opts.repetition_penalty) and opts.repetition_penalty > 0,
          f"repetition_penalty must be > 0, got {opts.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(opts, name)
        check(math.isfinite(v) and -2 <= v <= 2, f"{name} must be in [-2, 2], got {v}")
    check(0 <= opts.top_logprobs <= MAX_TOP_LOGPROBS,
          f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {opts.top_logprobs}")
    check(not opts.top_logprobs or opts.logprobs, "top_logprobs needs logprobs = true")
    if max_tokens is not None:
        check(max_tokens >= 1, "max_tokens must be >= 1")
    wanted = limits.default_max_tokens if max_tokens is None else max_tokens
    check(opts.min_tokens <= wanted,
          f"min_tokens ({opts.min_tokens}) must be <= max_tokens ({wanted})")
    check(not (opts.min_tokens and opts.grammar),
          "min_tokens cannot be combined with an output format (its end ends the output)")
    room = limits.max_model_len - prompt_len
    opts.max_tokens = min(wanted, room)
    check(len(stop) <= limits.max_stop_strings, f"at most {limits.max_stop_strings} stop strings")
    check(all(stop), "stop strings must not be empty")
    check(all(0 <= t < limits.vocab_size for t in opts.stop_token_ids),
          f"stop_token_ids must be < vocab size {limits.vocab_size}")
    check(len(opts.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias: at most {MAX_LOGIT_BIAS} ids")
    for t, bias in opts.logit_bias:
        check(0 <= t < limits.vocab_size, f"logit_bias: token id {t} out of vocabulary "
                                          f"(size {limits.vocab_size})")
        check(math.isfinite(bias) and -100 <= bias <= 100,
              f"logit_bias: the bias of token {t} must be in [-100, 100], got {bias}")
    return opts


def sampling_from_proto(p: generate_pb2.SamplingParams, prompt_len: int, limits: Limits,
                        encode: Callable[[str], list[int]] | None = None) -> SamplingOptions:
    """The public sampling params, defaulted (see generate.proto) and checked: the gRPC API
    and the HTTP API (which builds a SamplingParams from its JSON) both go through here.
    encode: the tokenizer, for a prediction given as text."""
    opts = SamplingOptions(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else 0,
        min_p=p.min_p if p.HasField("min_p") else 0.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=p.logprobs,
        n=p.n if p.HasField("n") else 1,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        presence_penalty=p.presence_penalty if p.HasField("presence_penalty") else 0.0,
        frequency_penalty=p.frequency_penalty if p.HasField("frequency_penalty") else 0.0,
        top_logprobs=p.top_logprobs if p.HasField("top_logprobs") else 0,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        min_tokens=p.min_tokens if p.HasField("min_tokens") else 0,
        prediction=prediction_from_proto(p.prediction, limits, encode),
        speculate=p.speculative if p.HasField("speculative") else True)
    if p.HasField("structured") and p.structured.WhichOneof("format") is not None:
        if not limits.structured_output:
            raise RequestError("FAILED_PRECONDITION", "this server's workers cannot constrain "
                               "output: the model directory has no tokenizer.json that "
                               "llguidance reads (see the worker's log)")
        try:
            opts.grammar = grammar_from_proto(p.structured)
        except FormatError as e:
            raise invalid(str(e)) from None
    return check_sampling(opts, p.max_tokens if p.HasField("max_tokens") else None, prompt_len,
                          limits, list(p.stop))


def adapter_id(name: str, adapters: dict[str, int]) -> int:
    """The engine core's id of a LoRA adapter by name ("": the base model), NOT_FOUND if
    none is served by that name (adapters: EngineClient.adapters)."""
    if not name:
        return 0
    if name not in adapters:
        served = ", ".join(adapters) or "none"
        raise RequestError("NOT_FOUND", f"unknown LoRA adapter `{name}` (served: {served})")
    return adapters[name]


def prediction_from_proto(p: generate_pb2.Prediction, limits: Limits,
                          encode: Callable[[str], list[int]] | None) -> tuple[int, ...]:
    """A request's prediction as token ids, checked (INVALID_ARGUMENT)."""
    which = p.WhichOneof("content")
    if which is None:
        return ()
    if which == "text":
        if encode is None:
            raise invalid("prediction text cannot be tokenized here: send token ids")
        ids = encode(p.text) if p.text else []
    else:
        ids = list(p.token_ids.ids)
        if any(t >= limits.vocab_size for t in ids):
            raise invalid(f"prediction: token id out of vocabulary (size {limits.vocab_size})")
    if len(ids) > limits.max_model_len:
        raise invalid(f"prediction has {len(ids)} tokens; the limit is the context length "
                      f"{limits.max_model_len}")
    return tuple(ids)


_last_refusal: dict[str, float] = {}


def _refused(tenant: str, why: str) -> None:
    """Log a refusal with the key's name, at most once per key per 10 s (a client that
    ignores Retry-After would fill the log)."""
    now = time.monotonic()
    if now - _last_refusal.get(tenant, -1e9) >= 10.0:
        _last_refusal[tenant] = now
        log.warning("key %s: refused: %s", tenant or "-", why)


class Generation:
    """The request path shared by every protocol a frontend serves."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, limits: Limits,
                 deltas_per_turn: int = 0, adapter_root: str | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        # --adapter-root: where the workers may read LoRA adapters loaded at run time
        # (None: loading and unloading at run time are off)
        self.adapter_root = adapter_root
        self.turns = TurnBudget(deltas_per_turn)   # turn_budget.py: why; 0 = no limit
        self.accepting = True
        # Generations being served: shutdown waits for these, not for long-lived
        # streams such as health watches (which never end by themselves).
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        # End-of-sequence ids beyond the model's own (generation_config may list several).
        self.extra_eos_ids = frozenset(t for t in tokenizer.eos_token_ids
                                       if t < limits.vocab_size) - {engine.info["eos_token_id"]}
        # What the deployment serves (--task): an embed or score one does not generate.
        self.tasks = tuple((engine.info.get("task") or "generate").split(","))

    # ---- LoRA adapters at run time ----------------------------------------------------

    async def change_adapter(self, model_name: str, op: str, name: str, path: str = "",
                             key: ApiKey = OPEN) -> None:
        """Load ("load", from `path`) or unload a LoRA adapter, for every API. Off without
        an adapter root (PERMISSION_DENIED); a load's path goes to the workers in the
        confined form (nanoserve/adapter_root.py), so they read nothing outside the root.
        With --api-keys, only keys with load_adapters may. RequestError says why not."""
        if self.adapter_root is None:
            raise RequestError(*DISABLED)
        if key is not OPEN and not key.load_adapters:
            log.warning("key %s: adapter %s refused (no load_adapters)", key.name, op)
            raise RequestError("PERMISSION_DENIED", f"API key `{key.name}` may not load or "
                               "unload LoRA adapters (load_adapters in --api-keys)")
        if not name or len(name) > 256:
            raise invalid("an adapter name of 1-256 characters is needed")
        if name == model_name:
            raise RequestError("ALREADY_EXISTS", f"`{name}` is the base model's name")
        wire = ""
        if op == "load":
            if not path:
                raise invalid("a path is needed: the adapter's directory, relative to the "
                              "adapter root")
            try:
                wire = confined(self.adapter_root, path)
            except ValueError as e:
                raise invalid(str(e)) from None
        try:
            error = await self.engine.change_adapter(op, name, wire)
        except EngineUnavailable as e:
            raise RequestError("UNAVAILABLE", str(e)) from None
        if error:
            raise RequestError(*error)
        log.info("key %s: LoRA adapter %s %sed", key.name or "-", name, op)

    # ---- callers ----------------------------------------------------------------------

    @staticmethod
    def apply_key(key: ApiKey, opts: SamplingOptions, priority: int | None) -> None:
        """What the caller's key says about its request: its name (quotas, fair shares,
        metrics), its default priority, and the highest priority it may ask for."""
        opts.tenant = key.name
        opts.priority = key.default_priority if priority is None else priority
        why = key.check_priority(opts.priority)
        if why is not None:
            _refused(key.name, why)
            raise RequestError("PERMISSION_DENIED", why)

    # ---- prompts ----------------------------------------------------------------------

    def encode_output(self, text: str) -> list[int]:
        """Text as the model would write it (no bos/eos added): a prediction's tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_from_text(self, text: str) -> list[int]:
        return self._checked(self.tokenizer.encode(text) if text else [])

    def prompt_from_ids(self, ids: list[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise invalid(f"token id {bad[0]} out of vocabulary (size {self.limits.vocab_size})")
        return self._checked(list(ids))

    def prompt_from_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """template_kwargs: what the chat template reads besides messages (tools,
        enable_thinking, ...)."""
        if not messages:
            raise invalid("chat has no messages")
        try:
            ids = self.tokenizer.encode_chat(messages, **template_kwargs)
        except Exception as e:  # template errors are the caller's input
            raise invalid(f"chat template failed: {e}") from e
        return self._checked(ids)

    def _checked(self, ids: list[int]) -> list[int]:
        if not ids:
            raise invalid("empty prompt")
        limit = min(self.limits.max_model_len - 1, self.limits.max_kv_tokens)
        if len(ids) > limit:
            raise invalid(f"prompt has {len(ids)} tokens; the limit is {limit} "
                          f"(context length {self.limits.max_model_len})")
        return ids

    # ---- the stream -------------------------------------------------------------------

    async def stream(self, ids: list[int], sampling: SamplingOptions, stop: list[str] = (),
                     skip_special_tokens: bool = False) -> AsyncIterator[Delta]:
        """Submit and yield deltas until every completion ends (RequestError on failure).

        With sampling.n > 1 the completions' deltas interleave as they arrive, each tagged
        with its index and detokenized on its own; a completion's last delta has its
        finish_reason, the request's last delta also the usage summed over all of them."""
        start = time.monotonic()
        who = metrics.caller(sampling.tenant, sampling.priority)
        if "generate" not in self.tasks:
            metrics.request_ended("error", "INVALID_ARGUMENT")
            served = ",".join(self.tasks)
            raise invalid(f"this deployment serves {served} (--task {served}), not generate: "
                          "completions and chat need a server started with --task generate")
        if not self.accepting:
            metrics.request_ended("error", "UNAVAILABLE")
            raise RequestError("UNAVAILABLE", "server is shutting down")
        if not sampling.ignore_eos and self.extra_eos_ids:   # e.g. Qwen3's <|endoftext|> too
            sampling.stop_token_ids = tuple(set(sampling.stop_token_ids) | self.extra_eos_ids)
        self.turns.arrived()
        try:
            handles = self.engine.submit(ids, sampling)
        except EngineUnavailable as e:
            metrics.request_ended("error", "UNAVAILABLE")
            raise RequestError("UNAVAILABLE", str(e)) from None
        n = len(handles)
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_ids=ids,
                                         skip_special_tokens=skip_special_tokens, stop=list(stop))
                  for _ in range(n)]
        self.in_flight += 1
        self.idle.clear()
        released = [False] * n    # the handle is given back (the core forgot it or was told to)
        waits: dict[asyncio.Future, int] = {}   # n > 1: each live completion's next()
        left = n
        completion = cached = accepted = rejected = host_cached = 0
        queue_ms = 0.0
        first = 0.0
        outcome = ("abort", "CANCELLED")   # unless it finishes or fails: the client left
        try:
            while left:
                if n == 1:
                    i, got = 0, await handles[0].next(self.turns)
                else:
                    i, got = await self._next_of(handles, released, waits, self.turns)
                token_ids, logprobs, top, finish, error = got
                if error is not None:
                    released[i] = True   # the core has forgotten it already
                    self.engine.release(handles[i], abort=False)
                    outcome = ("error", error[0])
                    if error[0] == "RESOURCE_EXHAUSTED":
                        _refused(sampling.tenant, error[1])
                    raise core_error(*error)
                if not first and token_ids:
                    first = time.monotonic()
                    metrics.TTFT.observe(first - start)
                    metrics.CALLER_TTFT.labels(*who).observe(first - start)
                completion += len(token_ids)
                detok = detoks[i]
                text = detok.add(token_ids)
                reason = finish[0] if finish is not None else None
                if detok.stopped and reason is None:
                    reason = "stop"
                if reason is None:
                    yield Delta(token_ids, text, logprobs, index=i, top_logprobs=top)
                    continue
                released[i] = True
                self.engine.release(handles[i], abort=finish is None)
                left -= 1
                if finish:
                    cached += finish[1]
                    accepted += finish[2]
                    rejected += finish[3]
                    host_cached += finish[4]
                    queue_ms = max(queue_ms, finish[5])
                usage = None if left else Usage(len(ids), completion, cached, accepted, rejected,
                                                host_cached, queue_ms)
                if usage is not None:
                    outcome = (reason, "OK")
                    self._finished(start, first, usage, who)
                yield Delta(token_ids, text + detok.finish(), logprobs, reason, usage,
                            index=i, top_logprobs=top)
        finally:
            metrics.request_ended(*outcome)
            metrics.CALLER_REQUESTS.labels(*who, *outcome).inc()
            for fut in waits:
                fut.cancel()
            for handle, done in zip(handles, released):
                if not done:
                    self.engine.release(handle, abort=True)
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()

    @staticmethod
    async def _next_of(handles: list, released: list[bool], waits: dict[asyncio.Future, int],
                       turns: TurnBudget):
        """(index, next() result) of whichever live completion has something first."""
        live = set(waits.values())
        for i, h in enumerate(handles):
            if not released[i] and i not in live:
                waits[asyncio.ensure_future(h.next(turns))] = i
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        fut = min(done, key=waits.get)   # lowest index first when several are ready
        return waits.pop(fut), fut.result()

    @staticmethod
    def _finished(start: float, first: float, usage: Usage, who: tuple[str, str]) -> None:
        """Per-request metrics of a request that ran to its end (a few observes, once)."""
        end = time.monotonic()
        metrics.E2E.observe(end - start)
        if usage.completion_tokens > 1:
            metrics.ITL.observe((end - first) / (usage.completion_tokens - 1))
        metrics.PROMPT_TOKENS.inc(usage.prompt_tokens)
        metrics.GENERATION_TOKENS.inc(usage.completion_tokens)
        metrics.PREFIX_HIT_TOKENS.inc(usage.cached_tokens)
        metrics.CALLER_QUEUE_TIME.labels(*who).observe(usage.queue_ms / 1e3)
        metrics.CALLER_TOKENS.labels(*who, "prompt").inc(usage.prompt_tokens)
        metrics.CALLER_TOKENS.labels(*who, "generation").inc(usage.completion_tokens)
