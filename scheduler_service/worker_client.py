"""Client side of the internal Worker API: one group of tensor-parallel ranks, on asyncio.

Each StepRequest is serialized once and the same bytes go to every rank; rank 0's
answer carries the sampled tokens. Any failure of any rank fails the whole group (a
collective cannot finish without every rank), and the engine reconnects and replays.

grpc.aio rather than grpc's blocking API: a blocking bidirectional stream runs two helper
threads per call (request consumer and channel spin) that hand every message across
threads; measured on the null worker, that cost ~2x the engine's CPU per step.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

import grpc
import grpc.aio

from nanoserve.security import bearer
from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from nanoserve.worker_group import GroupInfo, WorkerGroupError

log = logging.getLogger("nanoserve.scheduler")

MAX_MESSAGE_BYTES = 256 << 20
INIT_TIMEOUT_S = 600.0
# A worker that is down (loading, restarting) is retried at most ~0.25 s apart: gRPC's
# default backoff grows to 2 minutes, so a worker back after a long reload could wait tens
# of seconds more for the scheduler to notice it, and at a 1 s cap the scheduler took
# 0.35-0.98 s (median 0.69) to serve after a worker came up, 0.16-0.38 s (0.21) at 0.25 s
# (null worker, 6 starts each). A refused connection costs next to nothing. (Not
# grpc.min_reconnect_backoff_ms: gRPC also takes it as the least time a connection
# attempt may take, 20 s by default; at 100 ms attempts on a loaded host timed out before
# their handshake, for a minute on end.)
RECONNECT_BACKOFF_MS = (100, 250)
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])]
_STEP = "/nanoserve.v1.Worker/Step"


def step_refused(code: grpc.StatusCode, details: str) -> bool:
    """Whether a Step stream's error is the worker refusing or failing the step itself
    (INVALID_ARGUMENT, or INTERNAL with its "step N: ..." message: the requests in it
    fail) rather than a lost worker (re-prefilled on the restarted one). gRPC's own
    INTERNAL ("Internal error from Core": the stream reset when the worker process died
    mid-answer; seen in the chaos test) is a lost worker."""
    return code == grpc.StatusCode.INVALID_ARGUMENT or (
        code == grpc.StatusCode.INTERNAL and details.startswith("step "))


class _StepStream:
    """One rank's long-lived bidirectional Step stream, fed pre-serialized bytes."""

    def __init__(self, channel: grpc.aio.Channel, rank: int, events: asyncio.Queue | None,
                 metadata: tuple = ()):
        self.rank = rank
        self.call = channel.stream_stream(
            _STEP, request_serializer=None,   # we pass bytes serialized once for all ranks
            response_deserializer=worker_pb2.StepResponse.FromString)(metadata=metadata)
        self.answers: deque = deque()   # this rank's answers not yet matched to a step
        self.reader = None
        if events is not None:
            # With several ranks every answer and failure goes to one queue, so a rank that
            # fails is noticed at once even while another is blocked in a collective that
            # will never finish (NCCL only gives up after its own timeout).
            self.reader = asyncio.ensure_future(self._read(events))

    async def _read(self, events: asyncio.Queue) -> None:
        try:
            while (resp := await self.call.read()) is not grpc.aio.EOF:
                events.put_nowait((self.rank, resp))
            events.put_nowait((self.rank, EOFError("stream closed")))
        except grpc.aio.AioRpcError as e:
            events.put_nowait((self.rank, e))
        except asyncio.CancelledError:
            pass

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.call.cancel()


class WorkerGroup:
    def __init__(self, addresses: list[str], connect_timeout: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None, secret: str | None = None,
                 adapters: tuple[tuple[int, str, str], ...] = ()):
        """credentials: TLS to the workers (nanoserve.security.channel_credentials), None =
        plaintext; secret: the workers' shared secret, sent with every call; adapters:
        (id, name, path) of each LoRA adapter to serve."""
        self.adapters = tuple(adapters)
        if not addresses:
            raise ValueError("at least one worker address is needed")
        self.addresses = addresses
        self.connect_timeout = connect_timeout
        self.credentials = credentials
        self.metadata = bearer(secret)
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[worker_pb2_grpc.WorkerStub] = []
        self.streams: list[_StepStream] = []
        self.info: GroupInfo | None = None
        self._events: asyncio.Queue | None = None

    def _open_channels(self) -> None:
        """aio channels belong to the running event loop: made on first use."""
        if not self.channels:
            self.channels = [grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS)
                             if self.credentials is None else
                             grpc.aio.secure_channel(a, self.credentials, options=_CHANNEL_OPTIONS)
                             for a in self.addresses]
            self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]

    async def connect(self, block_size: int, num_kv_blocks: int = 0, wait: bool = True) -> GroupInfo:
        """Info from every rank, agree on the KV size, Init all, open Step streams.

        num_kv_blocks > 0 pins the size (a reconnect must keep the scheduler's count).
        Every Init sends the LoRA adapters (self.adapters), so a restarted worker has them
        again."""
        adapters = self.adapters
        self.close_streams()
        self._open_channels()
        infos = await self._on_every_rank(
            lambda stub: self._call(stub.Info, worker_pb2.InfoRequest(block_size=block_size), wait))
        first = infos[0]
        for rank, info in enumerate(infos):
            if info.rank != rank or info.world_size != len(self.addresses):
                raise WorkerGroupError(
                    f"worker {self.addresses[rank]} is rank {info.rank} of {info.world_size}, "
                    f"expected rank {rank} of {len(self.addresses)}", lost=False)
            if info.model_fingerprint != first.model_fingerprint:
                raise WorkerGroupError(
                    f"ranks serve different models: {first.model} vs {info.model}", lost=False)
            if info.draft_model != first.draft_model:
                raise WorkerGroupError(
                    f"ranks use different draft models: {first.draft_model or 'none'} (rank 0) "
                    f"vs {info.draft_model or 'none'} (rank {rank})", lost=False)
            if info.kv_cache_dtype != first.kv_cache_dtype:
                raise WorkerGroupError(
                    f"ranks use different KV cache dtypes: {first.kv_cache_dtype} (rank 0) vs "
                    f"{info.kv_cache_dtype} (rank {rank})", lost=False)
        max_loras = min(i.max_loras for i in infos)
        if adapters and not max_loras:
            raise WorkerGroupError(f"{len(adapters)} LoRA adapter(s) to serve, but the workers "
                                   f"were started without --max-loras", lost=False)
        capacity = min(i.num_kv_blocks for i in infos)
        blocks = num_kv_blocks or capacity
        if blocks == 0 or blocks > capacity:
            raise WorkerGroupError(f"KV cache: {blocks} blocks needed, workers fit {capacity}",
                                   lost=False)
        # Every rank's Init at once, never one after another: a TP rank's Init meets its
        # peers in collectives (a barrier, then CUDA graph capture runs the model's
        # all-reduces), so rank 0's Init cannot finish before rank 1's has begun.
        host_blocks = min(i.num_host_kv_blocks for i in infos)
        init = worker_pb2.InitRequest(num_kv_blocks=blocks, block_size=block_size,
                                      adapters=_adapter_protos(adapters),
                                      num_host_kv_blocks=host_blocks)
        await self._on_every_rank(
            lambda stub: self._call(stub.Init, init, wait, timeout=INIT_TIMEOUT_S))
        self._events = asyncio.Queue() if len(self.channels) > 1 else None
        self.streams = [_StepStream(c, r, self._events, self.metadata)
                        for r, c in enumerate(self.channels)]
        self.info = GroupInfo(model=first.model, fingerprint=first.model_fingerprint,
                              world_size=len(infos), num_kv_blocks=blocks, block_size=block_size,
                              vocab_size=first.vocab_size,
                              max_model_len=min(i.max_model_len for i in infos),
                              eos_token_id=first.eos_token_id,
                              kv_cache_dtype=first.kv_cache_dtype,
                              structured_output=first.structured_output,
                              max_loras=max_loras, num_host_kv_blocks=host_blocks,
                              draft_model=first.draft_model, task=first.task or "generate",
                              hidden_size=first.hidden_size,
                              deterministic=all(i.deterministic for i in infos))
        return self.info

    async def set_adapters(self, adapters: tuple[tuple[int, str, str], ...]) -> None:
        """Every rank serves exactly these LoRA adapters from now on (and after any
        reconnect). Raises WorkerGroupError: lost=False when a worker refused them (its
        message says why; every rank keeps or drops the new set alike only once all have
        answered, so the caller sets the old set again)."""
        req = worker_pb2.AdapterSet(adapters=_adapter_protos(adapters))
        await self._on_every_rank(lambda stub: self._call(stub.SetAdapters, req, False,
                                                          timeout=INIT_TIMEOUT_S))
        self.adapters = tuple(adapters)

    async def _on_every_rank(self, call) -> list:
        """call(stub) on every rank concurrently; results in rank order. The first failure
        cancels the calls still running and is raised."""
        tasks = [asyncio.ensure_future(call(stub)) for stub in self.stubs]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _call(self, method, request, wait: bool, timeout: float | None = None):
        try:
            return await method(request, timeout=timeout or self.connect_timeout,
                                wait_for_ready=wait, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            raise WorkerGroupError(f"worker call failed: {e.code().name}: {e.details()}",
                                   lost=e.code() in (grpc.StatusCode.UNAVAILABLE,
                                                     grpc.StatusCode.DEADLINE_EXCEEDED)) from e

    async def send(self, request: worker_pb2.StepRequest) -> None:
        """Queue a step on every rank (serialized once) without waiting for its answer."""
        payload = request.SerializeToString()
        try:
            for s in self.streams:
                await s.call.write(payload)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            # The stream already failed; receive() reports why.
            log.debug("step %d not sent: %s", request.step_id, e)

    async def receive(self, step_id: int) -> worker_pb2.StepResponse:
        """The answer to the oldest step in flight (rank 0's); every rank must answer, and
        the first rank to fail fails the step."""
        result = None
        for rank in range(len(self.streams)):
            resp = await self._next_answer(rank, step_id)
            if resp.step_id != step_id:
                self.close_streams()
                raise WorkerGroupError(f"rank {rank} answered step {resp.step_id}, expected "
                                       f"{step_id}", lost=False)
            if rank == 0:
                result = resp
        return result

    async def _next_answer(self, rank: int, step_id: int) -> worker_pb2.StepResponse:
        if not self.streams:
            raise WorkerGroupError("no Step streams open")
        stream = self.streams[rank]
        if self._events is None:
            try:
                resp = await stream.call.read()
            except grpc.aio.AioRpcError as e:
                self._fail(rank, step_id, e)
            if resp is grpc.aio.EOF:
                self._fail(rank, step_id, EOFError("stream closed"))
            return resp
        while not stream.answers:   # take whatever any rank says next, failures first
            who, item = await self._events.get()
            if isinstance(item, BaseException):
                self._fail(who, step_id, item)
            self.streams[who].answers.append(item)
        return stream.answers.popleft()

    def _fail(self, rank: int, step_id: int, e: BaseException):
        code = e.code() if isinstance(e, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
        details = (e.details() or "") if isinstance(e, grpc.aio.AioRpcError) else str(e)
        self.close_streams()
        raise WorkerGroupError(
            f"rank {rank} ({self.addresses[rank]}) failed step {step_id}: {code.name}: {details}",
            lost=not step_refused(code, details))

    async def healthy(self) -> bool:
        self._open_channels()
        try:
            for stub in self.stubs:
                if not (await stub.Health(worker_pb2.HealthRequest(), timeout=2.0,
                                          metadata=self.metadata)).ready:
                    return False
            return True
        except grpc.aio.AioRpcError:
            return False

    def close_streams(self) -> None:
        for s in self.streams:
            s.close()
        self.streams = []

    async def close(self) -> None:
        self.close_streams()
        for c in self.channels:
            await c.close()
        self.channels, self.stubs = [], []


def _adapter_protos(adapters) -> list:
    return [worker_pb2.Adapter(id=i, name=n, path=p) for i, n, p in adapters]


async def wait_for_group(group: WorkerGroup, block_size: int, num_kv_blocks: int = 0,
                         stop: asyncio.Event | None = None, retry_s: float = 0.5) -> GroupInfo:
    """Connect, retrying while ranks are unreachable (a worker still loading or restarting)."""
    while True:
        try:
            return await group.connect(block_size, num_kv_blocks)
        except WorkerGroupError as e:
            if not e.lost:
                raise
            log.warning("workers not reachable yet (%s); retrying", e)
        if stop is not None:
            try:
                await asyncio.wait_for(stop.wait(), retry_s)
                raise WorkerGroupError("shutting down", lost=False)
            except asyncio.TimeoutError:
                pass
        else:
            await asyncio.sleep(retry_s)
