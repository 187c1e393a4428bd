"""A frontend process: the public gRPC API (protos/nanoserve/v1/generate.proto) on asyncio.

Handlers turn protobuf into prompt ids and sampling options and iterate the shared
request path (generation.py: submit to the engine core, detokenize, stop strings) in a
process of its own, so none of this competes with the engine loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from array import array
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nanoserve.security import OPEN_PUBLIC, AsyncGuard, add_port, server_credentials
from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service import metrics
from scheduler_service.api_keys import OPEN, ApiKey, KeyRing
from scheduler_service.engine_client import EngineClient, EngineUnavailable
from scheduler_service.generation import (Generation, Limits, RequestError, Usage, adapter_id,
                                          invalid, sampling_from_proto)
from scheduler_service.pooling import EMBED, SCORE, Pooling
from scheduler_service.tokenizer import Tokenizer

log = logging.getLogger("nanoserve.frontend")

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}


class GenerationService(generate_pb2_grpc.GenerationServicer):
    """nanoserve.v1.Generation over gRPC: a thin adapter on `Generation`."""

    def __init__(self, gen: Generation, model_name: str, keys: KeyRing | None = None,
                 pooling: Pooling | None = None):
        self.gen = gen
        self.model_name = model_name
        self.keys = keys or KeyRing()
        self.pooling = pooling or Pooling(gen, gen.tasks, gen.engine.info.get("hidden_size", 0))

    def _key(self, context) -> ApiKey:
        """The caller's key (the interceptor let only known keys in)."""
        return self.keys.from_metadata(context.invocation_metadata()) or OPEN

    def _prompt(self, request) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "text":
            return self.gen.prompt_from_text(request.text)
        if kind == "token_ids":
            return self.gen.prompt_from_ids(request.token_ids.ids)
        if kind == "chat":
            return self.gen.prompt_from_chat([{"role": m.role, "content": m.content}
                                              for m in request.chat.messages])
        raise invalid("no input: set text, token_ids or chat")

    async def _deltas(self, request, context):
        try:
            try:
                ids = self._prompt(request)
                sampling = sampling_from_proto(request.sampling, len(ids), self.gen.limits,
                                               self.gen.encode_output)
                sampling.adapter_id = adapter_id(request.adapter, self.gen.engine.adapters)
                self.gen.apply_key(self._key(context), sampling, request.priority
                                   if request.HasField("priority") else None)
                remaining = context.time_remaining()
                if remaining is not None:   # the caller's deadline, on the engine core's clock
                    sampling.deadline = time.monotonic() + remaining
            except RequestError as e:   # never reached the stream: count it here
                metrics.request_ended("error", e.code)
                raise
            async for delta in self.gen.stream(ids, sampling, list(request.sampling.stop),
                                               request.skip_special_tokens):
                yield delta
        except RequestError as e:
            await _abort(context, e)

    async def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        async for d in self._deltas(request, context):
            yield generate_pb2.GenerateResponse(
                request_id=rid, token_ids=d.token_ids, text=d.text, logprobs=d.logprobs,
                finish_reason=_FINISH.get(d.finish_reason), usage=_usage(d.usage),
                index=d.index, top_logprobs=_top(d.top_logprobs))

    async def Complete(self, request, context):
        """Every completion in `choices` (index order); choice 0 also in the top level."""
        out = generate_pb2.CompleteResponse(request_id=request.request_id or uuid.uuid4().hex)
        choices: dict[int, generate_pb2.Choice] = {}
        texts: dict[int, list[str]] = {}
        async for d in self._deltas(request, context):
            c = choices.get(d.index)
            if c is None:
                c = choices[d.index] = generate_pb2.Choice(index=d.index)
                texts[d.index] = []
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(d.logprobs)
            c.top_logprobs.extend(_top(d.top_logprobs))
            texts[d.index].append(d.text)
            if d.finish_reason is not None:
                c.finish_reason = _FINISH[d.finish_reason]
            if d.usage is not None:
                out.usage.CopyFrom(_usage(d.usage))
        for i in sorted(choices):
            choices[i].text = "".join(texts[i])
            out.choices.append(choices[i])
        first = choices.get(0)
        if first is not None:
            out.token_ids.extend(first.token_ids)
            out.logprobs.extend(first.logprobs)
            out.top_logprobs.extend(first.top_logprobs)
            out.text = first.text
            out.finish_reason = first.finish_reason
        return out

    async def Embed(self, request, context):
        p = self.pooling
        try:
            p.require("embed")
            prompts = [_embed_input(p, i, request.truncate) for i in request.inputs]
            opts = p.options(EMBED, self._key(context), _priority(request), request.dimensions,
                             _deadline(context))
            out = await p.run(prompts, opts)
        except RequestError as e:
            await _abort(context, e)
        return generate_pb2.EmbedResponse(
            request_id=request.request_id or uuid.uuid4().hex, usage=_pool_usage(out),
            embeddings=[generate_pb2.Embedding(index=i, values=_floats(v))
                        for i, v in enumerate(out.values)])

    async def Score(self, request, context):
        p = self.pooling
        try:
            p.require("score")
            prompts = [p.score_prompt(request.query, d, request.instruction, request.truncate)
                       for d in request.documents]
            opts = p.options(SCORE, self._key(context), _priority(request),
                             deadline=_deadline(context))
            out = await p.run(prompts, opts)
        except RequestError as e:
            await _abort(context, e)
        return generate_pb2.ScoreResponse(
            request_id=request.request_id or uuid.uuid4().hex, usage=_pool_usage(out),
            scores=[_floats(v)[0] for v in out.values])

    async def Tokenize(self, request, context):
        try:
            if request.WhichOneof("input") == "chat":
                ids = self.gen.prompt_from_chat([{"role": m.role, "content": m.content}
                                                 for m in request.chat.messages])
            else:
                ids = self.gen.tokenizer.encode(request.text) if request.text else []
        except RequestError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)
        return generate_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context):
        info, limits = self.gen.engine.info, self.gen.limits
        return generate_pb2.ModelInfo(
            model=self.model_name, vocab_size=limits.vocab_size,
            max_model_len=limits.max_model_len, eos_token_id=info["eos_token_id"],
            tensor_parallel_size=info["world_size"], block_size=info["block_size"],
            num_kv_blocks=info["num_kv_blocks"], adapters=list(self.gen.engine.adapters),
            task=",".join(self.gen.tasks), hidden_size=info.get("hidden_size", 0),
            deterministic=bool(info.get("deterministic")))

    async def LoadAdapter(self, request, context):
        return await self._change_adapter(context, "load", request.name, request.path)

    async def UnloadAdapter(self, request, context):
        return await self._change_adapter(context, "unload", request.name)

    async def _change_adapter(self, context, op: str, name: str, path: str = ""):
        try:
            await self.gen.change_adapter(self.model_name, op, name, path, self._key(context))
        except RequestError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)
        return generate_pb2.AdaptersResponse(adapters=list(self.gen.engine.adapters))

    async def GetStats(self, request, context):
        try:
            stats = await self.gen.engine.stats()
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return generate_pb2.Stats(**{k: v for k, v in stats.items() if k in _STATS_FIELDS})


async def _abort(context, e: RequestError) -> None:
    if e.retry_after is not None:
        context.set_trailing_metadata((("retry-after", str(e.retry_after)),))
    await context.abort(getattr(grpc.StatusCode, e.code), e.message)


def _embed_input(p: Pooling, i: generate_pb2.EmbedInput, truncate: bool) -> list[int]:
    if i.WhichOneof("input") == "token_ids":
        return p.embed_prompt(ids=list(i.token_ids.ids), truncate=truncate)
    return p.embed_prompt(text=i.text, truncate=truncate)


def _priority(request) -> int | None:
    return request.priority if request.HasField("priority") else None


def _deadline(context) -> float:
    """The caller's deadline on the engine core's clock (0: none)."""
    remaining = context.time_remaining()
    return 0.0 if remaining is None else time.monotonic() + remaining


def _floats(values: bytes) -> list[float]:
    return array("f", values).tolist()


def _pool_usage(out) -> generate_pb2.Usage:
    return generate_pb2.Usage(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)


def _top(top: list[tuple[list[int], list[float]]]) -> list[generate_pb2.TopLogprobs]:
    return [generate_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in top]


def _usage(u: Usage | None) -> generate_pb2.Usage | None:
    return None if u is None else generate_pb2.Usage(
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens, accepted_prediction_tokens=u.accepted_prediction_tokens,
        rejected_prediction_tokens=u.rejected_prediction_tokens,
        host_cached_tokens=u.host_cached_tokens, queue_ms=u.queue_ms)


_STATS_FIELDS = frozenset(f.name for f in generate_pb2.Stats.DESCRIPTOR.fields)


async def build_server(service: GenerationService, host: str, port: int, max_message_bytes: int,
                       reuse_port: bool = False, api_key: str | None = None,
                       credentials: grpc.ServerCredentials | None = None
                       ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """The public server, serving; reuse_port lets several frontends share one port.
    api_key: calls other than health and reflection need it (`authorization: Bearer`), or
    one of the service's keys (--api-keys) when it has any;
    credentials: TLS (nanoserve.security.server_credentials), None = plaintext."""
    keys = service.keys
    check = (lambda metadata: keys.from_metadata(metadata) is not None) if keys.enabled else None
    server = grpc.aio.server(interceptors=[AsyncGuard(api_key, OPEN_PUBLIC, check)], options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", int(reuse_port))])
    generate_pb2_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    bound = add_port(server, f"{host}:{port}", credentials)
    await server.start()
    await set_serving(health_servicer, service.gen.engine.serving)
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
    http_port: int | None = None  # the OpenAI-compatible HTTP API (openai_api.py); None = off
    served_model_name: str = ""   # the model id both APIs report ("" = model directory name)
    api_key: str | None = None    # required on every call but health/reflection (both APIs)
    http_request_timeout: float = 0.0
    tls_cert: str | None = None       # PEM paths: TLS on the public port when set
    tls_key: str | None = None
    tls_client_ca: str | None = None  # require client certs signed by this CA
    deltas_per_turn: int = 8      # stream deltas per event-loop turn (turn_budget.py); 0 = any
    adapter_root: str | None = None   # LoRA adapters at run time from here (None: off)
    api_keys: str | None = None       # --api-keys FILE (api_keys.py), re-read on SIGHUP
    score_tokens: tuple[str, str] = ("yes", "no")   # --score-tokens (pooling.py)


async def serve(cfg: FrontendConfig, ready) -> None:
    """Connect to the engine core, serve until SIGTERM/SIGINT, then drain: no new
    requests, in-flight ones get `shutdown_grace` seconds to finish."""
    keys = KeyRing(cfg.api_keys, cfg.api_key)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, keys.reload)   # streams in flight keep running
    tokenizer = Tokenizer.from_dir(cfg.model)
    health_servicer = None

    def on_state(serving: bool) -> None:   # mirror the engine core in grpc.health.v1
        if health_servicer is not None and gen.accepting:
            loop.create_task(set_serving(health_servicer, serving))

    engine = EngineClient(cfg.ipc_dir, cfg.index, on_state=on_state)
    info = await engine.start()
    limits = Limits(max_model_len=info["max_model_len"], vocab_size=info["vocab_size"],
                    max_kv_tokens=info["num_kv_blocks"] * info["block_size"],
                    default_max_tokens=cfg.default_max_tokens,
                    structured_output=bool(info.get("structured_output")))
    gen = Generation(engine, tokenizer, limits, cfg.deltas_per_turn, cfg.adapter_root)
    name = cfg.served_model_name or os.path.basename(os.path.normpath(info["model"] or cfg.model))
    pooling = Pooling(gen, gen.tasks, info.get("hidden_size", 0), cfg.score_tokens)
    service = GenerationService(gen, name, keys, pooling)
    server, port, health_servicer = await build_server(
        service, cfg.host, cfg.port, cfg.max_message_mb << 20, cfg.reuse_port, cfg.api_key,
        server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca))
    http_runner, http_port = None, None
    if cfg.http_port is not None:
        from scheduler_service import openai_api, openai_pooling
        http_runner, http_port = await openai_api.start(
            gen, openai_api.HttpConfig(name, cfg.api_key, cfg.http_request_timeout, keys),
            cfg.host, cfg.http_port, cfg.reuse_port, openai_pooling.routes(pooling))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready.send(("ready", (port, http_port)))
    await stop.wait()
    log.info("shutting down: no new requests, %.0fs for in-flight ones", cfg.shutdown_grace)
    gen.accepting = False
    await health_servicer.enter_graceful_shutdown()
    try:   # in-flight generations finish; health watches and the like do not hold us up
        await asyncio.wait_for(gen.idle.wait(), timeout=cfg.shutdown_grace)
    except asyncio.TimeoutError:
        log.warning("%d requests still running after %.0fs: cancelling them",
                    gen.in_flight, cfg.shutdown_grace)
    await server.stop(0)
    if http_runner is not None:
        await http_runner.cleanup()
    await engine.close()


def run(cfg: FrontendConfig, ready) -> None:
    """Process entry point (multiprocessing, spawn)."""
    from scheduler_service.supervision import child_setup
    child_setup(cfg.log_level, f"frontend {cfg.index}")
    asyncio.run(serve(cfg, ready))
