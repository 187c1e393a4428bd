"""A frontend process: the public gRPC API (protos/nanoserve/v1/generate.proto) on asyncio.

Handlers validate and tokenize, submit the request to the engine core (engine_client),
then take its tokens as they arrive, detokenizing incrementally here, in a process of
its own, so none of this competes with the engine loop. A handler that ends for any
reason (finished, cancelled, deadline, error) makes sure the core forgets its sequence.
"""
from __future__ import annotations

import asyncio
import logging
import math
import signal
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.detokenizer import IncrementalDetokenizer
from scheduler_service.engine_client import EngineClient, EngineUnavailable
from scheduler_service.sequence import SamplingOptions
from scheduler_service.tokenizer import Tokenizer

log = logging.getLogger("nanoserve.frontend")

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}


@dataclass
class Limits:
    max_model_len: int
    vocab_size: int
    max_kv_tokens: int           # a prompt must fit the whole KV cache
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
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, limits: Limits, model_name: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_name = model_name
        self.accepting = True
        # Generate/Complete calls being served: shutdown waits for these, not for
        # long-lived streams such as health Watch (which never end by themselves).
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        # End-of-sequence ids beyond the model's own (generation_config may list several).
        eos = engine.info["eos_token_id"]
        self.extra_eos_ids = frozenset(
            t for t in tokenizer.eos_token_ids if t < limits.vocab_size) - {eos}

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

    async def _start(self, request, context):
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        try:
            ids = self._prompt_ids(request)
            sampling = sampling_from_proto(request.sampling, len(ids), self.limits)
            if not sampling.ignore_eos and self.extra_eos_ids:   # e.g. Qwen3's <|endoftext|> too
                sampling.stop_token_ids = tuple(set(sampling.stop_token_ids) | self.extra_eos_ids)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            stream = self.engine.submit(ids, sampling)
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids,
                                       skip_special_tokens=request.skip_special_tokens,
                                       stop=list(request.sampling.stop))
        self.in_flight += 1
        self.idle.clear()
        return stream, detok, len(ids), request.request_id or uuid.uuid4().hex

    async def _stream(self, request, context):
        """Yields (request_id, token_ids, text, logprobs, finish_reason, usage or None) deltas."""
        stream, detok, prompt_len, request_id = await self._start(request, context)
        finished = False
        completion = 0
        try:
            while True:
                token_ids, logprobs, finish, error = await stream.next()
                if error is not None:
                    finished = True   # the core has forgotten it already
                    await context.abort(getattr(grpc.StatusCode, error[0]), error[1])
                completion += len(token_ids)
                text = detok.add(token_ids)
                reason = finish[0] if finish is not None else None
                if detok.stopped and reason is None:
                    reason = "stop"
                if reason is not None:
                    finished = finish is not None
                    text += detok.finish()
                    usage = generate_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=completion,
                                               cached_tokens=finish[1] if finish else 0)
                    yield request_id, token_ids, text, logprobs, _FINISH[reason], usage
                    return
                yield request_id, token_ids, text, logprobs, None, None
        finally:
            self.engine.release(stream, abort=not finished)
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
            max_model_len=self.limits.max_model_len, eos_token_id=info["eos_token_id"],
            tensor_parallel_size=info["world_size"], block_size=info["block_size"],
            num_kv_blocks=info["num_kv_blocks"])

    async def GetStats(self, request, context):
        try:
            stats = await self.engine.stats()
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return generate_pb2.Stats(**{k: v for k, v in stats.items() if k in _STATS_FIELDS})


_STATS_FIELDS = frozenset(f.name for f in generate_pb2.Stats.DESCRIPTOR.fields)


async def build_server(service: GenerationService, host: str, port: int, max_message_bytes: int,
                       reuse_port: bool = False
                       ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """The public server, serving; reuse_port lets several frontends share one port."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", int(reuse_port))])
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
    await set_serving(health_servicer, service.engine.serving)
    return server, bound, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)


# ---------------------------------------------------------------------------- the process
@dataclass
class FrontendConfig:
    index: int                    # 0..n-1; frontend i's requests carry i in their ids
    model: str                    # model directory: tokenizer and chat template
    ipc_dir: str
    host: str = "127.0.0.1"
    port: int = 50051
    reuse_port: bool = False
    max_message_mb: int = 16
    default_max_tokens: int = 256
    shutdown_grace: float = 10.0
    log_level: str = "INFO"


async def serve(cfg: FrontendConfig, ready) -> None:
    """Connect to the engine core, serve until SIGTERM/SIGINT, then drain: no new
    requests, in-flight ones get `shutdown_grace` seconds to finish."""
    import os
    tokenizer = Tokenizer.from_dir(cfg.model)
    health_servicer = None
    loop = asyncio.get_running_loop()

    def on_state(serving: bool) -> None:   # mirror the engine core in grpc.health.v1
        if health_servicer is not None and service.accepting:
            loop.create_task(set_serving(health_servicer, serving))

    engine = EngineClient(cfg.ipc_dir, cfg.index, on_state=on_state)
    info = await engine.start()
    limits = Limits(max_model_len=info["max_model_len"], vocab_size=info["vocab_size"],
                    max_kv_tokens=info["num_kv_blocks"] * info["block_size"],
                    default_max_tokens=cfg.default_max_tokens)
    service = GenerationService(engine, tokenizer, limits,
                                os.path.basename(os.path.normpath(info["model"] or cfg.model)))
    server, port, health_servicer = await build_server(service, cfg.host, cfg.port,
                                                       cfg.max_message_mb << 20, cfg.reuse_port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready.send(("ready", port))
    await stop.wait()
    log.info("shutting down: no new requests, %.0fs for in-flight ones", cfg.shutdown_grace)
    service.accepting = False
    await health_servicer.enter_graceful_shutdown()
    try:   # in-flight generations finish; health watches and the like do not hold us up
        await asyncio.wait_for(service.idle.wait(), timeout=cfg.shutdown_grace)
    except asyncio.TimeoutError:
        log.warning("%d requests still running after %.0fs: cancelling them",
                    service.in_flight, cfg.shutdown_grace)
    await server.stop(0)
    await engine.close()


def run(cfg: FrontendConfig, ready) -> None:
    """Process entry point (multiprocessing, spawn)."""
    from scheduler_service.supervision import child_setup
    child_setup(cfg.log_level, f"frontend {cfg.index}")
    asyncio.run(serve(cfg, ready))
