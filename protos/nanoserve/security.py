"""Who may call a server, and what it does with bytes it cannot parse (both planes).

Opt-in TLS (server cert/key, optionally a client CA that makes it mutual TLS), a shared
token in the `authorization: Bearer <token>` metadata (the public API key, the workers'
secret), and request parsing inside the handler: gRPC Python answers INTERNAL when a
request deserializer raises, so servers get raw bytes and garbage gets INVALID_ARGUMENT.
`AsyncGuard` wraps grpc.aio servers (frontends, null worker), `SyncGuard` the blocking
worker server. Only grpc here: the control plane and the workers both import it, which is
why it lives in the `nanoserve` package (protos/nanoserve/) and in neither plane.
"""
from __future__ import annotations

import hmac
import inspect
from typing import Callable, Iterable

import grpc
import grpc.aio

AUTH_HEADER = "authorization"
# Open without a token: liveness probes and service discovery must work for anyone who
# can reach the port (they reveal nothing and drive nothing).
OPEN_PUBLIC = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_WORKER = ("/nanoserve.v1.Worker/Health",)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert: str | None, key: str | None, client_ca: str | None = None
                       ) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (None = plaintext); client_ca requires client certs
    signed by it (mutual TLS)."""
    if not cert and not key:
        if client_ca:
            raise ValueError("a client CA needs a server certificate and key too")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both a certificate and a key")
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))], root_certificates=_read(client_ca) if client_ca else None,
        require_client_auth=bool(client_ca))


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None
                        ) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client (None = plaintext): trust `ca` (None with cert/key: the
    system roots), present cert/key when the server requires client certs."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs its key (and the key its certificate)")
    if not (ca or cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca) if ca else None,
        private_key=_read(key) if key else None, certificate_chain=_read(cert) if cert else None)


def add_port(server, address: str, creds: grpc.ServerCredentials | None) -> int:
    """Bind `address`, with TLS when creds are given; OSError if it cannot."""
    bound = (server.add_secure_port(address, creds) if creds is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    return bound


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries `token` (none when there is no token)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def authorized(metadata: Iterable | None, token: str) -> bool:
    """Whether the call's metadata carries `token` (constant-time comparison)."""
    want = f"Bearer {token}".encode()
    for k, v in metadata or ():
        if k == AUTH_HEADER:
            got = v.encode() if isinstance(v, str) else v
            return hmac.compare_digest(got, want)
    return False


class _Unparsable(Exception):
    pass


def _parser(deserializer: Callable | None) -> Callable:
    def parse(raw):
        try:
            return deserializer(raw) if deserializer is not None else raw
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, and anything else
            raise _Unparsable(f"request is not a valid message: {type(e).__name__}: {e}") from None
    return parse


def _kind(h: grpc.RpcMethodHandler) -> str:
    return ("stream" if h.request_streaming else "unary") + "_" + \
           ("stream" if h.response_streaming else "unary")


class AsyncGuard(grpc.aio.ServerInterceptor):
    """grpc.aio server interceptor: a token (if set) on every method but the open ones,
    requests parsed inside the handler (garbage -> INVALID_ARGUMENT). `check` instead of a
    token: whether a call's metadata may pass (several keys)."""

    def __init__(self, token: str | None, open_prefixes: tuple[str, ...] = (),
                 check: Callable[[Iterable | None], bool] | None = None):
        self.token = token or None
        self.open_prefixes = open_prefixes
        self.check = check or (None if self.token is None
                               else lambda metadata: authorized(metadata, self.token))

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        kind = _kind(handler)
        if self.check is not None and not details.method.startswith(self.open_prefixes) \
                and not self.check(details.invocation_metadata):
            return _rebuild(handler, kind, None, _async_reject(kind))
        return _rebuild(handler, kind, None,
                        _async_parsing(kind, getattr(handler, kind), handler.request_deserializer))


def _rebuild(handler: grpc.RpcMethodHandler, kind: str, deserializer, behaviour
             ) -> grpc.RpcMethodHandler:
    return getattr(grpc, f"{kind}_rpc_method_handler")(
        behaviour, request_deserializer=deserializer,
        response_serializer=handler.response_serializer)


def _async_reject(kind: str):
    async def abort(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials")

    if kind.endswith("_stream"):
        async def abort_stream(request, context):
            await abort(request, context)
            yield   # never reached: makes this an async generator
        return abort_stream
    return abort


def _async_parsing(kind: str, behaviour, deserializer):
    parse = _parser(deserializer)

    async def parsed_stream(requests, context):
        async for raw in requests:
            try:
                yield parse(raw)
            except _Unparsable as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def request_of(raw, context):
        try:
            return parse(raw)
        except _Unparsable as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    if kind == "unary_unary":
        async def uu(raw, context):
            return await behaviour(await request_of(raw, context), context)
        return uu
    if kind == "stream_unary":
        async def su(requests, context):
            return await behaviour(parsed_stream(requests, context), context)
        return su
    # Streamed answers: a handler is an async generator, or a coroutine calling context.write
    # (grpc_health's Watch); the wrapper must be the same kind.
    requests_of = request_of if kind == "unary_stream" else \
        (lambda requests, context: _ready(parsed_stream(requests, context)))
    if inspect.isasyncgenfunction(behaviour):
        async def gen(request, context):
            async for r in behaviour(await requests_of(request, context), context):
                yield r
        return gen

    async def writer(request, context):
        return await behaviour(await requests_of(request, context), context)
    return writer


async def _ready(value):
    return value


class SyncGuard(grpc.ServerInterceptor):
    """The same as AsyncGuard for a blocking grpc.server (the real worker)."""

    def __init__(self, token: str | None, open_prefixes: tuple[str, ...] = ()):
        self.token = token or None
        self.open_prefixes = open_prefixes

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        kind = _kind(handler)
        if self.token and not details.method.startswith(self.open_prefixes) \
                and not authorized(details.invocation_metadata, self.token):
            def reject(_request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials")
            return _rebuild(handler, kind, None, reject)
        return _rebuild(handler, kind, None,
                        _sync_parsing(kind, getattr(handler, kind), handler.request_deserializer))


def _sync_parsing(kind: str, behaviour, deserializer):
    parse = _parser(deserializer)

    def request_of(raw, context):
        try:
            return parse(raw)
        except _Unparsable as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def parsed_stream(requests, context):
        for raw in requests:
            try:
                yield parse(raw)
            except _Unparsable as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    if kind.startswith("unary_"):
        return lambda raw, context: behaviour(request_of(raw, context), context)
    return lambda requests, context: behaviour(parsed_stream(requests, context), context)
