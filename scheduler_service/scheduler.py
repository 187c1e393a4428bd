"""Continuous batching: decides what runs each step and folds the sampled tokens back in.

One step is either a prefill batch (new, chunked or resumed sequences: many tokens each)
or a decode batch (running sequences: one token each), or, for a background priority class
(below), a decode batch with prompt chunks beside its rows (a mixed step). Prefill goes
first so new requests join the running batch quickly. When the KV cache runs out during decode, the
newest running sequence is preempted by recompute: its blocks are released and it is
re-prefilled later over all its tokens (prefix-cache hits make that cheap when its old
blocks have not been reused yet).

Same-step prefix sharing: a block is found in the prefix cache only once its KV is computed,
so prompts sharing a prefix (a Score request's documents) admitted to one prefill step would
each compute it. A waiting prompt whose first full block missing from the cache is one that a
prompt already admitted to the step being built computes waits instead (SGLang's in-batch
prefix caching): it keeps its place and runs in the next step, hitting those blocks. Never
the step's first prompt (a step is never left empty), only where a whole block is shared, no
more than the next step holds (max_num_seqs); a sharer aborted meanwhile leaves it to run as
usual.

Many callers (wait_queue.py): the waiting queue is ordered by priority class, then fair
shares between API keys, then arrival. Where priorities differ, a waiting sequence that
finds the batch (max_num_seqs) or the KV cache full preempts the running sequence of the
lowest class, if that class is at least `priority_preemption_gap` below its own (so equal
classes never preempt each other), and the KV pressure of decode preempts the lowest
class first. A prefill step holds one class: a better class's prompt is not made to wait
for a worse class's prompts filling the rest of the token budget. With
`max_background_prefill_tokens` set (off by default: it trades the background's throughput
for the better class's latency), a background class (one below a class with requests alive,
or seen in the last `background_hold_s`) prefills at most that many tokens a step: beside
the running sequences' decode rows (a mixed step; not beside verify rows, nor with a draft
model), so their streams get a token every step, or, with nothing running, in a prefill step
of its own that a decode step follows. A better class's new prompt waits for
one short step, not a full one. A preempted sequence
keeps its tokens and its place: its output is what it would have been. A sequence whose caller's deadline cannot be met any more is dropped
before its prefill (`drain_errors`: DEADLINE_EXCEEDED).

Fast-forward (structured output): where a sequence's grammar forces its next tokens, the
engine core hands them to `fast_forward`: they become known at once, and the next decode
step computes them as extra decode rows of that sequence (one sample, at its last), so a
schema's fixed keys and punctuation cost no step each.

Overlap: a step's results are folded in two halves. `advance` runs as soon as the step is
sent (its KV will exist; each sampling seq gets a PENDING_TOKEN placeholder), so the next
step can be scheduled while the worker computes; `resolve` fills the placeholders when
the sampled ids arrive and applies eos/stop checks one step late. `postprocess` is both
at once. Only seqs whose placeholder comes from the step just sent are decoded (the
worker feeds them the id it sampled on the GPU); a preempted seq with a placeholder
waits for it before re-prefill.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from nanoserve.proposals import accepted_prefix
from scheduler_service.block_manager import BlockManager
from scheduler_service.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from scheduler_service.speculation import Speculator
from scheduler_service.wait_queue import WaitQueue


def _rank(seq: Sequence) -> tuple[int, int]:
    """Who goes first: class, then arrival (the largest is preempted first)."""
    return seq.sampling.priority, seq.order


@dataclass
class SchedulerConfig:
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    eos_token_id: int | None = None
    max_loras: int = 0       # distinct LoRA adapters one step may use (the workers' slots)
    num_host_kv_blocks: int = 0   # the workers' host tier (block_manager.py), 0: none
    # A waiting sequence preempts a running one only if the runner's priority value is at
    # least this much larger (>= 1: equal classes never preempt each other).
    priority_preemption_gap: int = 1
    # Prefill tokens a step for a background class (0: off, the full budget and no decode
    # step between), and how long a better class counts as present after its last request
    # arrived or ended.
    max_background_prefill_tokens: int = 0
    background_hold_s: float = 2.0

    @property
    def max_decode_rows(self) -> int:
        """Rows of one decode step: a sequence each, more for fast-forward tokens."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass
class Batch:
    seqs: list[Sequence]  # each with num_scheduled_tokens set; start position = num_computed_tokens
    is_prefill: bool
    # sample[i]: seqs[i] reaches its last token this step, so the worker samples for it.
    # Fixed at schedule time so postprocess can match `sampled` even if a seq is aborted
    # in between (abort resets its counters).
    sample: list[bool] = field(default_factory=list)
    # Decode: (index into seqs, block id) for each block appended this step, so the
    # workers learn only those (a prefill sends whole tables of new sequences).
    new_blocks: list[tuple[int, int]] = field(default_factory=list)
    seq_ids: list[int] | None = None   # decode: the seqs' ids, once the engine built the step
    # The step's host-tier copies must finish before its forward (block_manager.py: a
    # sequence restored with nothing else to run)
    sync_transfers: bool = False
    # Decode: the tokens proposed for each seq (a verify step), None when none were.
    proposals: list[list[int]] | None = None
    # Decode: per seq, the tokens the workers' draft model proposes after this step (the
    # next step's proposals; speculation.py), None when none asked.
    drafts: list[int] | None = None
    num_rows: int = 0   # decode: rows of the step (a sequence each, more for run-ahead tokens)
    # A mixed step (decode, is_prefill False): its first num_prefill seqs are prompt chunks
    # computed beside the decode rows (new_blocks, num_rows, seq_ids: of the decode part)
    num_prefill: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_scheduled_tokens for seq in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, speculator: Speculator | None = None):
        self.config = config
        self.speculator = speculator   # None: no proposals (speculative decoding off)
        # A verify batch's resolve: per token it gave out, the index of its sample.
        self.resolved_rows: list[int] | None = None
        self.num_kv_stale = 0   # running seqs whose workers hold rejected proposals' KV
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.num_host_kv_blocks)
        self.waiting = WaitQueue()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_priority_preemptions = 0   # of those, made for a waiting higher class
        self.num_deadline_drops = 0
        self._order = itertools.count(1)
        self._priorities: set[int] = set()   # classes seen: preemption by class once 2+
        self._class_live: dict[int, int] = {}      # live requests of each class
        self._class_seen: dict[int, float] = {}    # when each class last arrived or ended
        self._tenants: set[str] = set()      # keys seen: fair-share counting once 2+
        self.errors: list[tuple[int, str, str]] = []   # (seq_id, status code, message)
        self._step_s = 0.0     # smoothed time between schedule() calls (deadline checks)
        self._last_schedule = 0.0
        self.num_fast_forward_mismatches = 0   # in-flight samples that were not the forced token
        self._live: dict[int, Sequence] = {}  # seq_id -> seq, for abort
        self._released: list[int] = []
        self._yield_last = False   # the last step was a prefill that a decode step follows
        self._verify_last = False  # a mixed step's decode part came back a verify step

    # ---- queue management ---------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Rejects one that could never run (it would stall the queue)."""
        cfg = self.config
        if seq.seq_id in self._live:
            raise ValueError(f"seq {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"seq {seq.seq_id} is not a fresh sequence")
        if seq.num_tokens == 0:
            raise ValueError("empty prompt")
        if seq.num_tokens > cfg.max_model_len:
            raise ValueError(f"prompt of {seq.num_tokens} tokens exceeds max_model_len {cfg.max_model_len}")
        if seq.num_blocks(cfg.block_size) > cfg.num_kv_blocks:
            raise ValueError(f"prompt of {seq.num_tokens} tokens exceeds the KV cache")
        opts = seq.sampling
        if opts.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        seq.stop_ids = frozenset(opts.stop_token_ids) | (
            frozenset() if opts.ignore_eos or cfg.eos_token_id is None else {cfg.eos_token_id})
        # max_tokens, the context, or the KV cache (one more token would need a block more
        # than the cache has: it could never run)
        seq.len_limit = min(seq.num_prompt_tokens + opts.max_tokens, cfg.max_model_len,
                            cfg.num_kv_blocks * cfg.block_size + 1)
        self._live[seq.seq_id] = seq
        seq.order = next(self._order)
        self._priorities.add(opts.priority)
        self._class_live[opts.priority] = self._class_live.get(opts.priority, 0) + 1
        self._class_seen[opts.priority] = time.monotonic()
        self._tenants.add(opts.tenant)
        self.waiting.append(seq)
        if self.speculator is not None:
            self.speculator.arrived()

    def abort(self, seq_id: int, reason: str = "abort") -> Sequence | None:
        """Drop a request now, wherever it is; its blocks are free at once."""
        seq = self._live.get(seq_id)
        if seq is not None:
            self._finish(seq, reason)
        return seq

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End a live seq now: out of its queue, blocks freed; a step in flight for it is
        ignored when its result arrives (resolve skips finished seqs)."""
        del self._live[seq.seq_id]
        self._ended(seq)
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self._release(seq)
        seq.num_scheduled_tokens = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _ended(self, seq: Sequence) -> None:
        c = seq.sampling.priority
        self._class_live[c] -= 1
        self._class_seen[c] = time.monotonic()

    def _background(self, priority: int, now: float) -> bool:
        """Whether `priority` is a background class now: max_background_prefill_tokens is
        set and a better class is present (requests of it alive, or one arrived or ended
        within background_hold_s: a caller's next request is on its way)."""
        cfg = self.config
        if not cfg.max_background_prefill_tokens or len(self._priorities) < 2:
            return False
        return any(c < priority and (self._class_live[c]
                                     or now - self._class_seen[c] < cfg.background_hold_s)
                   for c in self._priorities)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drain_errors(self) -> list[tuple[int, str, str]]:
        """(seq_id, status code, message) of sequences the scheduler dropped since the last
        call (a deadline that cannot be met): the engine tells their callers."""
        errors, self.errors = self.errors, []
        return errors

    def recompute_all(self) -> None:
        """The KV cache was lost (a worker restarted): every live sequence goes back to
        waiting, in order, to be re-prefilled from its token ids; placeholders of steps
        that never answered are dropped, and the prefix cache starts empty."""
        live = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        self.block_manager.clear()   # in place: its KV events go on (AllBlocksCleared)
        for seq in live:
            if seq.num_pending_tokens:
                del seq.token_ids[seq.num_tokens - seq.num_pending_tokens:]
                seq.num_pending_tokens = 0
            seq.ahead.clear()
            seq.proposal = []
            seq.kv_stale = False
            seq.status = SequenceStatus.WAITING
            seq.block_table = []
            seq.num_cached_tokens = seq.num_computed_tokens = 0
            seq.num_scheduled_tokens = seq.num_hashed_blocks = 0
            self.waiting.append(seq)
        self._released.clear()
        self.num_kv_stale = 0

    def drain_released(self) -> list[int]:
        """Seq ids whose blocks were released since the last call (workers drop their state)."""
        released, self._released = self._released, []
        return released

    # ---- scheduling ---------------------------------------------------------------

    def schedule(self) -> Batch | None:
        """The next step's batch, or None when nothing can run."""
        now = time.monotonic()
        gap = now - self._last_schedule
        self._last_schedule = now
        if gap < 1.0:   # busy: a step's time, smoothed (an idle gap is not a step)
            self._step_s += (0.1 if self._step_s else 1.0) * (gap - self._step_s)
        batch = None
        if (self.running and self.waiting
                and self._background(self.waiting.head().sampling.priority, now)):
            batch = self._schedule_mixed(self.config.max_background_prefill_tokens)
        if batch is None and self._yield_last and self.running:
            # A flood of pooling requests (embeddings, scores) ends each prefill and leaves
            # nothing running to bound it, and a background class's prompts would hold up a
            # better class's streams: one decode step between such prefills.
            batch = self._schedule_decode()
        if batch is None:
            batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        if batch is None:
            # Decode preempted everything it looked at: those seqs wait, re-prefill them.
            batch = self._schedule_prefill()
        self._yield_last = batch is not None and batch.is_prefill and (
            all(s.sampling.pooling for s in batch.seqs)
            or self._background(batch.seqs[0].sampling.priority, now))
        return batch

    def _schedule_mixed(self, cap: int) -> Batch | None:
        """A decode step of the running sequences with up to `cap` prompt tokens of the
        waiting background class beside them: the better class's streams get a token each
        step while the background's prompts go in (a GPU computes a few hundred prompt
        tokens beside a decode step for little more than the step). The prompts may not
        preempt: the decode part holds the running sequences' blocks."""
        spec = self.speculator
        if spec is not None and spec.config.method == "draft":
            return None   # (the workers' draft model catches up on prompts in steps of their own)
        if self._verify_last:   # the last one was a verify step: the prompts' turn, alone
            self._verify_last = False
            return None
        dec = self._schedule_decode()
        if dec is None or dec.proposals is not None or dec.drafts is not None:
            # (a verify step settles how far each sequence got: nothing beside it)
            self._verify_last = dec is not None
            return dec
        pre = self._schedule_prefill(budget=cap, preempt=False)
        if pre is None:
            return dec
        return Batch(pre.seqs + dec.seqs, is_prefill=False, sample=pre.sample + dec.sample,
                     new_blocks=dec.new_blocks, sync_transfers=pre.sync_transfers,
                     num_rows=dec.num_rows, num_prefill=len(pre.seqs))

    def _schedule_prefill(self, budget: int = 0, preempt: bool = True) -> Batch | None:
        """A prefill step of up to `budget` prompt tokens (0: max_num_batched_tokens);
        preempt False: admit only what fits beside the running sequences."""
        cfg, bm = self.config, self.block_manager
        seqs: list[Sequence] = []
        sample: list[bool] = []
        budget = budget or cfg.max_num_batched_tokens
        # Seqs whose last chunk is scheduled join `running` at once, so len(running)
        # counts them; a chunked seq ends the loop (it used the whole budget).
        adapters: set[int] | None = None   # LoRA adapters running, looked at when needed
        fair = len(self._tenants) > 1
        # Same-step prefix sharing: the hashes of the blocks 0..depth-1 that seqs[:hashed]
        # compute in this step (not cached yet; more are added as deeper ones are asked
        # about), and the seqs deferred for sharing one, out of `waiting` until the end.
        computing: set[int] = set()
        depth = hashed = 0
        deferred: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting.head()
            if seq.sampling.deadline and not seq.block_table and self._expired(seq):
                continue
            if seqs and seq.sampling.priority != seqs[0].sampling.priority:
                break   # one class a step (waiting is ordered by class: the rest is worse)
            if not seqs and self._background(seq.sampling.priority, time.monotonic()):
                budget = min(budget, cfg.max_background_prefill_tokens)
            if seq.num_pending_tokens:
                break  # preempted with a token in flight: re-prefill once it is known
            if seqs and not seq.block_table and (miss := bm.first_miss(seq)) is not None:
                # Its first full block the cache lacks is one this step computes for a seq
                # admitted before it: it waits a step and hits it then, instead of computing
                # it again beside it (SGLang's in-batch prefix caching). Never the step's
                # first seq, so a step is never left empty, and a deferred seq keeps its
                # place: it runs next step. The hashes are the ones allocate and commit use
                # (kept on the seqs), and only those up to the block asked about (chained:
                # equal hashes are at equal places): looking costs next to no hashing.
                i, h = miss
                if i >= depth:
                    for s in seqs[:hashed]:
                        computing.update(bm.hashes_to_commit(
                            s, s.num_computed_tokens + s.num_scheduled_tokens, depth, i + 1))
                    depth = i + 1
                for s in seqs[hashed:]:
                    computing.update(bm.hashes_to_commit(
                        s, s.num_computed_tokens + s.num_scheduled_tokens, 0, depth))
                hashed = len(seqs)
                if h in computing:
                    if len(self.running) + len(deferred) >= cfg.max_num_seqs:
                        break   # a batch of them deferred: the next step is full already
                    self.waiting.remove(seq)
                    deferred.append(seq)
                    continue
            if len(self.running) >= cfg.max_num_seqs and not (preempt and self._make_room(seq)):
                break
            if seq.sampling.adapter_id:   # a step uses at most max_loras adapters: admit
                if adapters is None:      # only while its adapter fits beside the running ones
                    adapters = {s.sampling.adapter_id for s in self.running} - {0}
                if seq.sampling.adapter_id not in adapters and len(adapters) >= cfg.max_loras:
                    break
                adapters.add(seq.sampling.adapter_id)
            if not seq.block_table:  # not mid chunked prefill: needs its blocks first
                while not bm.can_allocate(seq):
                    if not (preempt and self._make_room(seq)):
                        break
                else:
                    bm.allocate(seq)
                if not seq.block_table:
                    break
                if seq.usage_cached_tokens is None:
                    seq.usage_cached_tokens = seq.num_cached_tokens
                    seq.usage_host_cached_tokens = seq.num_host_cached_tokens
                if seq.seq_id in bm.restoring and (seqs or self.running):
                    self.waiting.pin(seq)
                    break   # its KV comes back from the host tier beside this step: next one
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seq.num_scheduled_tokens = chunk
            budget -= chunk
            if fair:
                self.waiting.charge(seq.sampling.tenant, chunk)
            seqs.append(seq)
            is_last_chunk = seq.num_computed_tokens + chunk == seq.num_tokens
            sample.append(is_last_chunk)
            if not is_last_chunk:
                self.waiting.pin(seq)
                break  # stays at the head of `waiting` with its blocks; continued next step
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        if deferred:
            self.waiting.put_back(deferred)
        if not seqs:
            return None
        return Batch(seqs, is_prefill=True, sample=sample,   # nothing else to run: wait for it
                     sync_transfers=any(s.seq_id in bm.restoring for s in seqs))

    def _schedule_decode(self) -> Batch | None:
        cfg, bm = self.config, self.block_manager
        limit = cfg.max_decode_rows
        bs = cfg.block_size
        seqs: list[Sequence] = []
        new_blocks: list[tuple[int, int]] = []
        done: list[Sequence] = []   # every token sampled (pending): nothing left to compute
        rows = 0    # decode rows: one per sequence, more for fast-forward tokens
        spec = self.speculator
        if spec is not None and not spec.active(len(self.running)):
            spec.tick()
            spec = None     # big batches, or a back-off: every sequence decodes overlapped
        proposals: list[list[int]] | None = None
        drafts: list[int] | None = None
        if len(self._priorities) > 1 and bm.num_free_blocks < 2 * len(self.running):
            # highest class first, where blocks may run out: preemption takes the lowest
            self.running = deque(sorted(self.running, key=_rank))
        while self.running and rows < limit:
            seq = self.running.popleft()
            n = len(seq.token_ids)
            if seq.proposal or (seq.num_pending_tokens and n >= seq.len_limit):
                done.append(seq)   # a verify step in flight: how far it got is unknown yet
                continue
            todo = n - seq.num_computed_tokens   # 1, or 1 + forced tokens after a fast-forward
            if todo > 1 and rows and rows + todo > limit:
                self.running.appendleft(seq)     # next step
                break
            proposal: list[int] = []
            ask = 0   # tokens the draft model proposes after this step
            if spec is not None and not seq.num_pending_tokens and spec.eligible(seq):
                room = min(seq.len_limit - n - 1, limit - rows - todo)
                batch_rows = len(self.running) + len(seqs) + 1
                if room > 0:
                    proposal = spec.propose(seq, room, batch_rows)
                ask = spec.num_drafts(seq, seq.len_limit - n - len(proposal) - 1, batch_rows)
            need = n + len(proposal)   # tokens whose KV the step leaves in the cache
            if proposal and -(-need // bs) - len(seq.block_table) > bm.num_free_blocks:
                # proposals never preempt anyone: as many as the free blocks hold
                room = (max(len(seq.block_table), -(-n // bs)) + max(
                    bm.num_free_blocks - max(-(-n // bs) - len(seq.block_table), 0), 0)) * bs - n
                del proposal[max(room, 0):]
                need = n + len(proposal)
            if ask:   # the draft's KV past the newest token: only in blocks held or free
                ask = max(min(ask, (len(seq.block_table) + bm.num_free_blocks) * bs - need), 0)
                need += ask
                if drafts is None:
                    drafts = [0] * len(seqs)
            if proposal:
                if proposals is None:
                    proposals = [[] for _ in seqs]
                seq.proposal = proposal
                todo += len(proposal)
            # BlockManager.can_append / may_append, inlined: this runs for every running
            # sequence every step, and almost never finds one that needs a block.
            if len(seq.block_table) * bs < need:   # its next token(s) need a block
                first = len(new_blocks)
                for _ in range(-(-need // bs) - len(seq.block_table)):
                    while not bm.num_free_blocks and self.running:
                        self._preempt(self.running.pop())  # the newest (of the lowest class)
                    if not bm.num_free_blocks:
                        del new_blocks[first:]
                        seq.proposal = []
                        self._preempt(seq)
                        break
                    new_blocks.append((len(seqs), bm.append_block(seq)))
                else:
                    seq.num_scheduled_tokens = todo
                    seqs.append(seq)
                    if proposals is not None:
                        proposals.append(proposal)
                    if drafts is not None:
                        drafts.append(ask)
                    rows += todo
                continue
            seq.num_scheduled_tokens = todo
            seqs.append(seq)
            if proposals is not None:
                proposals.append(proposal)
            if drafts is not None:
                drafts.append(ask)
            rows += todo
        self.running.extendleft(reversed(seqs + done))  # scheduled ones first, in their order
        if len(self._tenants) > 1:
            for seq in seqs:
                self.waiting.charge(seq.sampling.tenant, seq.num_scheduled_tokens)
        if spec is not None and seqs:
            spec.proposed(proposals is not None or drafts is not None)
        return (Batch(seqs, is_prefill=False, sample=[True] * len(seqs), new_blocks=new_blocks,
                      proposals=proposals, drafts=drafts, num_rows=rows) if seqs else None)

    def wants_sync(self) -> bool:
        """Whether the next step should wait for the one in flight: a sequence that may get
        proposals needs its newest token known first (speculation.py: why that pays)."""
        spec = self.speculator
        return (spec is not None and spec.active(len(self.running))
                and any(spec.eligible(s) for s in self.running))

    def _make_room(self, seq: Sequence) -> bool:
        """Waiting seq finds the batch or the KV cache full: preempt the running sequence
        of the lowest class (the newest of it) if that class is at least the gap below
        seq's. False when there is none (nothing changed)."""
        if len(self._priorities) < 2:
            return False
        floor = seq.sampling.priority + self.config.priority_preemption_gap
        victim = max((s for s in self.running   # not one scheduled in this step, nor a
                      if s.sampling.priority >= floor   # verify in flight
                      and not s.num_scheduled_tokens and not s.proposal), key=_rank, default=None)
        if victim is None:
            return False
        self.running.remove(victim)
        self._preempt(victim)
        self.num_priority_preemptions += 1
        return True

    def _expired(self, seq: Sequence) -> bool:
        """Drop a never-started seq whose caller gives up before a step could answer it:
        the step in flight ends first, then its own (two steps from now). One step was the
        bound before, and a drop then raced the caller's own deadline by at most a step."""
        if seq.num_completion_tokens or seq.usage_cached_tokens is not None \
                or time.monotonic() + 2 * self._step_s < seq.sampling.deadline:
            return False
        self._finish(seq, "deadline")
        self.errors.append((seq.seq_id, "DEADLINE_EXCEEDED",
                             "the request's deadline passed before it could start"))
        self.num_deadline_drops += 1
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_scheduled_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- results ------------------------------------------------------------------

    def postprocess(self, batch: Batch, sampled: list[int],
                    logprobs: list[float] | None = None) -> list[Sequence]:
        """Fold one step's results in; return the seqs that got a token (finished included).

        `sampled` (and `logprobs`, if given) hold one entry per seq with batch.sample set,
        in batch order.
        """
        self.advance(batch)
        return self.resolve(batch, sampled, logprobs)

    def advance(self, batch: Batch) -> None:
        """The step was sent: count its KV as computed, add a placeholder per sampled token.

        Per sequence this is a few integer updates; the BlockManager is called only when a
        block may have become full (once per block_size tokens)."""
        bs = self.block_manager.block_size
        commit = self.block_manager.commit
        for seq, samples in zip(batch.seqs, batch.sample):
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted after schedule(): its result is dropped
            # (proposals' KV counts once resolve knows which were accepted)
            seq.num_computed_tokens += seq.num_scheduled_tokens - len(seq.proposal)
            seq.num_scheduled_tokens = 0
            if samples:
                seq.token_ids.append(PENDING_TOKEN)
                seq.num_pending_tokens += 1
            if min(seq.num_computed_tokens, len(seq.token_ids) - seq.num_pending_tokens) \
                    >= (seq.num_hashed_blocks + 1) * bs:
                commit(seq)

    def resolve(self, batch: Batch, sampled: list[int],
                logprobs: list[float] | None = None) -> list[Sequence]:
        """The step's ids arrived: fill the oldest placeholder of each sampling seq and
        finish seqs; returns the seqs that got a token (`last_resolved_token`)."""
        if batch.proposals is not None:
            return self._resolve_verify(batch, sampled, logprobs)
        self.resolved_rows = None
        samples = batch.sample
        seqs = batch.seqs if all(samples) else [s for s, keep in zip(batch.seqs, samples) if keep]
        if len(sampled) != len(seqs):
            raise ValueError(f"{len(sampled)} sampled ids for {len(seqs)} sampling seqs")
        bs = self.block_manager.block_size
        commit = self.block_manager.commit
        out: list[Sequence] = []
        finished = False
        for k, seq in enumerate(seqs):
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted (or finished) after schedule(): its result is dropped
            if seq.ahead:  # fast-forward knew this one: the worker sampled the forced token
                if sampled[k] != seq.ahead.pop(0):
                    self.num_fast_forward_mismatches += 1
                continue
            if not seq.num_pending_tokens:
                continue
            token = sampled[k]
            ids = seq.token_ids
            pos = len(ids) - seq.num_pending_tokens
            ids[pos] = token
            seq.num_pending_tokens -= 1
            if logprobs is not None and seq.sampling.logprobs:
                seq.logprobs.append(logprobs[k])
            if token in seq.stop_ids and pos - seq.num_prompt_tokens >= seq.sampling.min_tokens:
                reason = "stop"   # (before min_tokens the workers do not sample stop ids)
            elif not seq.num_pending_tokens and len(ids) >= seq.len_limit:
                reason = "length"   # (with placeholders left, a later one decides)
            else:
                reason = None
                if min(seq.num_computed_tokens, pos + 1) >= (seq.num_hashed_blocks + 1) * bs \
                        and seq.block_table:
                    commit(seq)   # blocks that waited for this id
            if reason is not None:
                self._end(seq, pos, reason)
                finished = True
            out.append(seq)
        if finished:
            self._sweep()
        return out

    def _end(self, seq: Sequence, pos: int, reason: str) -> None:
        """seq's token at pos ended it: placeholders of steps it should not have run go,
        its blocks are free (a waiting seq leaves its queue here; the caller sweeps
        `running` once per step)."""
        del seq.token_ids[pos + 1:]
        seq.num_pending_tokens = 0
        del self._live[seq.seq_id]
        self._ended(seq)
        self._release(seq)
        if seq.status is SequenceStatus.WAITING:   # preempted with its last token in flight
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _sweep(self) -> None:
        self.running = deque(s for s in self.running if s.status is not SequenceStatus.FINISHED)

    def _resolve_verify(self, batch: Batch, sampled: list[int],
                        logprobs: list[float] | None) -> list[Sequence]:
        """resolve for a decode step with proposals: seq i has 1 + len(proposals[i]) samples,
        the target's token after each of its rows. The proposals equal to the sample before
        them are accepted, then one sample more; the run is cut where a stop id or the length
        limit ends the sequence. Returns a seq per token given out (resolved_rows: the
        sample each came from), in order."""
        want = sum(1 + len(p) for p in batch.proposals)
        if len(sampled) != want:
            raise ValueError(f"{len(sampled)} sampled ids for {want} verify rows")
        bs = self.block_manager.block_size
        out: list[Sequence] = []
        rows: list[int] = []
        at = 0
        finished = False
        for seq, proposal in zip(batch.seqs, batch.proposals):
            row, at = at, at + 1 + len(proposal)
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted (or finished) after schedule(): its result is dropped
            if seq.ahead:  # fast-forward knew this one: the worker sampled the forced token
                if sampled[row] != seq.ahead.pop(0):
                    self.num_fast_forward_mismatches += 1
                continue
            if not seq.num_pending_tokens:
                continue
            accepted = 0
            if proposal:   # (its only placeholder is this step's: it waited for the last)
                seq.proposal = []
                accepted = accepted_prefix(proposal, sampled, row)
                seq.spec.record(len(proposal), accepted)
                if accepted < len(proposal) and not seq.kv_stale and seq.block_table:
                    seq.kv_stale = True
                    self.num_kv_stale += 1
            ids = seq.token_ids
            reason = None
            for i in range(row, row + accepted + 1):
                token = sampled[i]
                if i == row:   # the oldest placeholder
                    pos = len(ids) - seq.num_pending_tokens
                    ids[pos] = token
                    seq.num_pending_tokens -= 1
                else:          # an accepted proposal's sample: its row's KV holds the proposal
                    pos = len(ids)
                    ids.append(token)
                    if seq.block_table:   # (not if preempted since: it recomputes them all)
                        seq.num_computed_tokens += 1
                out.append(seq)
                rows.append(i)
                if logprobs is not None and seq.sampling.logprobs:
                    seq.logprobs.append(logprobs[i])
                if token in seq.stop_ids and pos - seq.num_prompt_tokens >= seq.sampling.min_tokens:
                    reason = "stop"
                elif not seq.num_pending_tokens and len(ids) >= seq.len_limit:
                    reason = "length"
                if reason is not None:
                    break
            if reason is None:
                if min(seq.num_computed_tokens, len(ids) - seq.num_pending_tokens) \
                        >= (seq.num_hashed_blocks + 1) * bs and seq.block_table:
                    self.block_manager.commit(seq)
                continue
            self._end(seq, pos, reason)
            finished = True
        if finished:
            self._sweep()
        self.resolved_rows = rows
        return out

    def fast_forward(self, seq: Sequence, forced: list[int]) -> list[int]:
        """Tokens seq's grammar forces after its newest known one become known now: the
        sample of its step in flight (if any) is forced[0] (the worker samples that token
        for a fast-forward sequence), the rest are appended, their KV computed by its next
        decode step. Returns the tokens that became known, cut where a stop id or the length
        limit ends the sequence (it is finished then)."""
        if seq.status is SequenceStatus.FINISHED or not forced or seq.num_pending_tokens > 1:
            return []
        # A run longer than a decode step's rows waits: the rest is forced again later.
        forced = forced[:self.config.max_decode_rows - 1]
        ids = seq.token_ids
        known: list[int] = []
        reason = None
        for token in forced:
            if seq.num_pending_tokens:       # the in-flight sample: known before it arrives
                ids[-1] = token
                seq.num_pending_tokens = 0
                seq.ahead.append(token)
            else:
                ids.append(token)
            known.append(token)
            if token in seq.stop_ids:
                reason = "stop"
            elif len(ids) >= seq.len_limit:
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
                break
        return known

    def _release(self, seq: Sequence) -> None:
        if seq.kv_stale:   # its workers' state is dropped (or resent in full)
            seq.kv_stale = False
            self.num_kv_stale -= 1
        if seq.block_table:
            self.block_manager.deallocate(seq)
            self._released.append(seq.seq_id)
