"""The engine loop: schedule -> Step on the workers -> postprocess, on its own thread.

Requests enter through `submit`/`abort` from any thread (the gRPC event loop); the loop
applies them between steps, so the Scheduler and BlockManager are touched by one thread
only. Results leave through a callback once per step, batched, so the event loop wakes
once per step rather than once per token.

If the worker group fails, every sequence is put back to waiting with its tokens, the
prefix cache is forgotten (the KV bytes are gone), and the loop reconnects and re-prefills:
clients see a pause, not an error.
"""
from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Callable

from nanoserve.v1 import worker_pb2
from scheduler_service.scheduler import Batch, Scheduler, SchedulerConfig
from scheduler_service.sequence import Sequence, SequenceStatus
from scheduler_service.worker_client import GroupInfo, WorkerGroup, WorkerGroupError, wait_for_group

log = logging.getLogger("nanoserve.scheduler")


@dataclass
class SeqUpdate:
    """What one step produced for one sequence."""
    seq_id: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None      # "stop" | "length" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None       # the request failed (INTERNAL)

    def merged(self, later: "SeqUpdate") -> "SeqUpdate":
        """This update followed by a later one of the same sequence, as one."""
        return SeqUpdate(self.seq_id, self.token_ids + later.token_ids,
                         self.logprobs + later.logprobs,
                         later.finish_reason or self.finish_reason, later.num_prompt_tokens,
                         later.num_cached_tokens, self.error or later.error)


@dataclass
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    # Decode-step time breakdown (ms, summed): what the benchmark's idle analysis reads.
    num_decode_steps: int = 0
    num_decode_seqs: int = 0
    decode_wall_ms: float = 0.0
    decode_schedule_ms: float = 0.0
    decode_rpc_ms: float = 0.0
    decode_worker_ms: float = 0.0
    decode_gpu_ms: float = 0.0
    decode_postprocess_ms: float = 0.0


def _i32(values) -> bytes:
    return array("i", values).tobytes()   # native order: little-endian on every host we run


class Engine:
    def __init__(self, group: WorkerGroup, info: GroupInfo, config: SchedulerConfig,
                 on_updates: Callable[[list[SeqUpdate]], None], overlap: bool = True):
        self.group = group
        self.info = info
        self.config = config
        self.scheduler = Scheduler(config)
        self.on_updates = on_updates
        self.max_in_flight = 2 if overlap else 1
        self.stats = EngineStats()
        self.healthy = True
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._sent_blocks: dict[int, int] = {}    # seq_id -> blocks the workers know
        self._step_id = 0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ---- called from other threads --------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        self._post("add", seq)

    def abort(self, seq_id: int) -> None:
        self._post("abort", seq_id)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout)

    def num_pending(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running) + len(self._inbox)

    def _post(self, kind: str, item: object) -> None:
        with self._wake:
            self._inbox.append((kind, item))
            self._wake.notify()

    # ---- the loop -------------------------------------------------------------------

    def _run(self) -> None:
        """Keep up to `max_in_flight` steps on the workers: with 2, step N+1 is scheduled
        and sent while the workers compute step N, so the GPU does not wait for us."""
        in_flight: deque[tuple[Batch, int, float]] = deque()   # (batch, step id, schedule ms)
        last_done = time.perf_counter()
        while not self._stop.is_set():
            self._drain_inbox()
            if not in_flight and not self.scheduler.has_work():
                with self._wake:
                    if not self._inbox and not self._stop.is_set():
                        self._wake.wait(timeout=0.5)
                continue
            t0 = time.perf_counter()
            if not in_flight:
                last_done = t0          # idle time between bursts is not step time
            batch = self.scheduler.schedule() if len(in_flight) < self.max_in_flight else None
            if batch is not None:
                request = self._build_step(batch)
                self.group.send(request)
                self.scheduler.advance(batch)
                in_flight.append((batch, request.step_id, (time.perf_counter() - t0) * 1e3))
            if not in_flight or (batch is not None and len(in_flight) < self.max_in_flight):
                continue
            oldest, step_id, schedule_ms = in_flight.popleft()
            t1 = time.perf_counter()
            try:
                resp = self.group.receive(step_id)
            except WorkerGroupError as e:
                self._recover([oldest] + [b for b, _, _ in in_flight], e)
                in_flight.clear()
                continue
            t2 = time.perf_counter()
            updates = self._finish_step(oldest, resp)
            t3 = time.perf_counter()
            if not oldest.is_prefill:   # counted before clients hear of the step
                s = self.stats
                s.num_decode_steps += 1
                s.num_decode_seqs += len(oldest.seqs)
                s.decode_wall_ms += (t3 - last_done) * 1e3
                s.decode_schedule_ms += schedule_ms
                s.decode_rpc_ms += (t2 - t1) * 1e3
                s.decode_worker_ms += resp.step_ms
                s.decode_gpu_ms += resp.gpu_ms
                s.decode_postprocess_ms += (t3 - t2) * 1e3
            if updates:
                self.on_updates(updates)
            last_done = t3

    def _drain_inbox(self) -> None:
        with self._wake:
            items, self._inbox = list(self._inbox), deque()
        for kind, item in items:
            if kind == "add":
                self.scheduler.add(item)
            else:
                self.scheduler.abort(item)

    def _build_step(self, batch: Batch) -> worker_pb2.StepRequest:
        self._step_id += 1
        req = worker_pb2.StepRequest(step_id=self._step_id)
        for seq_id in self.scheduler.drain_released():
            if self._sent_blocks.pop(seq_id, None) is not None:
                req.drop_seq_ids.append(seq_id)
        bs = self.config.block_size
        tokens: list[int] = []
        slots: list[int] = []
        for seq in batch.seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            tokens.extend(seq.token_ids[start:start + n])
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            known = self._sent_blocks.get(seq.seq_id)
            work = req.seqs.add(seq_id=seq.seq_id, num_tokens=n, start_pos=start,
                                sample=start + n == seq.num_tokens)
            if known is None:
                work.reset_block_table = True
                work.block_table_i32 = _i32(table)
                s = seq.sampling
                work.sampling.temperature = s.temperature
                work.sampling.top_p = s.top_p
                work.sampling.top_k = s.top_k
                work.sampling.min_p = s.min_p
                work.sampling.has_seed = s.seed is not None
                work.sampling.seed = s.seed or 0
                work.sampling.logprobs = s.logprobs
            elif known < len(table):
                work.block_table_i32 = _i32(table[known:])
            self._sent_blocks[seq.seq_id] = len(table)
        req.token_ids_i32 = _i32(tokens)
        req.slot_mapping_i32 = _i32(slots)
        return req

    def _finish_step(self, batch: Batch, resp: worker_pb2.StepResponse) -> list[SeqUpdate]:
        """Fold the step's ids in; the updates for clients (posted by the caller)."""
        sampled = array("i")
        sampled.frombytes(resp.sampled_token_ids_i32)
        logprobs = None
        if resp.logprobs_f32:
            lp = array("f")
            lp.frombytes(resp.logprobs_f32)
            logprobs = lp.tolist()
        done = self.scheduler.resolve(batch, sampled.tolist(), logprobs)
        self.stats.num_steps += 1
        self.stats.num_generated_tokens += len(done)
        updates = [SeqUpdate(
            seq_id=s.seq_id, token_ids=[s.last_resolved_token],
            logprobs=[s.logprobs[-1]] if s.sampling.logprobs and s.logprobs else [],
            finish_reason=s.finish_reason if s.status == SequenceStatus.FINISHED else None,
            num_prompt_tokens=s.num_prompt_tokens, num_cached_tokens=s.usage_cached_tokens or 0)
            for s in done]
        return updates

    def _recover(self, batches: list[Batch], err: WorkerGroupError) -> None:
        """Put every sequence back to waiting and reconnect; fail only on a step error."""
        log.error("worker group failed: %s", err)
        self.healthy = False
        failed = [] if err.lost else list({id(s): s for b in batches for s in b.seqs
                                           if s.status != SequenceStatus.FINISHED}.values())
        for seq in failed:
            self.scheduler.abort(seq.seq_id)
        if failed:
            self.on_updates([SeqUpdate(s.seq_id, [], [], None, s.num_prompt_tokens,
                                       s.usage_cached_tokens or 0, error=str(err)) for s in failed])
        self.scheduler.recompute_all()   # the workers' KV is gone
        self._sent_blocks.clear()
        try:
            self.info = wait_for_group(self.group, self.config.block_size,
                                       self.config.num_kv_blocks, stop=self._stop)
        except WorkerGroupError as e:
            log.error("giving up on the worker group: %s", e)
            return
        self.healthy = True
        log.info("worker group back; re-prefilling %d sequences", len(self.scheduler.waiting))
