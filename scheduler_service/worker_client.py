"""Client side of the internal Worker API: one group of tensor-parallel ranks.

Each StepRequest is serialized once and the same bytes go to every rank; rank 0's
answer carries the sampled tokens. Any failure of any rank fails the whole group (a
collective cannot finish without every rank), and the engine reconnects and replays.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import grpc

from nanoserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("nanoserve.scheduler")

MAX_MESSAGE_BYTES = 256 << 20
INIT_TIMEOUT_S = 600.0
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class WorkerGroupError(RuntimeError):
    """A rank failed or the ranks disagree; `lost` is True when a rank is unreachable."""

    def __init__(self, message: str, lost: bool = True):
        super().__init__(message)
        self.lost = lost


@dataclass
class GroupInfo:
    model: str
    fingerprint: str
    world_size: int
    num_kv_blocks: int      # min over ranks
    block_size: int
    vocab_size: int
    max_model_len: int
    eos_token_id: int


class _RankFailed(Exception):
    """A rank's stream broke (raised inside WorkerGroup, turned into WorkerGroupError)."""

    def __init__(self, rank: int, error: BaseException):
        self.rank, self.error = rank, error


class _StepStream:
    """One rank's long-lived bidirectional Step stream, fed pre-serialized bytes.

    With several ranks, a reader thread per rank forwards answers and failures to one
    queue shared by the group, so a rank that fails is noticed at once even while
    another rank is blocked in a collective that will never finish (NCCL only gives up
    after its own timeout)."""

    def __init__(self, channel: grpc.Channel, rank: int, events: queue.Queue | None = None):
        self.rank = rank
        self.requests: queue.Queue[bytes | None] = queue.Queue()
        call = channel.stream_stream(
            "/nanoserve.v1.Worker/Step",
            request_serializer=None,   # we pass bytes serialized once for all ranks
            response_deserializer=worker_pb2.StepResponse.FromString)
        self.responses = call(iter(self.requests.get, None), wait_for_ready=False)
        self.answers: deque = deque()   # this rank's answers not yet matched to a step
        if events is not None:
            threading.Thread(target=self._read, args=(events,), name=f"step-rank{rank}",
                             daemon=True).start()

    def _read(self, events: queue.Queue) -> None:
        try:
            for resp in self.responses:
                events.put((self.rank, resp))
            events.put((self.rank, StopIteration("stream closed")))
        except grpc.RpcError as e:
            events.put((self.rank, e))

    def send(self, payload: bytes) -> None:
        self.requests.put(payload)

    def receive(self) -> worker_pb2.StepResponse:
        return next(self.responses)

    def close(self) -> None:
        self.requests.put(None)
        self.responses.cancel()


class WorkerGroup:
    def __init__(self, addresses: list[str], connect_timeout: float = 10.0):
        if not addresses:
            raise ValueError("at least one worker address is needed")
        self.addresses = addresses
        self.connect_timeout = connect_timeout
        self.channels = [grpc.insecure_channel(a, options=_CHANNEL_OPTIONS) for a in addresses]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.streams: list[_StepStream] = []
        self.info: GroupInfo | None = None
        self._lock = threading.Lock()

    def connect(self, block_size: int, num_kv_blocks: int = 0, wait: bool = True) -> GroupInfo:
        """Info from every rank, agree on the KV size, Init all, open Step streams.

        num_kv_blocks > 0 pins the size (a reconnect must keep the scheduler's count)."""
        self.close_streams()
        infos = [self._call(stub.Info, worker_pb2.InfoRequest(block_size=block_size), wait)
                 for stub in self.stubs]
        first = infos[0]
        for rank, info in enumerate(infos):
            if info.rank != rank or info.world_size != len(self.addresses):
                raise WorkerGroupError(
                    f"worker {self.addresses[rank]} is rank {info.rank} of {info.world_size}, "
                    f"expected rank {rank} of {len(self.addresses)}", lost=False)
            if info.model_fingerprint != first.model_fingerprint:
                raise WorkerGroupError(
                    f"ranks serve different models: {first.model} vs {info.model}", lost=False)
        capacity = min(i.num_kv_blocks for i in infos)
        blocks = num_kv_blocks or capacity
        if blocks == 0 or blocks > capacity:
            raise WorkerGroupError(f"KV cache: {blocks} blocks needed, workers fit {capacity}",
                                   lost=False)
        for stub in self.stubs:   # Init allocates the KV cache and captures CUDA graphs: slow
            self._call(stub.Init, worker_pb2.InitRequest(num_kv_blocks=blocks, block_size=block_size),
                       wait, timeout=INIT_TIMEOUT_S)
        self._events = queue.Queue() if len(self.channels) > 1 else None
        self.streams = [_StepStream(c, r, self._events) for r, c in enumerate(self.channels)]
        self.info = GroupInfo(model=first.model, fingerprint=first.model_fingerprint,
                              world_size=len(infos), num_kv_blocks=blocks, block_size=block_size,
                              vocab_size=first.vocab_size,
                              max_model_len=min(i.max_model_len for i in infos),
                              eos_token_id=first.eos_token_id)
        return self.info

    def _call(self, method, request, wait: bool, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self.connect_timeout, wait_for_ready=wait)
        except grpc.RpcError as e:
            raise WorkerGroupError(f"worker call failed: {e.code().name}: {e.details()}",
                                   lost=e.code() in (grpc.StatusCode.UNAVAILABLE,
                                                     grpc.StatusCode.DEADLINE_EXCEEDED)) from e

    def step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        self.send(request)
        return self.receive(request.step_id)

    def send(self, request: worker_pb2.StepRequest) -> None:
        """Queue a step on every rank (serialized once) without waiting for it."""
        payload = request.SerializeToString()
        for s in self.streams:
            s.send(payload)

    def receive(self, step_id: int) -> worker_pb2.StepResponse:
        """The answer to the oldest step in flight (rank 0's); every rank must answer, and
        the first rank to fail fails the step."""
        answers = [self._next_answer(rank, step_id) for rank in range(len(self.streams))]
        result = None
        for rank, resp in enumerate(answers):
            if resp.step_id != step_id:
                self.close_streams()
                raise WorkerGroupError(f"rank {rank} answered step {resp.step_id}, expected "
                                       f"{step_id}", lost=False)
            if rank == 0:
                result = resp
        return result

    def _next_answer(self, rank: int, step_id: int) -> worker_pb2.StepResponse:
        stream = self.streams[rank]
        try:
            if self._events is None:
                return stream.receive()
            while not stream.answers:   # take whatever any rank says next, failures first
                who, item = self._events.get()
                if isinstance(item, BaseException):
                    raise _RankFailed(who, item)
                self.streams[who].answers.append(item)
            return stream.answers.popleft()
        except _RankFailed as failed:
            rank, e = failed.rank, failed.error
        except (grpc.RpcError, StopIteration) as err:
            e = err
        code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
        details = e.details() if isinstance(e, grpc.RpcError) else "stream closed"
        self.close_streams()
        raise WorkerGroupError(
            f"rank {rank} ({self.addresses[rank]}) failed step {step_id}: {code.name}: {details}",
            lost=code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL))


    def healthy(self) -> bool:
        try:
            return all(stub.Health(worker_pb2.HealthRequest(), timeout=2.0).ready for stub in self.stubs)
        except grpc.RpcError:
            return False

    def close_streams(self) -> None:
        for s in self.streams:
            s.close()
        self.streams = []

    def close(self) -> None:
        self.close_streams()
        for c in self.channels:
            c.close()


def wait_for_group(group: WorkerGroup, block_size: int, num_kv_blocks: int = 0,
                   stop: threading.Event | None = None, retry_s: float = 0.5) -> GroupInfo:
    """Connect, retrying while ranks are unreachable (a worker still loading or restarting)."""
    while True:
        try:
            return group.connect(block_size, num_kv_blocks)
        except WorkerGroupError as e:
            if not e.lost:
                raise
            log.warning("workers not reachable yet (%s); retrying", e)
        if stop is not None and stop.wait(retry_s):
            raise WorkerGroupError("shutting down")
        if stop is None:
            time.sleep(retry_s)
