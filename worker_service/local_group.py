"""A worker "group" of one in-process ModelRunner: the Engine without the gRPC boundary.

The scheduler's Engine drives `scheduler_service.worker_client.WorkerGroup`, which
serializes each StepRequest and sends it over a bidirectional stream to every rank.
`LocalWorkerGroup` offers the same surface (`connect`, `step`, `send`/`receive`,
`healthy`, `close`, coroutines like the real one's) but hands the StepRequest object
straight to the ModelRunner: no serialization, no network. Benchmarking the same workload through both prices the
service boundary.

Steps run in order on one thread of their own, as a worker service runs its Step stream:
`send` returns at once, so an Engine that keeps two steps in flight (overlap scheduling)
prepares step N+1 while step N computes, exactly as it would against a remote worker.

Lives in worker_service because it imports the ModelRunner (torch); the scheduler
service itself never imports it.
"""
from __future__ import annotations

import asyncio
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nanoserve.v1 import worker_pb2
from nanoserve.worker_group import GroupInfo, WorkerGroupError, steps_in
from worker_service.model_runner import ModelRunner, StepError


class LocalWorkerGroup:
    """One rank (TP=1) run in this process; same contract as worker_client.WorkerGroup."""

    def __init__(self, runner: ModelRunner, model_name: str | None = None):
        self.runner = runner
        self.model_name = model_name or os.path.basename(os.path.normpath(runner.config.model_dir))
        self.addresses = ["in-process"]   # what logs print for a remote group
        self.info: GroupInfo | None = None
        # One thread: steps execute strictly in order, like the worker's Step stream.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-worker",
                                            initializer=self._bind_device)
        self._in_flight: deque[tuple[int, Future]] = deque()

    def _bind_device(self) -> None:
        """torch's current CUDA device is per thread: the step thread needs the runner's
        (CUDA events and streams are taken from the current device)."""
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)

    async def connect(self, block_size: int, num_kv_blocks: int = 0, wait: bool = True) -> GroupInfo:
        """Size and (re)allocate the KV cache, as Info + Init do on a worker service.

        num_kv_blocks > 0 pins the size; 0 takes everything the runner's budget fits. A
        second connect re-allocates (the Engine calls it after a failed step)."""
        self.close_streams()   # no step may run while the KV cache is replaced
        r = self.runner
        capacity = r.kv_capacity(block_size)   # the current cache counts as room
        blocks = num_kv_blocks or capacity
        if blocks == 0 or blocks > capacity:
            raise WorkerGroupError(f"KV cache: {blocks} blocks needed, the runner fits {capacity}",
                                   lost=False)
        r.init_kv(blocks, block_size)
        self.info = GroupInfo(model=self.model_name, fingerprint=r.fingerprint, world_size=1,
                              num_kv_blocks=blocks, block_size=block_size,
                              vocab_size=r.vocab_size, max_model_len=r.max_model_len,
                              eos_token_id=r.eos_token_id,
                              structured_output=r.grammar_tokenizer is not None,
                              deterministic=r.config.deterministic)
        return self.info

    async def send(self, request: worker_pb2.StepRequest) -> None:
        """Launch a step on the step thread without waiting for it (the object itself:
        nothing is serialized). Launching does not wait for the GPU, so step N+1 is queued
        behind step N as on a worker service. Steps sent with it (`then`) queue after it."""
        for step in steps_in(request):
            self._in_flight.append((step.step_id, self._executor.submit(self.runner.launch, step)))

    async def receive(self, step_id: int) -> worker_pb2.StepResponse:
        """The answer to the oldest step in flight; a failure fails the step ('lost' is
        False: there is nothing to reach, the runner is right here)."""
        if not self._in_flight:
            raise WorkerGroupError(f"no step in flight (expected {step_id})", lost=False)
        sent_id, future = self._in_flight.popleft()
        try:
            resp = self.runner.finish(await asyncio.wrap_future(future))
        except StepError as e:
            self.close_streams()
            raise WorkerGroupError(f"step {sent_id}: {e}", lost=False) from e
        except Exception as e:  # noqa: BLE001 - the Engine recovers from a WorkerGroupError
            self.close_streams()
            raise WorkerGroupError(f"step {sent_id}: {type(e).__name__}: {e}", lost=False) from e
        if sent_id != step_id or resp.step_id != step_id:
            self.close_streams()
            raise WorkerGroupError(f"answered step {resp.step_id}, expected {step_id}", lost=False)
        return resp

    async def healthy(self) -> bool:
        return self.runner.kv_cache is not None

    def close_streams(self) -> None:
        """Forget the steps in flight, letting any that already started finish first."""
        while self._in_flight:
            _, future = self._in_flight.popleft()
            future.cancel()
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - it is being discarded
                pass

    async def close(self) -> None:
        """Stop the step thread; the runner (and its KV cache) stays with the caller."""
        self.close_streams()
        self._executor.shutdown(wait=True)
        self.info = None
