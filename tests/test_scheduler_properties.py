"""Property-based tests: random interleavings of add / step / abort against invariants.

The test keeps a model of the KV cache's *bytes*: slot (block, offset) holds the token
prefix whose last token's KV was written there. A step may read only slots holding
exactly the sequence's own prefix (that is what makes a prefix-cache hit correct) and
may write only blocks no one else holds. Every scenario also runs with the block hash
forced to a constant, where only the exact verification keeps hits correct.
"""
import math
import random
from collections import Counter
from contextlib import nullcontext
from unittest import mock

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from scheduler_service import block_manager as bm_module
from scheduler_service.scheduler import Batch, Scheduler, SchedulerConfig
from scheduler_service.sequence import PENDING_TOKEN, SamplingOptions, Sequence, SequenceStatus

VOCAB = 3  # tiny, so prompts, generated tails and hashes collide often
EOS = 3    # sampled now and then, outside the prompt vocabulary
STOP = 4


def colliding(enabled: bool):
    return mock.patch.object(bm_module, "compute_hash", lambda tokens, prefix: 7) if enabled else nullcontext()


any_configs = st.builds(
    SchedulerConfig,
    num_kv_blocks=st.integers(1, 12),
    block_size=st.integers(1, 8),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 24),
    max_model_len=st.integers(2, 48),
    eos_token_id=st.sampled_from([None, EOS]),
)
# Several long-lived sequences in a small cache: decode runs out of blocks and preempts.
tight_configs = st.builds(
    SchedulerConfig,
    num_kv_blocks=st.integers(3, 8),
    block_size=st.integers(1, 4),
    max_num_seqs=st.integers(2, 4),
    max_num_batched_tokens=st.integers(4, 32),
    max_model_len=st.just(64),
    eos_token_id=st.none(),
)
configs = st.one_of(any_configs, tight_configs)
# A prompt is a prefix of one shared "system prompt" plus its own tail.
base_prompts = st.lists(st.integers(0, VOCAB - 1), min_size=16, max_size=16)
add_ops = st.tuples(st.just("add"), st.integers(0, 16), st.lists(st.integers(0, VOCAB - 1), max_size=4),
                    st.integers(1, 24), st.booleans(), st.sampled_from([(), (STOP,)]))
step_ops = st.tuples(st.just("step"), st.integers(0, 2**32 - 1),
                     st.one_of(st.none(), st.none(), st.none(), st.integers(0, 7)))
abort_ops = st.tuples(st.just("abort"), st.integers(0, 63))
op_lists = st.lists(st.one_of(add_ops, step_ops, step_ops, step_ops, abort_ops), min_size=20, max_size=60)


def sample_token(rng: random.Random) -> int:
    return rng.randrange(VOCAB) if rng.random() < 0.95 else rng.choice((EOS, STOP))


class KVModel:
    """What the workers' KV cache would hold, slot by slot."""

    def __init__(self, sched: Scheduler, tokens_of=lambda seq: seq.token_ids):
        self.sched = sched
        self.tokens_of = tokens_of   # the ids the worker sees (placeholders filled in)
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def run(self, batch: Batch) -> None:
        """Check a batch's reads and perform its writes."""
        bm, bs = self.sched.block_manager, self.sched.config.block_size
        if batch.is_prefill and not all(batch.sample):
            event("chunked prefill")
        for seq in batch.seqs:
            if seq.num_cached_tokens:
                event("prefix-cache hit")
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            tokens = self.tokens_of(seq)
            assert n >= 1 and start + n <= seq.num_tokens
            assert len(seq.block_table) >= math.ceil((start + n) / bs)
            for p in range(start):  # attention reads every earlier position
                assert self.slots.get((seq.block_table[p // bs], p % bs)) == tuple(tokens[:p + 1])
            for p in range(start, start + n):
                block = bm.blocks[seq.block_table[p // bs]]
                assert block.ref_count == 1, "writing into a shared block"
                assert block.hash is None, "writing into a registered block"
                self.slots[(block.block_id, p % bs)] = tuple(tokens[:p + 1])


def check_batch(sched: Scheduler, batch: Batch) -> None:
    cfg = sched.config
    assert len(batch.seqs) == len(batch.sample) == len(set(map(id, batch.seqs)))
    assert 1 <= len(batch.seqs) <= cfg.max_num_seqs
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    for seq, samples in zip(batch.seqs, batch.sample):
        assert samples == (seq.num_computed_tokens + seq.num_scheduled_tokens == seq.num_tokens)
        if not batch.is_prefill:
            assert seq.num_scheduled_tokens == 1 and seq.status is SequenceStatus.RUNNING
    if batch.is_prefill:  # only the last seq may be a partial chunk
        assert all(batch.sample[:-1])


def check_invariants(sched: Scheduler, kv: KVModel) -> None:
    bm, cfg, bs = sched.block_manager, sched.config, sched.config.block_size
    live = list(sched.waiting) + list(sched.running)
    assert len({s.seq_id for s in live}) == len(live)
    assert all(s.status is SequenceStatus.WAITING for s in sched.waiting)
    assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
    assert len(sched.running) <= cfg.max_num_seqs

    # Blocks: free xor used, ref counts = holders, counts add up.
    holders = Counter(b for s in live for b in s.block_table)
    free = set(bm.free_block_ids)
    assert len(free) == len(bm.free_block_ids) == bm.num_free_blocks
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id] >= 0
        assert (block.ref_count == 0) == (block.block_id in free)
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table)

    # Hash table: each entry is a block whose KV is the prefix that hashes to its key.
    for key, block_id in bm.hash_to_block.items():
        block = bm.blocks[block_id]
        assert block.hash == key and len(block.token_ids) == bs
        prefix = kv.slots[(block_id, bs - 1)]
        assert prefix[-bs:] == block.token_ids and len(prefix) % bs == 0
        for off in range(bs):
            assert kv.slots[(block_id, off)] == prefix[:len(prefix) - bs + off + 1]
        h = None
        for i in range(len(prefix) // bs):
            h = bm_module.compute_hash(tuple(prefix[i * bs:(i + 1) * bs]), h)
        assert h == key

    # Sequences: counters in order, tables cover what has been computed.
    for s in live:
        assert 0 <= s.num_cached_tokens <= s.num_computed_tokens <= s.num_tokens
        assert s.num_scheduled_tokens == 0
        assert s.num_hashed_blocks * bs <= s.num_computed_tokens
        assert s.num_hashed_blocks == s.num_computed_tokens // bs  # commit ran after every step
        if s.block_table:
            assert math.ceil(s.num_computed_tokens / bs) <= len(s.block_table) <= s.num_blocks(bs)
        else:
            assert (s.num_cached_tokens, s.num_computed_tokens, s.num_hashed_blocks) == (0, 0, 0)
        for i in range(s.num_hashed_blocks):
            assert bm.blocks[s.block_table[i]].hash is not None
    for s in sched.running:
        assert s.num_computed_tokens == s.num_tokens - 1  # all but the freshly sampled token


@pytest.mark.parametrize("collide", [False, True])
@settings(max_examples=150, deadline=None)
@given(cfg=configs, base=base_prompts, ops=op_lists)
def test_random_interleavings_keep_invariants(collide, cfg, base, ops):
    with colliding(collide):
        sched = Scheduler(cfg)
        kv = KVModel(sched)
        added: list[Sequence] = []
        released_ids: set[int] = set()
        for op in ops:
            if op[0] == "add":
                _, k, tail, max_tokens, ignore_eos, stop = op
                prompt = (base[:k] + tail)[:cfg.num_kv_blocks * cfg.block_size + 1]  # mostly fits
                seq = Sequence(len(added), prompt,
                               SamplingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                               stop_token_ids=stop))
                fits = (seq.num_tokens >= 1 and seq.num_tokens <= cfg.max_model_len
                        and seq.num_blocks(cfg.block_size) <= cfg.num_kv_blocks)
                if fits:
                    sched.add(seq)
                    added.append(seq)
                else:
                    with pytest.raises(ValueError):
                        sched.add(seq)
            elif op[0] == "step":
                _, token_seed, abort_at = op
                batch = sched.schedule()
                if batch is None:
                    assert not sched.running  # decode always finds a runnable seq
                    continue
                check_batch(sched, batch)
                kv.run(batch)
                if abort_at is not None:  # the client cancels while the step is in flight
                    event("abort in flight")
                    victim = batch.seqs[abort_at % len(batch.seqs)]
                    assert sched.abort(victim.seq_id) is victim
                rng = random.Random(token_seed)
                sampled = [sample_token(rng) for _ in range(sum(batch.sample))]
                out = sched.postprocess(batch, sampled)
                expect_out = [s for s, smp in zip(batch.seqs, batch.sample)
                              if smp and s.finish_reason != "abort"]
                assert out == expect_out
            else:
                if added:
                    target = added[op[1] % len(added)]
                    was_live = target.status is not SequenceStatus.FINISHED
                    got = sched.abort(target.seq_id)
                    assert (got is target) == was_live and target.status is SequenceStatus.FINISHED
            released_ids.update(sched.drain_released())
            check_invariants(sched, kv)
        if sched.num_preemptions:
            event("preemption")

        for s in added:
            if s.status is SequenceStatus.FINISHED:
                assert s.finish_reason in ("stop", "length", "abort") and not s.block_table
                assert 1 <= s.num_completion_tokens <= s.sampling.max_tokens or s.finish_reason == "abort"
            sched.abort(s.seq_id)
        released_ids.update(sched.drain_released())
        check_invariants(sched, kv)
        assert not sched.has_work()
        assert sched.block_manager.num_free_blocks == cfg.num_kv_blocks
        assert all(b.ref_count == 0 for b in sched.block_manager.blocks)
        assert released_ids <= {s.seq_id for s in added}


# ---- simulated reference: everything runs to the exact expected completion ---------------


def model_token(seq_id: int, position: int) -> int:
    """A deterministic "model": the next token depends only on who asks and where,
    so preemption and re-prefill must not change any output."""
    v = (seq_id * 7919 + position * 104729 + position * position * 31) % 61
    return EOS if v == 0 else STOP if v == 1 else v % VOCAB


def reference_completion(seq: Sequence, cfg: SchedulerConfig) -> tuple[list[int], str]:
    tokens, opts = list(seq.token_ids), seq.sampling
    while True:
        t = model_token(seq.seq_id, len(tokens))
        tokens.append(t)
        if (not opts.ignore_eos and t == cfg.eos_token_id) or t in opts.stop_token_ids:
            return tokens, "stop"
        if (len(tokens) - seq.num_prompt_tokens >= opts.max_tokens or len(tokens) >= cfg.max_model_len
                or math.ceil(len(tokens) / cfg.block_size) > cfg.num_kv_blocks):
            return tokens, "length"


def admissible_requests(cfg: SchedulerConfig, reqs, base, callers: bool = False):
    """(pending [(arrival step, seq)], seqs by id, expected completions, empty streams) for
    the requests whose prompts fit the config. callers: each has one of three priorities
    and one of two keys (priority preemption, fair shares)."""
    pending = []
    for i, (k, tail, max_tokens, ignore_eos, arrival) in enumerate(reqs):
        who = dict(priority=(i * 7 + k) % 3, tenant="ab"[(i + arrival) % 2]) if callers else {}
        seq = Sequence(i, base[:k] + tail, SamplingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                                           stop_token_ids=(STOP,), **who))
        if 1 <= seq.num_tokens <= cfg.max_model_len and seq.num_blocks(cfg.block_size) <= cfg.num_kv_blocks:
            pending.append((arrival, seq))
    seqs = {seq.seq_id: seq for _, seq in pending}
    expected = {seq.seq_id: reference_completion(seq, cfg) for _, seq in pending}
    streamed = {seq.seq_id: [] for _, seq in pending}
    return pending, seqs, expected, streamed


@st.composite
def workloads(draw):
    """A config and requests whose prompts fit its cache (k: shared-prefix length)."""
    cfg = draw(configs)
    cap = min(cfg.num_kv_blocks * cfg.block_size, cfg.max_model_len)
    reqs = draw(st.lists(st.tuples(st.integers(0, min(16, cap - 1)),
                                   st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3),
                                   st.integers(1, 32), st.booleans(), st.integers(0, 3)),
                         min_size=1, max_size=8))
    return cfg, reqs


@pytest.mark.parametrize("collide, callers", [(False, False), (True, False), (False, True)])
@settings(max_examples=100, deadline=None)
@given(workload=workloads(), base=base_prompts)
def test_runs_to_the_reference_completion(collide, callers, workload, base):
    cfg, reqs = workload
    with colliding(collide):
        sched = Scheduler(cfg)
        kv = KVModel(sched)
        pending, seqs, expected, streamed = admissible_requests(cfg, reqs, base, callers)
        steps = 0
        while pending or sched.has_work():
            for arrival, seq in [p for p in pending if p[0] <= steps]:
                sched.add(seq)
                pending.remove((arrival, seq))
            steps += 1
            assert steps < 5000, "no progress"
            batch = sched.schedule()
            if batch is None:
                assert not sched.has_work()  # nothing stalls while work is queued
                continue
            check_batch(sched, batch)
            kv.run(batch)
            sampled = [model_token(s.seq_id, s.num_tokens) for s, smp in zip(batch.seqs, batch.sample) if smp]
            for s in sched.postprocess(batch, sampled):
                streamed[s.seq_id].append(s.last_token)
            sched.drain_released()
            check_invariants(sched, kv)
        if sched.num_preemptions:
            event("preemption")
        if sched.num_priority_preemptions:
            event("priority preemption")
        assert sched.block_manager.num_free_blocks == cfg.num_kv_blocks
        for seq_id, (tokens, reason) in expected.items():
            seq = seqs[seq_id]
            assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == reason
            assert seq.token_ids == tokens
            assert streamed[seq_id] == seq.completion_token_ids  # each token streamed once


@pytest.mark.parametrize("collide, callers", [(False, False), (True, False), (False, True)])
@settings(max_examples=100, deadline=None)
@given(workload=workloads(), base=base_prompts)
def test_overlapped_steps_reach_the_reference_completion(collide, callers, workload, base):
    """Engine-style overlap: step N+1 is scheduled (and `advance`d) before step N's ids
    are `resolve`d; decode inputs are placeholders the worker fills. Same outputs."""
    cfg, reqs = workload
    with colliding(collide):
        sched = Scheduler(cfg)
        # model_token depends only on (seq, position), so the "worker" knows every
        # placeholder's value: position p holds model_token(seq, p).
        kv = KVModel(sched, lambda seq: [model_token(seq.seq_id, p) if t == PENDING_TOKEN else t
                                         for p, t in enumerate(seq.token_ids)])
        pending, seqs, expected, streamed = admissible_requests(cfg, reqs, base, callers)
        in_flight = None
        steps = 0
        while pending or sched.has_work() or in_flight:
            for arrival, seq in [p for p in pending if p[0] <= steps]:
                sched.add(seq)
                pending.remove((arrival, seq))
            steps += 1
            assert steps < 5000, "no progress"
            batch = sched.schedule()
            if batch is not None:
                check_batch(sched, batch)
                kv.run(batch)
                sampled = [model_token(s.seq_id, s.num_tokens)
                           for s, smp in zip(batch.seqs, batch.sample) if smp]
                sched.advance(batch)
            if in_flight is not None:
                for s in sched.resolve(*in_flight):
                    streamed[s.seq_id].append(s.last_resolved_token)
            in_flight = (batch, sampled) if batch is not None else None
            sched.drain_released()
            check_invariants(sched, kv)
        if sched.num_priority_preemptions:
            event("priority preemption")
        assert sched.block_manager.num_free_blocks == cfg.num_kv_blocks
        for seq_id, (tokens, reason) in expected.items():
            seq = seqs[seq_id]
            assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == reason
            assert seq.token_ids == tokens
            assert streamed[seq_id] == seq.completion_token_ids
