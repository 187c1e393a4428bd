"""Python client for the nanoserve public gRPC API (sync `Client`, asyncio `AsyncClient`).

A thin layer over the generated stubs: plain dataclasses in, plain dataclasses out, so
callers never touch protobuf. Both clients share the conversions below; they differ only
in how they wait. gRPC failures surface as `NanoserveError`, which keeps the status code
(INVALID_ARGUMENT vs RESOURCE_EXHAUSTED vs UNAVAILABLE call for different reactions).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Iterator, Sequence, TypeVar, Union

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

import client.resume as resume
import client.routing as routing
from nanoserve.v1 import generate_pb2, generate_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
# Long prompts as token ids and long completions with logprobs can exceed gRPC's 4 MiB
# default; the server enforces its own limit (RESOURCE_EXHAUSTED).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# Several replicas: grpc's round_robin spreads calls (not connections) over every address
# whose grpc.health.v1 status for the Generation service is SERVING, and a call refused
# with UNAVAILABLE before any answer (a replica dying or draining) is retried on another.
# After the first token a call is committed: its failure reaches the caller.
_GENERATION = "nanoserve.v1.Generation"
ROUND_ROBIN_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": _GENERATION},
    "methodConfig": [{"name": [{"service": _GENERATION}], "retryPolicy": {
        "maxAttempts": 4, "initialBackoff": "0.05s", "maxBackoff": "1s",
        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]})
_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")


def channel_target(target: str | Sequence[str]) -> tuple[str, list[tuple[str, Any]]]:
    """The gRPC target and channel options for one address or several.

    One "host:port" (or a gRPC URI such as "dns:///name:port") is used as is. Several
    ("h1:p1,h2:p2" or a list) are resolved once, here, into one ipv4:/ipv6: target with
    the round_robin policy; "dns:///name:port" gets round_robin too, over every address
    the name resolves to (a headless service), re-resolved as it changes."""
    addrs = [target] if isinstance(target, str) else list(target)
    if len(addrs) == 1 and addrs[0].startswith(_SCHEMES):
        uri = addrs[0]
        return uri, [("grpc.service_config", ROUND_ROBIN_CONFIG)] if uri.startswith("dns:") else []
    addrs = [a.strip() for t in addrs for a in t.split(",") if a.strip()]
    if len(addrs) == 1:
        return addrs[0], []
    if not addrs:
        raise ValueError("no address given")
    resolved = [_resolve(a) for a in addrs]
    families = {family for family, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"mixed IPv4 and IPv6 addresses in one target: {addrs}")
    scheme = "ipv4:" if families == {socket.AF_INET} else "ipv6:"
    return scheme + ",".join(a for _, a in resolved), [("grpc.service_config", ROUND_ROBIN_CONFIG)]


def _resolve(address: str) -> tuple[int, str]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    host = host.strip("[]")
    info = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    family, *_, sockaddr = min(info, key=lambda i: i[0] != socket.AF_INET)   # IPv4 first
    ip = sockaddr[0]
    return family, (f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")


# str -> text, list[int] -> token ids, list of {"role", "content"} -> chat.
Prompt = Union[str, Sequence[int], Sequence[dict]]

_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
}


class NanoserveError(Exception):
    """A failed call: the gRPC status code (grpc.StatusCode) and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> "NanoserveError":
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


# ---------------------------------------------------------------------------- data
@dataclass
class SamplingParams:
    """Sampling settings; None (or empty) leaves the server's default (see generate.proto)."""

    temperature: float | None = None      # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    n: int | None = None                  # completions of the prompt (chunk.index says which)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_logprobs: int | None = None       # alternatives per token (needs logprobs)
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit (-100..100)
    min_tokens: int | None = None         # eos / stop_token_ids cannot end it before this many
    # Output format (at most one): a JSON Schema (dict or JSON text), any JSON object, a
    # regex the whole output matches, a Lark / GBNF grammar, or one of a list of strings.
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    # The expected output (predicted outputs: proposed ahead, verified; text or token ids)
    prediction: str | list[int] | None = None
    speculative: bool | None = None       # False: no proposals for this request

    def structured(self) -> generate_pb2.StructuredOutput | None:
        given = {name: value for name, value in (
            ("json_schema", self.json_schema), ("json_object", self.json_object or None),
            ("regex", self.regex), ("grammar", self.grammar), ("choice", self.choice))
            if value is not None}
        if len(given) > 1:
            raise ValueError(f"give one output format, not {' and '.join(given)}")
        if not given:
            return None
        (name, value), = given.items()
        if name == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)
        if name == "choice":
            value = generate_pb2.Choices(values=list(value))
        return generate_pb2.StructuredOutput(**{name: value})

    def to_proto(self) -> generate_pb2.SamplingParams:
        msg = generate_pb2.SamplingParams(stop=list(self.stop),
                                          stop_token_ids=list(self.stop_token_ids),
                                          ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                                          logit_bias=self.logit_bias or {})
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "n",
                     "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "top_logprobs", "min_tokens", "speculative"):
            value = getattr(self, name)
            if value is not None:  # proto3 `optional`: unset means "server default"
                setattr(msg, name, value)
        structured = self.structured()
        if structured is not None:
            msg.structured.CopyFrom(structured)
        if isinstance(self.prediction, str):
            msg.prediction.text = self.prediction
        elif self.prediction is not None:
            msg.prediction.token_ids.ids.extend(self.prediction)
        return msg


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0      # prompt tokens served from the prefix cache
    accepted_prediction_tokens: int = 0   # of SamplingParams.prediction
    rejected_prediction_tokens: int = 0
    host_cached_tokens: int = 0   # of cached_tokens, those copied back from the host tier
    queue_ms: float = 0.0         # arrival at the engine core -> first scheduled step


@dataclass
class GenerationChunk:
    """One streamed message: the new tokens and the text they complete. finish_reason
    ("stop" / "length") and usage are set on the last chunk only."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None
    usage: Usage | None = None
    index: int = 0              # which of the n completions
    # one {token id: logprob} per token when top_logprobs was asked for, most likely first
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None
    usage: Usage


@dataclass
class ModelInfo:
    model: str = ""
    vocab_size: int = 0
    max_model_len: int = 0
    eos_token_id: int = 0
    tensor_parallel_size: int = 0
    block_size: int = 0
    num_kv_blocks: int = 0
    task: str = ""          # what the server serves: generate, embed, score (comma-joined)
    hidden_size: int = 0    # an embedding's full size
    deterministic: bool = False   # batch-invariant workers (--deterministic)


@dataclass
class Stats:
    num_waiting: int = 0
    num_running: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    workers_healthy: bool = False
    # Decode time breakdown, summed over decode steps (diff two snapshots; see generate.proto)
    num_decode_steps: int = 0
    num_decode_seqs: int = 0
    decode_wall_ms: float = 0.0
    decode_schedule_ms: float = 0.0
    decode_rpc_ms: float = 0.0
    decode_worker_ms: float = 0.0
    decode_gpu_ms: float = 0.0
    decode_postprocess_ms: float = 0.0
    # Of num_generated_tokens, those an output format forced (fast-forward: the scheduler's default)
    num_fast_forward_tokens: int = 0
    num_fast_forward_mismatches: int = 0
    # Speculative decoding: proposed / accepted tokens, verify steps, (seq, step) pairs
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_spec_runs: int = 0
    num_host_kv_blocks: int = 0             # the prefix cache's host tier, in blocks
    num_host_kv_offloaded_blocks: int = 0
    num_host_kv_restored_blocks: int = 0
    num_priority_preemptions: int = 0       # of num_preemptions, for a higher priority
    num_deadline_drops: int = 0             # dropped before prefill: deadline unmeetable
    deterministic: bool = False             # batch-invariant workers (--deterministic)
    num_mixed_steps: int = 0                # prompt chunks beside decode rows (background class)


# ---------------------------------------------------------------------------- conversions
T = TypeVar("T")


def _from_message(cls: type[T], msg: Any) -> T:
    """Copy the proto fields a dataclass names (fields it doesn't know are ignored)."""
    return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})  # type: ignore[arg-type]


def _chat_proto(messages: Sequence[dict]) -> generate_pb2.Chat:
    chat = generate_pb2.Chat()
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"a chat message is a dict with 'role' and 'content', got {m!r}")
        chat.messages.add(role=m["role"], content=str(m.get("content") or ""))
    return chat


def _generate_request(prompt: Prompt, params: SamplingParams | None, request_id: str,
                      skip_special_tokens: bool, adapter: str = "",
                      priority: int | None = None) -> generate_pb2.GenerateRequest:
    """adapter: a LoRA adapter's name (GetModelInfo lists them), "" = the base model;
    priority: lower runs earlier (None: the server's default for the caller's key)."""
    req = generate_pb2.GenerateRequest(request_id=request_id, adapter=adapter,
                                       skip_special_tokens=skip_special_tokens)
    if priority is not None:
        req.priority = priority
    if params is not None:
        req.sampling.CopyFrom(params.to_proto())
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be str, not bytes: decode it first")
    elif isinstance(prompt, Sequence) and all(isinstance(p, dict) for p in prompt) and prompt:
        req.chat.CopyFrom(_chat_proto(prompt))  # type: ignore[arg-type]
    elif isinstance(prompt, Sequence) and all(isinstance(p, int) for p in prompt):
        # Empty list: token ids (the server answers INVALID_ARGUMENT for an empty prompt).
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    else:
        raise TypeError("prompt must be a str, a list of token ids, or a list of "
                        f"{{'role', 'content'}} dicts, got {type(prompt).__name__}")
    return req


EmbedInputs = Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]]


def _embed_request(inputs: EmbedInputs, dimensions: int, truncate: bool, priority: int | None,
                   request_id: str) -> generate_pb2.EmbedRequest:
    """A text, token ids, or a list of either (one embedding each)."""
    if isinstance(inputs, str) or (inputs and all(isinstance(t, int) for t in inputs)):
        inputs = [inputs]
    req = generate_pb2.EmbedRequest(request_id=request_id, dimensions=dimensions,
                                    truncate=truncate, priority=priority)
    for x in inputs:
        req.inputs.append(generate_pb2.EmbedInput(text=x) if isinstance(x, str) else
                          generate_pb2.EmbedInput(token_ids=generate_pb2.TokenIds(ids=list(x))))
    return req


def _score_request(query: str, documents: Sequence[str], instruction: str, truncate: bool,
                   priority: int | None, request_id: str) -> generate_pb2.ScoreRequest:
    return generate_pb2.ScoreRequest(request_id=request_id, query=query, documents=list(documents),
                                     instruction=instruction, truncate=truncate, priority=priority)


def _tokenize_request(prompt: str | Sequence[dict]) -> generate_pb2.TokenizeRequest:
    if isinstance(prompt, str):
        return generate_pb2.TokenizeRequest(text=prompt)
    return generate_pb2.TokenizeRequest(chat=_chat_proto(prompt))


def _usage(msg: Any) -> Usage | None:
    return _from_message(Usage, msg.usage) if msg.HasField("usage") else None


def _chunk(msg: generate_pb2.GenerateResponse | generate_pb2.CompleteResponse) -> GenerationChunk:
    return GenerationChunk(request_id=msg.request_id, token_ids=list(msg.token_ids),
                           text=msg.text, logprobs=list(msg.logprobs),
                           finish_reason=_FINISH_REASONS.get(msg.finish_reason),
                           usage=_usage(msg), index=getattr(msg, "index", 0),
                           top_logprobs=[dict(zip(t.token_ids, t.logprobs))
                                         for t in msg.top_logprobs])


def _completion(msg: generate_pb2.CompleteResponse) -> Completion:
    c = _chunk(msg)
    return Completion(c.request_id, c.token_ids, c.text, c.logprobs, c.finish_reason,
                      c.usage or Usage())


def _channel_credentials(tls: bool, ca: str | None, cert: str | None, key: str | None
                         ) -> grpc.ChannelCredentials | None:
    """None = plaintext; TLS when asked for or when any PEM path is given."""
    if bool(cert) != bool(key):
        raise ValueError("tls_cert and tls_key go together")
    if not (tls or ca or cert):
        return None

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                        certificate_chain=read(cert))


def _open_channel(grpc_module: Any, target: str | Sequence[str],
                  options: list[tuple[str, Any]] | None, tls: bool, ca: str | None,
                  cert: str | None, key: str | None) -> tuple[str, Any]:
    """(resolved target, channel) on grpc or grpc.aio, as both clients open it: replicas
    (channel_target), the project's channel options, then the caller's, and TLS if asked."""
    target, lb_options = channel_target(target)
    creds = _channel_credentials(tls, ca, cert, key)
    opts = CHANNEL_OPTIONS + lb_options + (options or [])
    return target, (grpc_module.insecure_channel(target, options=opts) if creds is None
                    else grpc_module.secure_channel(target, creds, options=opts))


def _replicas(grpc_module: Any, target: str | Sequence[str], how: str,
              options: list[tuple[str, Any]] | None, *tls: Any,
              kv_events: Sequence[str] | None = None) -> routing.Replicas | None:
    """routing="prefix" over several targets: one channel each and a PrefixRouter
    (client/routing.py), which also follows the targets' KV events when given (one ZMQ
    endpoint per target, in order); None for "round_robin" (one channel, grpc's policy)."""
    if how not in ("round_robin", "prefix"):
        raise ValueError(f"routing must be 'round_robin' or 'prefix', got {how!r}")
    addrs = [a.strip() for t in ([target] if isinstance(target, str) else target)
             for a in t.split(",") if a.strip()]
    if how == "round_robin" or len(addrs) < 2:
        return None
    if kv_events is not None and len(kv_events) != len(addrs):
        raise ValueError(f"kv_events: one endpoint per target ({len(addrs)}), got {len(kv_events)}")
    channels = [_open_channel(grpc_module, a, options, *tls)[1] for a in addrs]
    index = routing.KVEventIndex(list(kv_events)) if kv_events else None
    return routing.Replicas(routing.PrefixRouter(len(addrs), kv_index=index),
                            [generate_pb2_grpc.GenerationStub(c) for c in channels], channels)


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _health_status(resp: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


# ---------------------------------------------------------------------------- sync
class Client:
    """Blocking client. `timeout` (seconds) is the default deadline of every call.
    `target`: one address, or several replicas ("h1:p1,h2:p2" or a list): see
    channel_target. api_key goes with every call (authorization: Bearer); tls / tls_ca (PEM
    root, implies tls) / tls_cert + tls_key (client certificate, for servers that require
    one) select TLS. routing="prefix" sends each prompt to the replica most likely to
    hold its prefix in cache (client/routing.py; kv_events: the targets' KV event endpoints,
    to follow what their caches hold); a stream whose server dies is continued
    on another, up to max_resumes times (client/resume.py; 0: never)."""

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET,
                 timeout: float | None = None,
                 options: list[tuple[str, Any]] | None = None, *, api_key: str | None = None,
                 tls: bool = False, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, routing: str = "round_robin",
                 max_resumes: int = resume.MAX_RESUMES,
                 kv_events: Sequence[str] | None = None) -> None:
        self.target, self._channel = _open_channel(grpc, target, options, tls, tls_ca,
                                                   tls_cert, tls_key)
        self._replicas = _replicas(grpc, target, routing, options, tls, tls_ca, tls_cert, tls_key,
                                   kv_events=kv_events)
        self.max_resumes = max_resumes
        self.timeout = timeout
        self._metadata = _auth_metadata(api_key)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        for c in self._replicas.channels if self._replicas else ():
            c.close()
        if self._replicas:
            self._replicas.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise NanoserveError.from_rpc_error(e) from None

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, stream: bool = True,
                 *, request_id: str = "", skip_special_tokens: bool = False, adapter: str = "",
                 priority: int | None = None,
                 timeout: float | None = None) -> Iterator[GenerationChunk]:
        """Chunks as they are produced (stream=False: one chunk, from Complete). Leaving
        the loop early (break, close, garbage collection) cancels the request on the
        server, which frees its KV blocks. A bad prompt type raises here, not on next()."""
        req = _generate_request(prompt, params, request_id, skip_special_tokens, adapter, priority)
        if not stream:
            return iter([_chunk(self._unary(self._stub.Complete, req, timeout))])
        return self._stream(req, timeout)

    def _stream(self, req: generate_pb2.GenerateRequest,
                timeout: float | None) -> Iterator[GenerationChunk]:
        tried: list[int] = []

        def attempt(r: generate_pb2.GenerateRequest, _: int):
            stub, i = self._replicas.pick(r, tried) if self._replicas else (self._stub, -1)
            call = stub.Generate(r, timeout=self._timeout(timeout), metadata=self._metadata)
            try:
                yield from call
            finally:
                call.cancel()  # no-op once the stream has ended
                if i >= 0:
                    self._replicas.done(i)

        def prompt_ids() -> list[int]:
            return list(self._unary(self._stub.Tokenize, resume.tokenize_request(req),
                                    timeout).token_ids)
        try:
            for msg in resume.stream(req, attempt, prompt_ids, self.max_resumes):
                yield _chunk(msg)
        except grpc.RpcError as e:
            raise NanoserveError.from_rpc_error(e) from None

    def complete(self, prompt: Prompt, params: SamplingParams | None = None, *,
                 request_id: str = "", skip_special_tokens: bool = False, adapter: str = "",
                 priority: int | None = None, timeout: float | None = None) -> Completion:
        req = _generate_request(prompt, params, request_id, skip_special_tokens, adapter, priority)
        return _completion(self._unary(self._stub.Complete, req, timeout))

    def tokenize(self, prompt: str | Sequence[dict], timeout: float | None = None) -> list[int]:
        """Token ids of a text, or of a chat rendered with the model's template."""
        resp = self._unary(self._stub.Tokenize, _tokenize_request(prompt), timeout)
        return list(resp.token_ids)

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        msg = self._unary(self._stub.GetModelInfo, generate_pb2.ModelInfoRequest(), timeout)
        return _from_message(ModelInfo, msg)

    def embed(self, inputs: EmbedInputs, *, dimensions: int = 0, truncate: bool = False,
              priority: int | None = None, request_id: str = "",
              timeout: float | None = None) -> list[list[float]]:
        """Unit-length embeddings (a server started with --task embed), one per input: a
        text, token ids, or a list of either; dimensions: matryoshka size (0: full)."""
        req = _embed_request(inputs, dimensions, truncate, priority, request_id)
        return [list(e.values) for e in self._unary(self._stub.Embed, req, timeout).embeddings]

    def score(self, query: str, documents: Sequence[str], *, instruction: str = "",
              truncate: bool = False, priority: int | None = None, request_id: str = "",
              timeout: float | None = None) -> list[float]:
        """P(yes) that each document meets the query (a reranker, --task score)."""
        req = _score_request(query, documents, instruction, truncate, priority, request_id)
        return list(self._unary(self._stub.Score, req, timeout).scores)

    def stats(self, timeout: float | None = None) -> Stats:
        return _from_message(Stats, self._unary(self._stub.GetStats, generate_pb2.StatsRequest(),
                                                timeout))

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """grpc.health.v1 status name: "SERVING", "NOT_SERVING", "UNKNOWN", "SERVICE_UNKNOWN"."""
        req = health_pb2.HealthCheckRequest(service=service)
        return _health_status(self._unary(self._health.Check, req, timeout))


# ---------------------------------------------------------------------------- asyncio
class AsyncClient:
    """The same surface on grpc.aio: `async for chunk in client.generate(...)`, and
    `await` for the rest. Create it inside the event loop that uses it. routing and
    max_resumes: as Client's."""

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET,
                 timeout: float | None = None,
                 options: list[tuple[str, Any]] | None = None, *, api_key: str | None = None,
                 tls: bool = False, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, routing: str = "round_robin",
                 max_resumes: int = resume.MAX_RESUMES,
                 kv_events: Sequence[str] | None = None) -> None:
        self.target, self._channel = _open_channel(grpc.aio, target, options, tls, tls_ca,
                                                   tls_cert, tls_key)
        self._replicas = _replicas(grpc.aio, target, routing, options, tls, tls_ca, tls_cert,
                                   tls_key, kv_events=kv_events)
        self.max_resumes = max_resumes
        self.timeout = timeout
        self._metadata = _auth_metadata(api_key)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        for c in self._replicas.channels if self._replicas else ():
            await c.close()
        if self._replicas:
            self._replicas.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:  # grpc.aio.AioRpcError is one
            raise NanoserveError.from_rpc_error(e) from None

    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 stream: bool = True, *, request_id: str = "",
                 skip_special_tokens: bool = False, adapter: str = "",
                 priority: int | None = None,
                 timeout: float | None = None) -> AsyncIterator[GenerationChunk]:
        """Async iterator of chunks; leaving the loop early cancels the request."""
        req = _generate_request(prompt, params, request_id, skip_special_tokens, adapter, priority)
        return self._stream(req, stream, timeout)

    async def _stream(self, req: generate_pb2.GenerateRequest, stream: bool,
                      timeout: float | None) -> AsyncIterator[GenerationChunk]:
        if not stream:
            yield _chunk(await self._unary(self._stub.Complete, req, timeout))
            return
        tried: list[int] = []

        async def attempt(r: generate_pb2.GenerateRequest, _: int):
            stub, i = self._replicas.pick(r, tried) if self._replicas else (self._stub, -1)
            call = stub.Generate(r, timeout=self._timeout(timeout), metadata=self._metadata)
            try:
                async for msg in call:
                    yield msg
            finally:
                call.cancel()
                if i >= 0:
                    self._replicas.done(i)

        async def prompt_ids() -> list[int]:
            return list((await self._unary(self._stub.Tokenize, resume.tokenize_request(req),
                                           timeout)).token_ids)
        msgs = resume.astream(req, attempt, prompt_ids, self.max_resumes)
        try:
            async for msg in msgs:
                yield _chunk(msg)
        except grpc.RpcError as e:
            raise NanoserveError.from_rpc_error(e) from None
        finally:
            await msgs.aclose()   # leaving early cancels the call now, not at garbage collection

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       request_id: str = "", skip_special_tokens: bool = False, adapter: str = "",
                       priority: int | None = None, timeout: float | None = None) -> Completion:
        req = _generate_request(prompt, params, request_id, skip_special_tokens, adapter, priority)
        return _completion(await self._unary(self._stub.Complete, req, timeout))

    async def tokenize(self, prompt: str | Sequence[dict],
                       timeout: float | None = None) -> list[int]:
        resp = await self._unary(self._stub.Tokenize, _tokenize_request(prompt), timeout)
        return list(resp.token_ids)

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        msg = await self._unary(self._stub.GetModelInfo, generate_pb2.ModelInfoRequest(), timeout)
        return _from_message(ModelInfo, msg)

    async def embed(self, inputs: EmbedInputs, *, dimensions: int = 0, truncate: bool = False,
                    priority: int | None = None, request_id: str = "",
                    timeout: float | None = None) -> list[list[float]]:
        """As Client.embed."""
        req = _embed_request(inputs, dimensions, truncate, priority, request_id)
        resp = await self._unary(self._stub.Embed, req, timeout)
        return [list(e.values) for e in resp.embeddings]

    async def score(self, query: str, documents: Sequence[str], *, instruction: str = "",
                    truncate: bool = False, priority: int | None = None, request_id: str = "",
                    timeout: float | None = None) -> list[float]:
        """As Client.score."""
        req = _score_request(query, documents, instruction, truncate, priority, request_id)
        return list((await self._unary(self._stub.Score, req, timeout)).scores)

    async def stats(self, timeout: float | None = None) -> Stats:
        msg = await self._unary(self._stub.GetStats, generate_pb2.StatsRequest(), timeout)
        return _from_message(Stats, msg)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        req = health_pb2.HealthCheckRequest(service=service)
        return _health_status(await self._unary(self._health.Check, req, timeout))
