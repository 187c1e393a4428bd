"""The engine loop: schedule -> Step on the workers -> resolve, as one asyncio task.

Requests enter through `add`/`abort` (queued, applied between steps, so the Scheduler
and BlockManager change only at known points). Results leave through `on_output`, once
per step, as one StepOutputs for every sequence that got a token: the engine core turns
that into one message per frontend, the in-process benchmark reads it directly.

A request for n completions (`add_request`) becomes n sibling sequences; all but the
first wait until the first's prompt has been sent, so they find its blocks in the prefix
cache and the prompt is computed once. Sampling penalties travel with a sequence's full
sends only (its token history, once); the workers count what they sample themselves.

Decode steps travel packed (worker.proto's DecodeBatch): the running sequences' ids as
one array, their input tokens only when some are known ids rather than placeholders, and
only the blocks appended this step; the workers keep the rest.

If the worker group fails, every sequence is put back to waiting with its tokens, the
prefix cache is forgotten (the KV bytes are gone), and the loop reconnects and
re-prefills: clients see a pause, not an error.
"""
from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from nanoserve.v1 import worker_pb2
from nanoserve.worker_group import GroupInfo, WorkerGroupError
from scheduler_service import fast_forward
from scheduler_service.fast_forward import FastForward
from scheduler_service.pipeline import MAX_DEPTH, PipelineDepth
from scheduler_service.scheduler import Batch, Scheduler, SchedulerConfig
from scheduler_service.speculation import Speculator, spec_usage
from scheduler_service.sequence import (PENDING_TOKEN, SamplingOptions, Sequence, SequenceStatus,
                                        sibling_options)
from scheduler_service.worker_client import wait_for_group

log = logging.getLogger("nanoserve.scheduler")


def usage(seq: Sequence) -> tuple:
    """A finished seq's usage after its id and reason (ipc.py's finished entries): cached,
    accepted, rejected, host-cached prompt tokens, queue ms."""
    return (seq.usage_cached_tokens or 0, *spec_usage(seq), seq.usage_host_cached_tokens,
            seq.queue_ms)


@dataclass
class StepOutputs:
    """What one step produced: one token for each sequence listed, in order."""
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None           # aligned with token_ids when any seq asked
    # Aligned with token_ids when any seq asked for top_logprobs: (ids, logprobs) of its
    # k alternatives, empty lists for a seq that did not ask.
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    # (seq_id, reason, *usage(seq)): what the request's usage reports
    finished: list[tuple] = field(default_factory=list)
    errors: list[tuple[int, str, str]] = field(default_factory=list)    # (seq_id, status code, message)
    # (seq_id, little-endian float32 bytes): a pooling sequence's answer (its embedding or
    # score), in place of a token; it is in `finished` too
    pooled: list[tuple[int, bytes]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seq_ids or self.finished or self.errors or self.pooled)


@dataclass
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_fast_forward_tokens: int = 0   # of those, known from a grammar without a sample
    num_spec_proposed_tokens: int = 0  # speculative decoding: tokens proposed for verify
    num_spec_accepted_tokens: int = 0  # of those, accepted
    num_verify_steps: int = 0          # decode steps that carried proposals
    num_mixed_steps: int = 0           # decode steps that carried prompt chunks too
    num_spec_runs: int = 0             # (seq, step) pairs with proposals
    spec_accepted_runs: dict[int, int] = field(default_factory=dict)   # accepted -> times
    # Decode-step time breakdown (ms, summed): what the benchmark's idle analysis reads.
    num_decode_steps: int = 0
    num_decode_seqs: int = 0
    decode_wall_ms: float = 0.0
    decode_schedule_ms: float = 0.0
    decode_rpc_ms: float = 0.0
    decode_worker_ms: float = 0.0
    decode_gpu_ms: float = 0.0
    decode_postprocess_ms: float = 0.0


class Engine:
    def __init__(self, group, info: GroupInfo, config: SchedulerConfig,
                 on_output: Callable[[StepOutputs], None], overlap: bool = True,
                 on_health: Callable[[bool], None] | None = None,
                 fast_forward: FastForward | None = None, speculator: Speculator | None = None,
                 max_pipeline_depth: int = MAX_DEPTH):
        self.group = group
        self.fast_forward = fast_forward   # None: constrained sequences sample every token
        self.speculator = speculator       # None: no proposals, predictions ignored
        self.info = info
        self.config = config
        self.scheduler = Scheduler(config, speculator)
        self.on_output = on_output
        self.on_health = on_health or (lambda healthy: None)
        # Steps kept on the workers: 1 without overlap, else chosen from measured times.
        self.pipeline = PipelineDepth(max_depth=max_pipeline_depth if overlap else 1)
        # Whether a step may be sent while two are in flight (see _may_chain).
        self._chained = False
        self.stats = EngineStats()
        self.healthy = True
        self._commands: list[tuple[bool, object]] = []   # (is_add, seq or seq_id)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._known: set[int] = set()    # seq ids whose state the workers hold
        # n > 1: first completion -> its siblings, held back until its prompt is sent.
        self._held: dict[Sequence, list[Sequence]] = {}
        self.queue_times: list[float] = []   # arrival -> first scheduled (s); metrics drain it
        self._step_id = 0

    # ---- requests (from the same event loop) ----------------------------------------

    def add(self, seq: Sequence) -> None:
        self._commands.append((True, seq))
        self._wake.set()

    def add_request(self, seq_id: int, prompt: list[int], sampling: SamplingOptions,
                    arrival_time: float = 0.0, output: list[int] = ()) -> None:
        """A request of sampling.n completions: sibling sequences seq_id + i, sibling i
        seeded with seed + i. Siblings wait until the first one's prompt has been sent to
        the workers, then find its full blocks in the prefix cache: one prefill for all.
        `output`: tokens it generated already (a request resumed after an engine core
        restart; n is 1 then): it re-prefills them, as a preempted sequence does."""
        first = Sequence(seq_id=seq_id, token_ids=prompt, sampling=sampling,
                         arrival_time=arrival_time)
        first.token_ids.extend(output)
        if sampling.n > 1:
            self._held[first] = [
                Sequence(seq_id=seq_id + i, token_ids=prompt, arrival_time=arrival_time,
                         sampling=sibling_options(sampling, i))
                for i in range(1, sampling.n)]
        self.add(first)

    def sequences(self) -> list[Sequence]:
        """Every sequence the engine holds: adds not yet taken in, waiting, running, held
        siblings."""
        s = self.scheduler
        return [*(c for add, c in self._commands if add), *s.waiting, *s.running,
                *self.held_siblings()]

    def held_siblings(self) -> list[Sequence]:
        return [s for sibs in self._held.values() for s in sibs]

    def _release_held(self) -> None:
        """Queue the siblings of every first completion whose prompt is in flight (its
        full blocks are registered in the prefix cache) or that ended before."""
        for first in [f for f in self._held if f.is_finished
                      or f.num_computed_tokens >= f.num_prompt_tokens]:
            for sib in self._held.pop(first):
                self._add_now(sib)

    def abort(self, seq_id: int) -> None:
        self._commands.append((False, seq_id))
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def num_pending(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running) + sum(
            add for add, _ in self._commands) + sum(len(s) for s in self._held.values())

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        rejected = StepOutputs()
        for is_add, item in commands:
            if is_add:
                self._add_now(item, rejected)
            elif self.scheduler.abort(item) is None and self._held:
                for sibs in self._held.values():   # a sibling not queued yet
                    sibs[:] = [s for s in sibs if s.seq_id != item]
            elif self.fast_forward is not None:
                self.fast_forward.drop(item)
        if self._held:
            self._release_held()
        if rejected:
            self.on_output(rejected)

    def _add_now(self, seq: Sequence, rejected: StepOutputs | None = None) -> None:
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            errors = [(seq.seq_id, "INVALID_ARGUMENT", str(e))]
            errors += [(s.seq_id, "INVALID_ARGUMENT", str(e)) for s in self._held.pop(seq, ())]
            if rejected is None:
                self.on_output(StepOutputs(errors=errors))
            else:
                rejected.errors.extend(errors)
            return
        if self.fast_forward is not None and not seq.num_completion_tokens:
            out = StepOutputs()   # what its format forces before any sample: known now,
            self._fast_forward([seq], out)   # computed by its prefill
            if out:
                self.on_output(out)

    # ---- the loop -------------------------------------------------------------------

    @property
    def max_in_flight(self) -> int:
        """The pipeline's depth, plus room for the steps sent together past the second."""
        depth = self.pipeline.depth
        return depth + self.pipeline.per_message - 1 if depth > 2 else depth

    def _may_schedule(self, n: int, queued: int) -> bool:
        """Whether to schedule a step now, with n steps in flight or queued to send. Past
        the second, steps go to the workers `per_message` at a time (one stream write), so
        a new group starts only once that many fit."""
        if n >= self.max_in_flight or (n and self.scheduler.wants_sync()):
            return False
        if n < 2:
            return True
        return self._chained and (queued > 0 or self.max_in_flight - n >= self.pipeline.per_message)

    async def run(self) -> None:
        """Keep up to `max_in_flight` steps on the workers: with 2, step N+1 is scheduled
        and sent while the workers compute step N, so the GPU does not wait for us; at
        short steps more (pipeline.py), each fed the previous one's samples on the worker,
        and sent `per_message` to a message."""
        # (batch, step id, schedule ms, when it was sent)
        in_flight: deque[tuple[Batch, int, float, float]] = deque()
        queued: list[tuple[Batch, worker_pb2.StepRequest, float]] = []   # scheduled, unsent
        last_done = time.perf_counter()
        sent_ms = 0.0   # the engine's time from an answer to the next send (round trip)
        answered = False
        while not self._stop.is_set():
            if self._commands:
                self._apply_commands()
            if not in_flight and not queued and not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.perf_counter()
            if not in_flight and not queued:
                last_done = t0          # idle time between bursts is not step time
            n = len(in_flight) + len(queued)
            batch = self.scheduler.schedule() if self._may_schedule(n, len(queued)) else None
            if self.scheduler.errors:   # dropped before prefill (a deadline): tell the callers
                self._dropped(self.scheduler.drain_errors())
            if batch is not None:
                request = self._build_step(batch)
                self.scheduler.advance(batch)
                if self._held and (batch.is_prefill or batch.num_prefill):
                    self._release_held()
                self._chained = self.pipeline.depth > 2 and self._may_chain(batch)
                queued.append((batch, request, (time.perf_counter() - t0) * 1e3))
                if n >= 2 and len(queued) < self.pipeline.per_message \
                        and self._may_schedule(n + 1, len(queued)):
                    continue   # the next step goes in the same message
            if queued:
                t_sent = time.perf_counter()
                first = queued[0][1]
                if len(queued) > 1:
                    first.then.extend(r for _, r, _ in queued[1:])
                await self.group.send(first)
                in_flight.extend((b, r.step_id, ms, t_sent) for b, r, ms in queued)
                queued.clear()
                if answered:   # the engine's part of a round trip, after folding an answer in
                    sent_ms = (t_sent - last_done) * 1e3
                    answered = False
            if not in_flight or (batch is not None and len(in_flight) < self.max_in_flight):
                continue
            oldest, step_id, schedule_ms, t_sent = in_flight.popleft()
            t1 = time.perf_counter()
            try:
                resp = await self.group.receive(step_id)
            except WorkerGroupError as e:
                await self._recover([oldest] + [b for b, *_ in in_flight], e)
                in_flight.clear()
                self._chained = False
                continue
            t2 = time.perf_counter()
            outputs = self._finish_step(oldest, resp)
            t3 = time.perf_counter()
            if oldest.num_prefill:
                self.stats.num_mixed_steps += 1
            if not oldest.is_prefill:   # counted before clients hear of the step
                if self.speculator is not None and not oldest.num_prefill \
                        and self._plain_rows(oldest):
                    self.speculator.cost.observe(oldest.num_rows, resp.gpu_ms or resp.step_ms)
                s = self.stats
                s.num_decode_steps += 1
                s.num_decode_seqs += len(oldest.seqs)
                s.decode_wall_ms += (t3 - last_done) * 1e3
                s.decode_schedule_ms += schedule_ms
                s.decode_rpc_ms += (t2 - t1) * 1e3
                s.decode_worker_ms += resp.step_ms
                s.decode_gpu_ms += resp.gpu_ms
                s.decode_postprocess_ms += (t3 - t2) * 1e3
                self.pipeline.observe((t3 - t_sent) * 1e3 - resp.step_ms + sent_ms,
                                      resp.gpu_ms or resp.step_ms)
            if outputs:
                self.on_output(outputs)
            last_done = t3
            answered = True

    def _dropped(self, errors: list[tuple[int, str, str]]) -> None:
        if self.fast_forward is not None:
            for seq_id, _, _ in errors:
                self.fast_forward.drop(seq_id)
        self.on_output(StepOutputs(errors=errors))

    def _may_chain(self, batch: Batch) -> bool:
        """Whether the next step may be sent before the answer of the one before `batch`
        (a third step in flight). Its placeholder inputs (-1) name the samples of the step
        sent last, so every running sequence still waiting for a sample must be in `batch`:
        a decode step of all of them (a prefill step's sequences and one skipped by a
        decode step wait for their samples first). Not with proposals or drafts (verify
        steps settle how far a sequence got) nor grammars (fast-forward and the masks
        want each token known a step after its sample, as DESIGN.md plans)."""
        return (not batch.is_prefill and not batch.num_prefill and batch.proposals is None
                and batch.drafts is None
                and len(batch.seqs) == len(self.scheduler.running)
                and not any(s.sampling.grammar for s in batch.seqs))

    def _build_step(self, batch: Batch) -> worker_pb2.StepRequest:
        self._step_id += 1
        req = worker_pb2.StepRequest(step_id=self._step_id)
        bm = self.scheduler.block_manager
        if bm.transfers:   # host-tier copies (block_manager.py), beside this step's forward
            ops, sync = bm.take_transfers()
            req.kv_transfers_i32 = array("i", [v for t in ops for v in t]).tobytes()
            req.kv_transfers_sync = sync or batch.sync_transfers
        known = self._known
        released = [s for s in self.scheduler.drain_released() if s in known]
        if released:
            known.difference_update(released)
            req.drop_seq_ids.extend(released)
        if not batch.is_prefill:
            if batch.num_prefill:   # a mixed step: prompt chunks beside the decode rows
                self._add_prefill(req, batch.seqs[:batch.num_prefill],
                                  batch.sample[:batch.num_prefill])
            seqs = batch.seqs[batch.num_prefill:]
            ids = [s.seq_id for s in seqs]
            # (the outputs' fast path reads seq_ids as every sampling seq in order)
            batch.seq_ids = None if batch.num_prefill else ids
            req.decode.seq_ids_u64 = array("Q", ids).tobytes()
            if batch.num_rows == len(seqs):
                inputs = array("i", [s.token_ids[-1] for s in seqs])
            else:   # fast-forward / proposals: a sequence's uncomputed tokens, each a decode row
                inputs = array("i", [t for s in seqs for t in s.token_ids[s.num_computed_tokens:]
                                     + s.proposal])
                req.decode.num_tokens_i32 = array("i", [s.num_scheduled_tokens for s in seqs]).tobytes()
            if batch.proposals is not None:   # a verify step: each proposal row samples too
                req.decode.num_samples_i32 = array("i", [1 + len(p) for p in batch.proposals]).tobytes()
            if batch.drafts is not None:      # the draft model proposes for the next step
                req.decode.num_drafts_i32 = array("i", batch.drafts).tobytes()
            if self.scheduler.num_kv_stale:   # rejected proposals of a last step: rewind
                stale = [(i, s.num_computed_tokens) for i, s in enumerate(seqs) if s.kv_stale]
                req.decode.kv_len_i32 = array("i", [x for pair in stale for x in pair]).tobytes()
                for i, _ in stale:
                    seqs[i].kv_stale = False
                self.scheduler.num_kv_stale -= len(stale)
            if inputs.count(PENDING_TOKEN) != len(inputs):   # some ids already known
                req.decode.token_ids_i32 = inputs.tobytes()
            if batch.new_blocks:
                req.decode.new_blocks_i32 = array("i", [x for pair in batch.new_blocks
                                                        for x in pair]).tobytes()
            return req
        self._add_prefill(req, batch.seqs, batch.sample)
        return req

    def _add_prefill(self, req: worker_pb2.StepRequest, seqs: list[Sequence],
                     sample: list[bool]) -> None:
        """The step's prompt chunks: each seq's tokens, and its table and sampling the
        first time the workers see it."""
        known = self._known
        tokens = array("i")
        now = time.monotonic()
        for seq, samples in zip(seqs, sample):
            if seq.arrival_time:
                self.queue_times.append(now - seq.arrival_time)
                seq.queue_ms = (now - seq.arrival_time) * 1e3
                seq.arrival_time = 0.0
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            tokens.extend(seq.token_ids[start:start + n])
            work = req.seqs.add(seq_id=seq.seq_id, num_tokens=n, start_pos=start, sample=samples)
            if seq.seq_id not in known:
                known.add(seq.seq_id)
                work.reset_block_table = True
                work.block_table_i32 = array("i", seq.block_table).tobytes()
                s = seq.sampling
                work.adapter_id = s.adapter_id
                if s.pooling:   # answers its pooled hidden state, not a sample
                    work.pooling.kind = s.pooling
                    work.pooling.dimensions = s.dimensions
                    if s.score_ids:
                        work.pooling.yes_token_id, work.pooling.no_token_id = s.score_ids
                work.sampling.temperature = s.temperature
                work.sampling.top_p = s.top_p
                work.sampling.top_k = s.top_k
                work.sampling.min_p = s.min_p
                work.sampling.has_seed = s.seed is not None
                work.sampling.seed = s.seed or 0
                work.sampling.logprobs = s.logprobs
                work.sampling.top_logprobs = s.top_logprobs
                p = seq.num_prompt_tokens
                if s.has_penalty:   # the worker needs the whole history, cached part included
                    work.sampling.repetition_penalty = s.repetition_penalty
                    work.sampling.presence_penalty = s.presence_penalty
                    work.sampling.frequency_penalty = s.frequency_penalty
                    work.prompt_ids_i32 = array("i", seq.token_ids[:p]).tobytes()
                if s.grammar:       # the grammar's state is rebuilt from the output so far
                    work.sampling.grammar = s.grammar
                    work.sampling.fast_forward = (self.fast_forward is not None
                                                  and fast_forward.eligible(seq))
                if s.has_penalty or s.grammar:
                    work.output_ids_i32 = array("i", seq.token_ids[p:]).tobytes()
                if s.logit_bias:
                    ids, biases = zip(*s.logit_bias)
                    work.sampling.logit_bias_ids_i32 = array("i", ids).tobytes()
                    work.sampling.logit_bias_f32 = array("f", biases).tobytes()
                if s.min_tokens and seq.stop_ids:   # until then the worker samples none
                    work.sampling.banned_ids_i32 = array("i", sorted(seq.stop_ids)).tobytes()
                    work.sampling.banned_until = p + s.min_tokens
        req.token_ids_i32 = tokens.tobytes()

    def _finish_step(self, batch: Batch, resp: worker_pb2.StepResponse) -> StepOutputs:
        """Fold the step's ids in; the outputs for clients (posted by the caller)."""
        sampled = array("i")
        sampled.frombytes(resp.sampled_token_ids_i32)
        logprobs = None
        if resp.logprobs_f32:
            lp = array("f")
            lp.frombytes(resp.logprobs_f32)
            logprobs = lp.tolist()
        tokens = sampled.tolist()
        done = self.scheduler.resolve(batch, tokens, logprobs)
        pooled = self._pooled(batch, resp, done) if resp.pooled_sizes_i32 else None
        if pooled is not None:   # their "token" is a 0 standing in for the answer
            done = [s for s in done if not s.sampling.pooling]
        if batch.drafts is not None:
            self._take_drafts(batch, resp)
        rows = self.scheduler.resolved_rows   # a verify step: the sample of each token
        self.stats.num_steps += 1
        self.stats.num_generated_tokens += len(done)
        if rows is not None:
            out = StepOutputs(seq_ids=[s.seq_id for s in done], token_ids=[tokens[i] for i in rows])
            self.stats.num_verify_steps += 1
            self._count_verified(batch)
        elif batch.seq_ids and len(done) == len(batch.seqs):   # a decode step, nothing dropped
            out = StepOutputs(seq_ids=batch.seq_ids, token_ids=tokens)
        else:
            out = StepOutputs(seq_ids=[s.seq_id for s in done],
                              token_ids=[s.last_resolved_token for s in done])
        if logprobs is not None:
            out.logprobs = ([logprobs[i] if s.sampling.logprobs else 0.0 for s, i in zip(done, rows)]
                            if rows is not None else
                            [s.logprobs[-1] if s.sampling.logprobs and s.logprobs else 0.0
                             for s in done])
        if resp.top_logprobs_k:
            out.top_logprobs = self._top_logprobs(batch, resp, done, rows)
        if rows is not None:
            done = list(dict.fromkeys(done))   # a seq per token: finished once
        out.finished = [(s.seq_id, s.finish_reason, *usage(s))
                        for s in done if s.status is SequenceStatus.FINISHED]
        if pooled is not None:
            out.finished += [(s.seq_id, "stop", *usage(s)) for s, _ in pooled]
            out.pooled = [(s.seq_id, v) for s, v in pooled]
        if self.fast_forward is not None:
            self._fast_forward(done, out)
        return out

    @staticmethod
    def _pooled(batch: Batch, resp: worker_pb2.StepResponse, done: list[Sequence]
                ) -> list[tuple[Sequence, bytes]]:
        """The pooling sequences that ended this step and their answers (worker.proto's
        pooled_f32: one run of floats each, in request order), those aborted since left out."""
        sizes = array("i")
        sizes.frombytes(resp.pooled_sizes_i32)
        seqs = [s for s, answers in zip(batch.seqs, batch.sample) if answers and s.sampling.pooling]
        if len(sizes) != len(seqs):
            raise ValueError(f"{len(sizes)} pooled answers for {len(seqs)} pooling seqs")
        ended = {id(s) for s in done}
        out, at, raw = [], 0, resp.pooled_f32
        for seq, n in zip(seqs, sizes):
            if id(seq) in ended:
                out.append((seq, raw[at:at + 4 * n]))
            at += 4 * n
        return out

    def _fast_forward(self, done: list[Sequence], out: StepOutputs) -> None:
        """Tokens the grammars of `done` force next: known now, sent with this step's."""
        ff = self.fast_forward
        seq_ids: list[int] = []
        token_ids: list[int] = []
        for seq in done:
            if seq.status is SequenceStatus.FINISHED:
                ff.drop(seq.seq_id)
                continue
            if not fast_forward.eligible(seq):
                continue
            known = self.scheduler.fast_forward(seq, ff.forced(seq))
            if not known:
                continue
            seq_ids += [seq.seq_id] * len(known)
            token_ids += known
            if seq.status is SequenceStatus.FINISHED:
                ff.drop(seq.seq_id)
                out.finished.append((seq.seq_id, seq.finish_reason, *usage(seq)))
        if not seq_ids:
            return
        # out.seq_ids may be the batch's own list: extended as a copy, once per step
        out.seq_ids = [*out.seq_ids, *seq_ids]
        out.token_ids = [*out.token_ids, *token_ids]
        if out.logprobs is not None:
            out.logprobs.extend([0.0] * len(seq_ids))
        if out.top_logprobs is not None:
            out.top_logprobs.extend([([], [])] * len(seq_ids))
        self.stats.num_generated_tokens += len(seq_ids)
        self.stats.num_fast_forward_tokens += len(seq_ids)

    def _take_drafts(self, batch: Batch, resp: worker_pb2.StepResponse) -> None:
        """The draft model's proposals (k per seq that asked, in order) onto the seqs: the
        next step sends them (Speculator.propose)."""
        ids = array("i")
        ids.frombytes(resp.draft_token_ids_i32)
        want = sum(batch.drafts)
        if len(ids) != want:
            raise ValueError(f"{len(ids)} draft ids for {want} asked")
        at = 0
        for seq, k in zip(batch.seqs, batch.drafts):
            if k and seq.status is not SequenceStatus.FINISHED and not seq.num_pending_tokens:
                Speculator.take_drafts(seq, ids[at:at + k].tolist())
            at += k

    def _plain_rows(self, batch: Batch) -> bool:
        """Whether a decode step's time is its rows' cost (speculation's StepCost): not where
        a format's masks or penalties add work of their own. (Checked only in batches small
        enough to speculate: bigger ones are timed as they come, an O(batch) scan spared.)"""
        seqs = batch.seqs
        return len(seqs) > self.speculator.config.max_batch or not any(
            s.sampling.grammar or s.sampling.has_penalty for s in seqs)

    def _count_verified(self, batch: Batch) -> None:
        """Proposed / accepted totals and the accepted-run histogram of a verify step."""
        s = self.stats
        for seq, proposal in zip(batch.seqs, batch.proposals):
            if proposal and seq.spec is not None:
                accepted = seq.spec.last_accepted
                s.num_spec_proposed_tokens += len(proposal)
                s.num_spec_accepted_tokens += accepted
                s.num_spec_runs += 1
                s.spec_accepted_runs[accepted] = s.spec_accepted_runs.get(accepted, 0) + 1

    @staticmethod
    def _top_logprobs(batch: Batch, resp: worker_pb2.StepResponse, done: list[Sequence],
                      rows: list[int] | None = None) -> list[tuple[list[int], list[float]]]:
        """Each seq's own k alternatives out of the step's [rows, K] arrays (rows: a verify
        step's sample for each entry of done)."""
        k_all = resp.top_logprobs_k
        ids = array("i")
        ids.frombytes(resp.top_token_ids_i32)
        lps = array("f")
        lps.frombytes(resp.top_logprobs_f32)
        row = {id(s): i for i, s in enumerate(s for s, keep in zip(batch.seqs, batch.sample) if keep)}
        out = []
        for j, s in enumerate(done):
            k = min(s.sampling.top_logprobs, k_all)
            start = (rows[j] if rows is not None else row[id(s)]) * k_all
            out.append((ids[start:start + k].tolist(), lps[start:start + k].tolist()))
        return out

    async def _recover(self, batches: list[Batch], err: WorkerGroupError) -> None:
        """Put every sequence back to waiting and reconnect; fail only on a step error."""
        log.error("worker group failed: %s", err)
        self.healthy = False
        self.on_health(False)
        failed = [] if err.lost else list({id(s): s for b in batches for s in b.seqs
                                           if s.status != SequenceStatus.FINISHED}.values())
        for seq in failed:
            self.scheduler.abort(seq.seq_id)
            if self.fast_forward is not None:
                self.fast_forward.drop(seq.seq_id)
        if failed:
            self.on_output(StepOutputs(errors=[(s.seq_id, "INTERNAL", str(err)) for s in failed]))
        self.scheduler.recompute_all()   # the workers' KV is gone
        self._known.clear()
        try:
            self.info = await wait_for_group(self.group, self.config.block_size,
                                             self.config.num_kv_blocks, stop=self._stop)
        except WorkerGroupError as e:
            log.error("giving up on the worker group: %s", e)
            return
        self.healthy = True
        self.on_health(True)
        log.info("worker group back; re-prefilling %d sequences", len(self.scheduler.waiting))
