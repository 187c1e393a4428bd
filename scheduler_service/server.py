"""Public gRPC API (protos/nanoserve/v1/generate.proto) on an asyncio server.

Handlers validate and tokenize, hand a Sequence to the engine thread, then await the
per-step updates the engine posts to this event loop, detokenizing incrementally here
(off the engine's critical path). A handler that ends for any reason (finished,
cancelled, deadline, error) makes sure the engine forgets its sequence.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import threading
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.detokenizer import IncrementalDetokenizer
from scheduler_service.engine import Engine, EngineStats, SeqUpdate
from scheduler_service.sequence import SamplingOptions, Sequence
from scheduler_service.tokenizer import Tokenizer

log = logging.getLogger("nanoserve.scheduler")

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}


@dataclass
class Limits:
    max_model_len: int
    vocab_size: int
    max_kv_tokens: int           # a prompt must fit the whole KV cache
    max_waiting: int = 1024      # queued + running requests before RESOURCE_EXHAUSTED
    default_max_tokens: int = 256
    max_stop_strings: int = 16


class InvalidRequest(ValueError):
    pass


def sampling_from_proto(p: generate_pb2.SamplingParams, prompt_len: int, limits: Limits) -> SamplingOptions:
    """Validate and default the public sampling params (INVALID_ARGUMENT on bad values)."""
    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise InvalidRequest(msg)

    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.HasField("top_p") else 1.0
    top_k = p.top_k if p.HasField("top_k") else 0
    min_p = p.min_p if p.HasField("min_p") else 0.0
    check(math.isfinite(temperature) and temperature >= 0, f"temperature must be >= 0, got {temperature}")
    check(math.isfinite(top_p) and 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}")
    check(top_k >= 0, f"top_k must be >= 0, got {top_k}")
    check(math.isfinite(min_p) and 0 <= min_p <= 1, f"min_p must be in [0, 1], got {min_p}")
    room = limits.max_model_len - prompt_len
    if p.HasField("max_tokens"):
        check(p.max_tokens >= 1, "max_tokens must be >= 1")
        max_tokens = min(p.max_tokens, room)
    else:
        max_tokens = min(limits.default_max_tokens, room)
    check(len(p.stop) <= limits.max_stop_strings, f"at most {limits.max_stop_strings} stop strings")
    check(all(p.stop), "stop strings must not be empty")
    check(all(t < limits.vocab_size for t in p.stop_token_ids),
          f"stop_token_ids must be < vocab size {limits.vocab_size}")
    return SamplingOptions(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                           seed=p.seed if p.HasField("seed") else None, max_tokens=max_tokens,
                           stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
                           logprobs=p.logprobs)


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine | None, tokenizer: Tokenizer, limits: Limits, model_name: str,
                 engine_eos_id: int | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_name = model_name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queues: dict[int, asyncio.Queue[SeqUpdate]] = {}
        self.seq_ids = itertools.count(1)
        self._posted: list[SeqUpdate] = []
        self._posted_lock = threading.Lock()
        self._dispatch_pending = False
        self.accepting = True
        # Generate/Complete calls being served: shutdown waits for these, not for
        # long-lived streams such as health Watch (which never end by themselves).
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        # End-of-sequence ids beyond the model's own (generation_config may list several).
        self.extra_eos_ids = frozenset(
            t for t in tokenizer.eos_token_ids if t < limits.vocab_size) - {engine_eos_id}

    # The engine thread calls this once per step. While a dispatch is still waiting for
    # the event loop, later steps join it: a busy loop wakes once for several steps, and
    # each stream then sends their tokens in one message.
    def post_updates(self, updates: list[SeqUpdate]) -> None:
        if self.loop is None:
            return
        with self._posted_lock:
            self._posted.extend(updates)
            if self._dispatch_pending:
                return
            self._dispatch_pending = True
        self.loop.call_soon_threadsafe(self._dispatch)

    def _dispatch(self) -> None:
        with self._posted_lock:
            updates, self._posted = self._posted, []
            self._dispatch_pending = False
        for u in updates:
            q = self.queues.get(u.seq_id)
            if q is not None:
                q.put_nowait(u)

    # ---- request preparation --------------------------------------------------------

    def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "text":
            ids = self.tokenizer.encode(request.text) if request.text else []
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            bad = [t for t in ids if t >= self.limits.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} out of vocabulary (size {self.limits.vocab_size})")
        elif kind == "chat":
            if not request.chat.messages:
                raise InvalidRequest("chat has no messages")
            msgs = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            try:
                ids = self.tokenizer.encode_chat(msgs)
            except Exception as e:  # template errors are the caller's input
                raise InvalidRequest(f"chat template failed: {e}") from e
        else:
            raise InvalidRequest("no input: set text, token_ids or chat")
        if not ids:
            raise InvalidRequest("empty prompt")
        limit = min(self.limits.max_model_len - 1, self.limits.max_kv_tokens)
        if len(ids) > limit:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the limit is {limit} "
                                 f"(context length {self.limits.max_model_len})")
        return ids

    async def _start(self, request, context) -> tuple[Sequence, asyncio.Queue, IncrementalDetokenizer, str]:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if self.engine.num_pending() >= self.limits.max_waiting:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many requests in flight (limit {self.limits.max_waiting})")
        try:
            ids = self._prompt_ids(request)
            sampling = sampling_from_proto(request.sampling, len(ids), self.limits)
            if not sampling.ignore_eos and self.extra_eos_ids:   # e.g. Qwen3's <|endoftext|> too
                sampling.stop_token_ids = tuple(set(sampling.stop_token_ids) | self.extra_eos_ids)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        seq = Sequence(seq_id=next(self.seq_ids), token_ids=ids, sampling=sampling)
        queue: asyncio.Queue[SeqUpdate] = asyncio.Queue()
        self.queues[seq.seq_id] = queue
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids,
                                       skip_special_tokens=request.skip_special_tokens,
                                       stop=list(request.sampling.stop))
        self.engine.submit(seq)
        self.in_flight += 1
        self.idle.clear()
        return seq, queue, detok, request.request_id or uuid.uuid4().hex

    async def _stream(self, request, context):
        """Yields (token_ids, text, logprobs, finish_reason, usage or None) deltas."""
        seq, queue, detok, request_id = await self._start(request, context)
        finished = False
        completion = 0
        try:
            while True:
                u = await queue.get()
                while not queue.empty():   # behind by several steps: one message for all
                    u = u.merged(queue.get_nowait())
                if u.error:
                    finished = True
                    await context.abort(grpc.StatusCode.INTERNAL, u.error)
                completion += len(u.token_ids)
                text = detok.add(u.token_ids)
                reason = u.finish_reason
                if detok.stopped and reason is None:
                    reason = "stop"
                if reason is not None:
                    finished = u.finish_reason is not None
                    text += detok.finish()
                    usage = generate_pb2.Usage(prompt_tokens=u.num_prompt_tokens,
                                               completion_tokens=completion,
                                               cached_tokens=u.num_cached_tokens)
                    yield request_id, u.token_ids, text, u.logprobs, _FINISH[reason], usage
                    return
                yield request_id, u.token_ids, text, u.logprobs, None, None
        finally:
            self.queues.pop(seq.seq_id, None)
            if not finished:
                self.engine.abort(seq.seq_id)
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()

    # ---- RPCs -----------------------------------------------------------------------

    async def Generate(self, request, context):
        async for rid, ids, text, logprobs, reason, usage in self._stream(request, context):
            yield generate_pb2.GenerateResponse(request_id=rid, token_ids=ids, text=text,
                                                logprobs=logprobs, finish_reason=reason, usage=usage)

    async def Complete(self, request, context):
        out = generate_pb2.CompleteResponse()
        texts = []
        async for rid, ids, text, logprobs, reason, usage in self._stream(request, context):
            out.request_id = rid
            out.token_ids.extend(ids)
            out.logprobs.extend(logprobs)
            texts.append(text)
            if reason is not None:
                out.finish_reason = reason
                out.usage.CopyFrom(usage)
        out.text = "".join(texts)
        return out

    async def Tokenize(self, request, context):
        kind = request.WhichOneof("input")
        if kind == "chat":
            msgs = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            try:
                return generate_pb2.TokenizeResponse(token_ids=self.tokenizer.encode_chat(msgs))
            except Exception as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"chat template failed: {e}")
        text = request.text
        return generate_pb2.TokenizeResponse(token_ids=self.tokenizer.encode(text) if text else [])

    async def GetModelInfo(self, request, context):
        info = self.engine.info
        return generate_pb2.ModelInfo(
            model=self.model_name, vocab_size=self.limits.vocab_size,
            max_model_len=self.limits.max_model_len, eos_token_id=info.eos_token_id,
            tensor_parallel_size=info.world_size, block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks)

    async def GetStats(self, request, context):
        sched = self.engine.scheduler
        return generate_pb2.Stats(
            num_waiting=len(sched.waiting), num_running=len(sched.running),
            num_kv_blocks=sched.block_manager.num_blocks,
            num_free_kv_blocks=sched.block_manager.num_free_blocks,
            num_steps=self.engine.stats.num_steps,
            num_generated_tokens=self.engine.stats.num_generated_tokens,
            num_preemptions=sched.num_preemptions, workers_healthy=self.engine.healthy,
            **{f.name: getattr(self.engine.stats, f.name) for f in dataclasses.fields(EngineStats)
               if f.name.startswith(("decode_", "num_decode_"))})


async def build_server(service: GenerationService, host: str, port: int,
                       max_message_bytes: int) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes)])
    generate_pb2_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    service.loop = asyncio.get_running_loop()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer
