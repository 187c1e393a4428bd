"""A worker that computes nothing: same Worker API, a fixed step time, made-up token ids.

It prices and tests the control plane without a GPU: the scheduler cannot tell it from a
real worker. It keeps the same per-sequence state a real worker keeps (block tables,
positions, sampling flags), applies the same checks, and answers the Step stream in
order. Its "device" runs one step at a time for `step_ms` (plus `prefill_us_per_token` for
each token a step computes past one a row: a prefill's price, which what runs beside a
long prefill feels): a step starts when it has
arrived and the previous step has finished (a real worker launches step N+1 the moment
step N's GPU work is done), and is answered when its time is up. So with the scheduler
keeping two steps in flight, the device is never idle unless the control plane is late,
which is exactly what the benchmark measures (gpu_ms = step_ms; idle = wall - gpu).

Sampled ids are a deterministic function of (previous token, position): a sequence's
completion depends only on its prompt's last token and length, never on batching,
preemption or restarts, so tests can predict every token (`expected_tokens`). The
end-of-sequence id is never produced; use ignore_eos=False with a stop_token_ids to end
early. Penalties are accepted and ignored; top_logprobs come back well-formed but made up.
Grammars are followed for real when the model directory has a tokenizer.json (the same
worker_service/grammar.py as the real worker): a constrained row takes the allowed id
that the same hash picks, so the benchmark prices the masks' CPU and tests can check
that every constrained output parses.

No torch here: the benchmark and CI start it in a blink. grpc.aio rather than the
blocking server: on a 2-core benchmark box the worker's own CPU competes with the
control plane it measures, and aio costs about half per step.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

import grpc
import grpc.aio
import numpy as np

from nanoserve.grammar_tokenizer import load_tokenizer
from nanoserve.security import OPEN_WORKER, AsyncGuard, add_port
from nanoserve.worker_group import steps_in
from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service.device_clock import DeviceClock
from worker_service.metrics import WorkerMetrics
from worker_service.grammar import GrammarState
from worker_service.step_plan import SeqTable, StepError, draft_ids

log = logging.getLogger("nanoserve.worker")

MAX_MESSAGE_BYTES = 256 << 20
_MIX = np.uint64(0x9E3779B97F4A7C15)


def next_tokens(prev: np.ndarray, positions: np.ndarray, vocab_size: int, eos_token_id: int
                ) -> np.ndarray:
    """The id sampled after token `prev` at `positions` (both int arrays), never eos."""
    x = (prev.astype(np.uint64) + np.uint64(1)) * _MIX ^ positions.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(31)
    tok = (x % np.uint64(vocab_size - 1)).astype(np.int64)
    return np.where(tok >= eos_token_id, tok + 1, tok).astype(np.int32)


def expected_tokens(prompt: list[int], n: int, vocab_size: int, eos_token_id: int) -> list[int]:
    """The n ids a null worker produces for `prompt` (what a test compares against)."""
    out, prev, pos = [], prompt[-1], len(prompt)
    for _ in range(n):
        prev = int(next_tokens(np.array([prev]), np.array([pos]), vocab_size, eos_token_id)[0])
        out.append(prev)
        pos += 1
    return out


@dataclass
class _Launched:
    t0: float                         # when the request was taken up
    done_at: float                    # when its emulated device time is over
    resp: worker_pb2.StepResponse


NULL_HIDDEN = 1024   # the size of a null worker's embeddings (Qwen3-Embedding-0.6B's)


def _made_up_pooled(plan) -> tuple[bytes, bytes]:
    """(pooled_f32, pooled_sizes_i32) of a plan's pooling rows: a unit vector of the asked
    size for an embedding, 0.5 for a score (worker.proto's WorkerPooling)."""
    sizes = [1 if p.kind == worker_pb2.WorkerPooling.KIND_SCORE else p.dimensions or NULL_HIDDEN
             for p in plan.pooling]
    values = [np.full(n, 0.5 if n == 1 else n ** -0.5, "<f4") for n in sizes]
    return np.concatenate(values).tobytes(), np.asarray(sizes, "<i4").tobytes()


class NullWorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, *, step_ms: float, vocab_size: int, max_model_len: int, eos_token_id: int,
                 num_kv_blocks: int, model: str = "null", model_dir: str | None = None,
                 tasks: tuple[str, ...] = ("generate",), prefill_us_per_token: float = 0.0):
        self.step_s = step_ms / 1e3
        self.token_s = prefill_us_per_token / 1e6
        self.tasks = tasks   # what Info reports (the table takes every row)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.capacity_tokens = num_kv_blocks   # blocks of 16; rescaled per block size in Info
        self.model = model
        self.table: SeqTable | None = None
        self.last_sampled = np.zeros(0, np.int32)   # the last samples (placeholder inputs)
        self.device_free_at = 0.0   # when the emulated device finishes its last step
        self.steps = self.steps_overlapped = 0
        self.metrics = WorkerMetrics()
        self.grammar_tokenizer = (load_tokenizer(model_dir, vocab_size, eos_token_id)
                                  if model_dir else None)
        self.grammar: GrammarState | None = None
        # NANOSERVE_NULL_STEP_LOG=PATH: one line per answered step, "step_id done_at
        # num_sampled" (done_at on time.perf_counter()'s clock, CLOCK_MONOTONIC: the same in
        # every process of the host), so client/step_latency.py can time each token from
        # its step's end to the client.
        path = os.environ.get("NANOSERVE_NULL_STEP_LOG")
        self.step_log = open(path, "a", buffering=1) if path else None

    async def Info(self, request, context):
        block_size = request.block_size or 16
        return worker_pb2.WorkerInfo(
            rank=0, world_size=1, model=self.model, model_fingerprint=f"null-{self.vocab_size}",
            num_kv_blocks=max(self.capacity_tokens * 16 // block_size, 1), block_size=block_size,
            vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id, device="null", dtype="none", attention_backend="none",
            structured_output=self.grammar_tokenizer is not None,
            draft_model="null", task=",".join(self.tasks), hidden_size=NULL_HIDDEN)   # drafts: its own next ids (every one accepted)

    async def Init(self, request, context):
        if request.num_kv_blocks == 0 or request.block_size == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "num_kv_blocks and block_size must be > 0")
        self.table = SeqTable(request.num_kv_blocks, request.block_size, self.vocab_size,
                              self.max_model_len)
        if self.grammar_tokenizer is not None:
            self.grammar = GrammarState(self.grammar_tokenizer, self.vocab_size, self.eos_token_id)
        self.steps = self.steps_overlapped = 0
        self.metrics.initialized(request.num_kv_blocks, request.block_size)
        return worker_pb2.InitResponse(num_kv_blocks=request.num_kv_blocks)

    async def Health(self, request, context):
        ready = self.table is not None
        return worker_pb2.HealthResponse(ready=ready, status="serving" if ready else "waiting for Init",
                                         steps=self.steps, steps_overlapped=self.steps_overlapped)

    async def Step(self, request_iterator, context):
        """Plan each step as it arrives (a real worker launches step N+1 while N runs),
        answer each when its emulated device time is over, in order."""
        answers: asyncio.Queue = asyncio.Queue()

        async def launch() -> None:
            try:
                async for message in request_iterator:
                    for req in steps_in(message):
                        answers.put_nowait(self._launch(req))
            finally:
                answers.put_nowait(None)

        launcher = asyncio.ensure_future(launch())
        clock = DeviceClock()   # asyncio.sleep would answer up to 1 ms late
        try:
            while (item := await answers.get()) is not None:
                if isinstance(item, tuple):   # (status code, message): a bad step
                    await context.abort(*item)
                await clock.until(item.done_at)
                item.resp.step_ms = (time.perf_counter() - item.t0) * 1e3
                if self.step_log is not None:
                    self.step_log.write(f"{item.resp.step_id} {item.done_at:.6f} "
                                        f"{len(item.resp.sampled_token_ids_i32) // 4}\n")
                self.metrics.stepped(item.resp.step_ms, item.resp.gpu_ms)
                yield item.resp
        finally:
            launcher.cancel()
            clock.close()

    def _launch(self, req: worker_pb2.StepRequest):
        t0 = time.perf_counter()
        if self.table is None:
            return grpc.StatusCode.INVALID_ARGUMENT, "Step before Init"
        try:
            plan = self.table.plan(req)
            if self.grammar is not None:
                self.grammar.update(req)
            tokens, want_logprobs = self._sample(plan)
        except StepError as e:
            return grpc.StatusCode.INVALID_ARGUMENT, f"step {req.step_id}: {e}"
        # The device starts once the step is prepared and the previous one is done.
        now = time.perf_counter()
        self.steps += 1
        self.steps_overlapped += t0 < self.device_free_at
        device_s = self.step_s + self.token_s * max(len(plan.token_ids) - len(plan.rows), 0)
        self.device_free_at = max(now, self.device_free_at) + device_s
        pooled = None
        if plan.pool is not None:   # pooling rows answer too: a 0 among the samples
            at = plan.pool_at
            pooled = _made_up_pooled(plan)
            tokens = np.insert(tokens, at - np.arange(len(at)), 0)
        resp = worker_pb2.StepResponse(
            step_id=req.step_id, sampled_token_ids_i32=tokens.astype("<i4").tobytes(),
            logprobs_f32=np.zeros(len(tokens), "<f4").tobytes() if want_logprobs else b"",
            gpu_ms=device_s * 1e3)
        if pooled is not None:
            resp.pooled_f32, resp.pooled_sizes_i32 = pooled
        if plan.drafts is not None:
            resp.draft_token_ids_i32 = draft_ids(self._drafts(plan.drafts, tokens), plan.drafts.k)
        if k := plan.top_logprobs:   # made-up alternatives: the sampled id first, log p 0, -1, ...
            resp.top_logprobs_k = k
            resp.top_token_ids_i32 = ((tokens[:, None].astype(np.int64) + np.arange(k))
                                      % self.vocab_size).astype("<i4").tobytes()
            resp.top_logprobs_f32 = np.tile(-np.arange(k, dtype="<f4"), len(tokens)).tobytes()
        return _Launched(t0, self.device_free_at, resp)

    def _sample(self, plan) -> tuple[np.ndarray, bool]:
        ids = plan.token_ids
        if plan.fill is not None:
            ids = ids.copy()
            ids[plan.fill[0]] = self.last_sampled[plan.fill[1]]
        last = plan.last_token_index()
        tokens = next_tokens(ids[last], plan.positions[last] + 1, self.vocab_size, self.eos_token_id)
        if self.grammar is not None:
            self._constrain(plan, tokens)
        self.table.commit(plan)
        if len(tokens):
            self.last_sampled = tokens
        return tokens, plan.want_logprobs


    def _drafts(self, drafts, tokens: np.ndarray) -> np.ndarray:
        """A draft model that knows this worker's rule: the ids it will sample next."""
        newest, start, k = drafts.settle(tokens, self.table)
        out = np.full((len(k), int(drafts.k.max())), -1, np.int64)
        for i in range(len(k)):
            prev = np.array([tokens[newest[i]]])
            for j in range(int(k[i])):
                prev = next_tokens(prev, np.array([start[i] + j + 1]), self.vocab_size,
                                   self.eos_token_id)
                out[i, j] = prev[0]
        return out

    def _constrain(self, plan, tokens: np.ndarray) -> None:
        """Constrained rows: the allowed id at the place the free id's hash picks."""
        rows = self.grammar.rows(plan.sampling_seq_ids)
        if not rows:
            return
        masks = np.empty((len(rows), self.grammar.words), np.int32)
        self.grammar.fill(rows, masks)
        for j, (i, _) in enumerate(rows):
            words = np.flatnonzero(masks[j])   # only the words with allowed ids: cheap
            bits = np.unpackbits(masks[j, words].view(np.uint8), bitorder="little").reshape(-1, 32)
            w, b = np.nonzero(bits)
            allowed = words[w] * 32 + b
            tokens[i] = allowed[int(tokens[i]) % len(allowed)]
        self.grammar.sampled(rows, lambda: tokens)
        self.grammar.catch_up()


async def serve(servicer: NullWorkerServicer, host: str, port: int, secret: str | None = None,
                credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int]:
    """secret: every RPC but Health needs it (`authorization: Bearer`); credentials: TLS."""
    server = grpc.aio.server(interceptors=[AsyncGuard(secret, OPEN_WORKER)], options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    bound = add_port(server, f"{host}:{port}", credentials)
    await server.start()
    return server, bound


def model_limits(model_dir: str | None) -> dict:
    """vocab size, context length and eos id from a model's config.json (Qwen3-0.6B's
    when no directory is given)."""
    import json
    cfg = {"vocab_size": 151936, "max_position_embeddings": 40960, "eos_token_id": 151645}
    if model_dir:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg.update(json.load(f))
    eos = cfg.get("eos_token_id")
    eos = (eos[0] if isinstance(eos, list) else eos) or 0
    return {"vocab_size": int(cfg["vocab_size"]), "max_model_len": int(cfg["max_position_embeddings"]),
            "eos_token_id": int(eos)}
