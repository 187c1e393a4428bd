"""Scheduler unit tests: prefill/decode batching, chunked prefill, preemption, stops, abort."""
import pytest

from scheduler_service.scheduler import Batch, Scheduler, SchedulerConfig
from scheduler_service.sequence import SamplingOptions, Sequence, SequenceStatus

W, R, F = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


def make(num_kv_blocks=16, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=num_kv_blocks, **kw))


def seq(seq_id, tokens, **sampling) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingOptions(**sampling))


def shape(batch: Batch):
    """(seq_id, start position, tokens, samples) per seq: what the worker is asked to do."""
    return [(s.seq_id, s.num_computed_tokens, s.num_scheduled_tokens, smp)
            for s, smp in zip(batch.seqs, batch.sample)]


def step(sched: Scheduler, token=7, logprobs=None):
    batch = sched.schedule()
    assert batch is not None
    out = sched.postprocess(batch, [token] * sum(batch.sample), logprobs)
    return batch, out


# ---- add / validation -------------------------------------------------------------


def test_add_rejects_what_could_never_run():
    s = make(num_kv_blocks=2, block_size=4, max_model_len=10)
    with pytest.raises(ValueError):
        s.add(seq(1, []))
    with pytest.raises(ValueError):
        s.add(seq(1, range(11)))  # > max_model_len
    with pytest.raises(ValueError):
        s.add(seq(1, range(9)))  # 3 blocks > 2 in the cache
    with pytest.raises(ValueError):
        s.add(seq(1, [1], max_tokens=0))
    s.add(seq(1, range(8)))
    with pytest.raises(ValueError):
        s.add(seq(1, [1]))  # duplicate live id
    assert len(s.waiting) == 1 and s.has_work()


def test_empty_scheduler():
    s = make()
    assert not s.has_work() and s.schedule() is None and s.drain_released() == []


# ---- one sequence end to end ------------------------------------------------------


def test_prefill_then_decode_until_max_tokens():
    s = make(num_kv_blocks=8, block_size=4)
    a = seq(1, [1, 2, 3, 4, 5], max_tokens=4, logprobs=True)
    s.add(a)
    batch, out = step(s, token=9, logprobs=[-0.1])
    assert batch.is_prefill and shape(batch) == [(1, 5, 0, True)]  # after postprocess: 5 computed
    assert out == [a] and a.status is R and a.token_ids[-1] == 9 and a.logprobs == [-0.1]
    assert a.num_computed_tokens == 5 and a.num_hashed_blocks == 1
    for i, n in enumerate([6, 7, 8]):
        batch = s.schedule()
        assert not batch.is_prefill and shape(batch) == [(1, n - 1, 1, True)]
        assert batch.num_tokens == 1
        assert len(a.block_table) == 2
        out = s.postprocess(batch, [10 + i], [-1.0 - i])
        assert out == [a]
    assert a.completion_token_ids == [9, 10, 11, 12]
    assert a.logprobs == [-0.1, -1.0, -2.0, -3.0]
    assert a.status is F and a.finish_reason == "length"
    assert not s.has_work() and s.block_manager.num_free_blocks == 8
    assert s.drain_released() == [1] and s.drain_released() == []


def test_logprobs_only_when_asked():
    s = make()
    a, b = seq(1, [1, 2]), seq(2, [3, 4], logprobs=True)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    s.postprocess(batch, [5, 6], [-0.5, -0.25])
    assert a.logprobs == [] and b.logprobs == [-0.25]
    assert a.token_ids == [1, 2, 5] and b.token_ids == [3, 4, 6]


def test_postprocess_checks_sampled_count():
    s = make()
    s.add(seq(1, [1, 2]))
    batch = s.schedule()
    with pytest.raises(ValueError):
        s.postprocess(batch, [])


# ---- stopping ---------------------------------------------------------------------


@pytest.mark.parametrize("opts, token, reason", [
    (dict(), 2, "stop"),                                  # eos
    (dict(ignore_eos=True), 2, None),                     # eos ignored
    (dict(stop_token_ids=(5, 6)), 6, "stop"),             # stop token
    (dict(stop_token_ids=(5,), ignore_eos=True), 5, "stop"),
    (dict(max_tokens=1), 7, "length"),
    (dict(), 7, None),
])
def test_stop_conditions(opts, token, reason):
    s = make(eos_token_id=2)
    a = seq(1, [1, 3], **opts)
    s.add(a)
    _, out = step(s, token=token)
    assert out == [a] and a.finish_reason == reason
    assert (a.status is F) == (reason is not None)
    assert a.completion_token_ids == [token]


def test_no_eos_configured():
    s = make(eos_token_id=None)
    a = seq(1, [1], max_tokens=3)
    s.add(a)
    for _ in range(3):
        step(s, token=0)
    assert a.completion_token_ids == [0, 0, 0] and a.finish_reason == "length"


def test_max_model_len():
    s = make(max_model_len=6)
    a = seq(1, [1, 2, 3, 4], max_tokens=100)
    s.add(a)
    step(s)
    step(s)
    assert a.num_tokens == 6 and a.finish_reason == "length" and a.status is F


def test_prompt_of_max_model_len_gets_one_token():
    s = make(max_model_len=4)
    a = seq(1, [1, 2, 3, 4])
    s.add(a)
    step(s)
    assert a.completion_token_ids == [7] and a.finish_reason == "length"


def test_kv_capacity_stops_a_sequence_that_outgrows_the_cache():
    """A lone sequence needing more blocks than exist would otherwise preempt itself forever."""
    s = make(num_kv_blocks=2, block_size=2, max_model_len=100)
    a = seq(1, [1, 2, 3], max_tokens=100)
    s.add(a)
    step(s)  # 4 tokens: 2 blocks
    step(s)  # 5 tokens: would need a 3rd block
    assert a.num_tokens == 5 and a.finish_reason == "length"
    assert s.num_preemptions == 0 and not s.has_work()


# ---- batching limits --------------------------------------------------------------


def test_prefill_batches_up_to_token_budget_and_chunks_the_last():
    s = make(block_size=4, max_num_batched_tokens=10)
    a, b, c = seq(1, range(4)), seq(2, range(10, 14)), seq(3, range(20, 24))
    for x in (a, b, c):
        s.add(x)
    batch = s.schedule()
    assert batch.is_prefill and shape(batch) == [(1, 0, 4, True), (2, 0, 4, True), (3, 0, 2, False)]
    assert batch.num_tokens == 10
    assert list(s.running) == [a, b] and list(s.waiting) == [c] and c.status is W
    assert c.block_table  # keeps its blocks between chunks
    out = s.postprocess(batch, [5, 6])
    assert out == [a, b] and c.num_computed_tokens == 2 and c.num_tokens == 4
    batch = s.schedule()  # the chunked seq is continued first, before any decode
    assert batch.is_prefill and shape(batch) == [(3, 2, 2, True)]
    s.postprocess(batch, [8])
    assert list(s.running) == [a, b, c] and c.token_ids[-1] == 8
    batch = s.schedule()
    assert not batch.is_prefill and shape(batch) == [(1, 4, 1, True), (2, 4, 1, True), (3, 4, 1, True)]


def test_chunked_prefill_over_several_steps_then_decode():
    s = make(num_kv_blocks=8, block_size=2, max_num_batched_tokens=4)
    a = seq(1, range(10), max_tokens=3)
    s.add(a)
    seen = []
    while s.has_work():
        batch = s.schedule()
        seen.append((batch.is_prefill, shape(batch), a.status))
        s.postprocess(batch, [7] * sum(batch.sample))
        seen.append((a.num_computed_tokens, a.num_hashed_blocks, len(s.block_manager.hash_to_block)))
    assert seen == [
        (True, [(1, 0, 4, False)], W), (4, 2, 2),   # blocks register as their KV is computed
        (True, [(1, 4, 4, False)], W), (8, 4, 4),
        (True, [(1, 8, 2, True)], R), (10, 5, 5),
        (False, [(1, 10, 1, True)], R), (11, 5, 5),
        (False, [(1, 11, 1, True)], R), (0, 0, 6),  # finished: released, hashes stay
    ]
    assert a.completion_token_ids == [7, 7, 7] and a.finish_reason == "length"
    assert s.block_manager.num_free_blocks == 8


def test_chunked_prefix_not_served_before_computed():
    """b arrives while a is mid chunked prefill: it may hit only a's computed blocks, and
    it waits a step where a's last chunk computes a block it shares (then hits it)."""
    s = make(num_kv_blocks=16, block_size=2, max_num_batched_tokens=4)
    a = seq(1, range(10))
    b = seq(2, list(range(10)) + [99])
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert shape(batch) == [(1, 0, 4, False)]
    s.postprocess(batch, [])
    batch = s.schedule()
    assert shape(batch) == [(1, 4, 4, False)]
    s.postprocess(batch, [])
    batch = s.schedule()  # a's last chunk (blocks 0-3 computed, block 4 not): b would
    assert shape(batch) == [(1, 8, 2, True)]   # compute block 4 beside it, so it waits
    assert b.block_table == [] and list(s.waiting) == [b]
    s.postprocess(batch, [7])
    batch = s.schedule()
    assert batch.is_prefill and shape(batch) == [(2, 10, 1, True)]
    assert b.num_cached_tokens == 10 and b.block_table[:5] == a.block_table[:5]


def test_max_num_seqs_in_prefill_and_decode():
    s = make(max_num_seqs=2)
    seqs = [seq(i, [i, i]) for i in range(1, 4)]
    for x in seqs:
        s.add(x)
    batch, _ = step(s)
    assert [x.seq_id for x in batch.seqs] == [1, 2] and list(s.waiting) == [seqs[2]]
    batch, _ = step(s)
    assert not batch.is_prefill and [x.seq_id for x in batch.seqs] == [1, 2]


def test_decode_respects_token_budget():
    s = make(max_num_batched_tokens=2, max_num_seqs=8)
    for i in range(1, 4):
        s.add(seq(i, [i]))
    assert [x.seq_id for x in step(s)[0].seqs] == [1, 2]
    assert [x.seq_id for x in step(s)[0].seqs] == [3]
    batch, _ = step(s)
    assert not batch.is_prefill and [x.seq_id for x in batch.seqs] == [1, 2]
    assert [x.seq_id for x in s.running] == [1, 2, 3]


def test_waiting_head_blocks_the_queue_when_cache_is_full():
    s = make(num_kv_blocks=3, block_size=2)
    a, b, c = seq(1, range(4)), seq(2, range(10, 14)), seq(3, [50])
    for x in (a, b, c):
        s.add(x)
    batch = s.schedule()  # a takes 2 blocks; b needs 2, 1 free: FCFS, c waits behind b
    assert [x.seq_id for x in batch.seqs] == [1] and list(s.waiting) == [b, c]


# ---- prefix caching through the scheduler -----------------------------------------


def test_second_request_with_same_prefix_computes_only_the_rest():
    s = make(block_size=4)
    system = list(range(100, 112))
    a = seq(1, system + [1, 2])
    s.add(a)
    step(s)
    b = seq(2, system + [3])
    s.add(b)
    batch = s.schedule()
    assert batch.is_prefill and shape(batch) == [(2, 12, 1, True)]
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert all(s.block_manager.blocks[i].ref_count == 2 for i in a.block_table[:3])


# ---- same-step prefix sharing (sharers wait a step) ---------------------------------


def test_same_step_sharers_wait_a_step_and_hit_the_shared_blocks():
    """Prompts sharing a 2-block prefix (a reranker's documents) waiting for one prefill
    step: the first computes the prefix, the others wait a step instead of computing it
    again beside it, then find it cached. A prompt sharing nothing is admitted in the first
    step all the same, and the deferred keep their place ahead of later arrivals."""
    s = make(num_kv_blocks=64, block_size=4, max_num_batched_tokens=256)
    prefix = list(range(100, 108))    # 2 full blocks
    docs = [seq(i, prefix + [10 * i, 10 * i + 1, 10 * i + 2], max_tokens=2) for i in range(1, 5)]
    other = seq(9, range(200, 211), max_tokens=2)
    for x in (docs[0], docs[1], other, docs[2], docs[3]):
        s.add(x)
    first = s.schedule()
    assert first.is_prefill and shape(first) == [(1, 0, 11, True), (9, 0, 11, True)]
    assert list(s.waiting) == docs[1:] and all(not d.block_table for d in docs[1:])
    computed = first.num_tokens - 11   # (other's 11)
    s.postprocess(first, [5, 5])
    late = seq(10, range(300, 305), max_tokens=2)
    s.add(late)
    second = s.schedule()
    assert second.is_prefill
    assert shape(second) == [(2, 8, 3, True), (3, 8, 3, True), (4, 8, 3, True), (10, 0, 5, True)]
    computed += second.num_tokens - 5
    for d in docs[1:]:
        assert d.num_cached_tokens == d.usage_cached_tokens == 8
        assert d.block_table[:2] == docs[0].block_table[:2]
    assert computed == len(prefix) + 4 * 3   # the prefix once, then each suffix
    s.postprocess(second, [5] * 4)
    assert not s.waiting and [x.seq_id for x in s.running] == [1, 9, 2, 3, 4, 10]


def test_no_wait_for_a_lone_prompt_or_less_than_a_block_shared():
    s = make(block_size=4)
    lone = seq(1, list(range(100, 108)) + [1, 2, 3])
    s.add(lone)
    assert shape(s.schedule()) == [(1, 0, 11, True)]
    # 3 tokens in common (a block holds 4): nothing to share, both computed in one step
    s = make(block_size=4)
    a, b = seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]), seq(2, [1, 2, 3, 0, 5, 6, 7, 8, 9])
    s.add(a)
    s.add(b)
    assert shape(s.schedule()) == [(1, 0, 9, True), (2, 0, 9, True)]
    # exactly one full block in common: b waits for it
    s = make(block_size=4)
    a, b = seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]), seq(2, [1, 2, 3, 4, 0, 6, 7, 8, 9])
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert shape(batch) == [(1, 0, 9, True)]
    s.postprocess(batch, [5])
    assert shape(s.schedule()) == [(2, 4, 5, True)]


def test_a_deferred_prompt_whose_sharer_was_aborted_runs_normally():
    s = make(block_size=4)
    a, b = seq(1, range(20, 29)), seq(2, range(20, 30))
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert shape(batch) == [(1, 0, 9, True)] and list(s.waiting) == [b]
    s.abort(1)                   # before its step's results: its blocks never registered
    s.postprocess(batch, [5])
    assert shape(s.schedule()) == [(2, 0, 10, True)] and b.num_cached_tokens == 0


def test_deferrals_stop_at_a_batch_of_sequences():
    """A step defers no more sharers than the next step could hold (max_num_seqs): the look
    ahead stays bounded, and the rest wait their turn in order."""
    s = make(num_kv_blocks=64, block_size=4, max_num_seqs=3)
    docs = [seq(i, list(range(100, 108)) + [i]) for i in range(1, 7)]
    other = seq(9, range(200, 205))
    for x in (*docs, other):
        s.add(x)
    batch = s.schedule()   # 1 runs, 2 and 3 wait for its blocks: 3 is a batch, 4 ends the look
    assert [x.seq_id for x in batch.seqs] == [1] and list(s.waiting) == [*docs[1:], other]


# ---- preemption -------------------------------------------------------------------


def test_preempt_newest_then_resume_recomputes_with_own_surviving_blocks():
    s = make(num_kv_blocks=4, block_size=2)
    a, b = seq(1, [1, 2], max_tokens=5), seq(2, [3, 4], max_tokens=10)
    s.add(a)
    s.add(b)
    step(s, token=5)  # prefill: a -> block 0, b -> block 1
    assert (a.block_table, b.block_table) == ([0], [1])
    step(s, token=5)  # decode: a -> block 2, b -> block 3; cache full
    step(s, token=5)  # decode within the blocks; a and b have 5 tokens each
    assert s.block_manager.num_free_blocks == 0 and a.num_tokens == b.num_tokens == 5
    batch = s.schedule()  # a needs a block: b (newest) is preempted
    assert shape(batch) == [(1, 4, 1, True)] and not batch.is_prefill
    assert s.num_preemptions == 1 and b.status is W and list(s.waiting) == [b]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_tokens == 5
    assert s.drain_released() == [2]
    assert a.block_table == [0, 2, 3]  # b's freed tail block, reused fresh (its hash evicted)
    s.postprocess(batch, [5])
    batch, out = step(s)  # b needs 3 blocks, 1 free: a decodes and finishes
    assert not batch.is_prefill and a.finish_reason == "length" and out == [a]
    assert s.drain_released() == [1]
    batch = s.schedule()  # b resumes: all 5 tokens, its own block [3,4] survived
    assert batch.is_prefill and shape(batch) == [(2, 2, 3, True)]
    assert b.num_cached_tokens == 2 and b.block_table[0] == 1
    assert b.status is R
    s.postprocess(batch, [6])
    assert b.token_ids == [3, 4, 5, 5, 5, 6] and b.num_computed_tokens == 5


def test_preemption_keeps_running_order_and_requeues_oldest_first():
    s = make(num_kv_blocks=3, block_size=1, max_model_len=100)
    a, b, c = seq(1, [1], max_tokens=50), seq(2, [2], max_tokens=50), seq(3, [3], max_tokens=50)
    for x in (a, b, c):
        s.add(x)
    step(s)  # 3 blocks used, each seq has 2 tokens and needs a 2nd block to decode
    batch = s.schedule()  # a preempts c (newest); b then finds none left to preempt: itself
    assert [x.seq_id for x in batch.seqs] == [1]
    assert list(s.waiting) == [b, c] and s.num_preemptions == 2
    assert list(s.running) == [a]


def test_lone_sequence_preempts_itself_when_others_hold_the_blocks():
    """The only running seq cannot append: it preempts itself and re-prefills later."""
    s = make(num_kv_blocks=3, block_size=1)
    a = seq(1, [1])
    s.add(a)
    step(s)  # a = [1, 7]: block 0 holds [1] (computed, registered)
    holder = Sequence(99, [8, 9])  # blocks held outside the scheduler's queues
    s.block_manager.allocate(holder)
    assert s.schedule() is None  # a preempted; re-prefill needs 2 free blocks, 1 free
    assert a.status is W and s.num_preemptions == 1 and list(s.waiting) == [a]
    assert s.drain_released() == [1] and s.has_work()
    s.block_manager.deallocate(holder)
    batch = s.schedule()
    assert batch.is_prefill and shape(batch) == [(1, 1, 1, True)]  # its old block 0 hits
    assert a.block_table[0] == 0 and a.num_cached_tokens == 1


# ---- abort ------------------------------------------------------------------------


def test_abort_everywhere():
    s = make(num_kv_blocks=16, block_size=2, max_num_batched_tokens=6)
    a, b, c, d = seq(1, range(4)), seq(2, range(10, 16)), seq(3, [1]), seq(4, [2])
    for x in (a, b, c, d):
        s.add(x)
    batch = s.schedule()  # a whole, b chunked (2 of 6)
    assert shape(batch) == [(1, 0, 4, True), (2, 0, 2, False)]
    s.postprocess(batch, [7])
    assert s.abort(4) is d and d.status is F and d.finish_reason == "abort"  # never scheduled
    assert s.abort(2, reason="cancelled") is b and b.finish_reason == "cancelled"  # mid-chunk
    assert b.block_table == [] and s.block_manager.num_used_blocks == 2  # a's
    assert s.abort(1) is a and a.block_table == [] and list(s.running) == []
    assert s.abort(1) is None and s.abort(12345) is None
    assert s.drain_released() == [2, 1]  # d never held blocks
    assert list(s.waiting) == [c]
    step(s)
    assert s.abort(3) is c and s.block_manager.num_free_blocks == 16 and not s.has_work()


def test_abort_between_schedule_and_postprocess():
    s = make()
    a, b, c = seq(1, [1, 2]), seq(2, [3, 4]), seq(3, [5, 6])
    for x in (a, b, c):
        s.add(x)
    batch = s.schedule()
    s.abort(2)
    out = s.postprocess(batch, [10, 20, 30])
    assert out == [a, c]
    assert a.token_ids[-1] == 10 and c.token_ids[-1] == 30 and b.token_ids == [3, 4]
    assert b.num_computed_tokens == 0 and b.status is F
    assert list(s.running) == [a, c]
    assert s.block_manager.num_used_blocks == 2


def test_recompute_all_requeues_everything_for_re_prefill():
    """Workers lost their KV: running and waiting seqs go back to waiting in order, steps
    in flight are forgotten (placeholders dropped), nothing holds a block or a hash."""
    s = make(num_kv_blocks=16, block_size=4, max_num_batched_tokens=64)
    # (prompts sharing no block: none waits a step for another's, see test_same_step_sharers_...)
    a, b, c = (Sequence(i, list(range(10 * i + 1, 10 * i + 10)), SamplingOptions(max_tokens=8))
               for i in range(3))
    for seq in (a, b):
        s.add(seq)
    s.postprocess(s.schedule(), [5, 6])          # a, b prefilled: running, blocks hashed
    s.advance(s.schedule())                        # a decode step in flight: placeholders
    s.add(c)
    assert a.num_pending_tokens == b.num_pending_tokens == 1
    s.recompute_all()
    assert list(s.waiting) == [a, b, c] and not s.running
    assert s.block_manager.num_free_blocks == 16 and not s.block_manager.hash_to_block
    assert s.drain_released() == []
    for seq in (a, b):
        assert seq.token_ids == list(range(10 * seq.seq_id + 1, 10 * seq.seq_id + 10)) + \
            [5 if seq is a else 6]
        assert seq.num_pending_tokens == seq.num_computed_tokens == seq.num_cached_tokens == 0
        assert not seq.block_table and seq.status is SequenceStatus.WAITING
    batch = s.schedule()                          # re-prefill of every token, no stale hits
    assert batch.is_prefill and [x.seq_id for x in batch.seqs] == [0, 1, 2]
    assert [x.num_scheduled_tokens for x in batch.seqs] == [10, 10, 9]


# ---- fast-forward (structured output) --------------------------------------------------


def test_fast_forward_knows_the_step_in_flight_and_runs_the_rest_as_decode_rows():
    """Overlap: step 2 is in flight when step 1's token arrives and the grammar forces
    [40, 41, 42, 43]: step 2's sample is 40 (known now), 41-43 join the next decode step
    as rows of their own (crossing into a third block), one sample after them."""
    s = make(num_kv_blocks=16, block_size=4)
    a, b = seq(1, [1, 2, 3]), seq(2, [4, 5])
    s.add(a)
    s.add(b)
    s.postprocess(s.schedule(), [10, 20])                # prefill: a = [1,2,3,10]
    step1 = s.schedule()
    s.advance(step1)
    step2 = s.schedule()
    s.advance(step2)                                      # a = [1,2,3,10,P1,P2]
    assert s.resolve(step1, [11, 21]) == [a, b]           # a = [1,2,3,10,11,P2]
    assert s.fast_forward(a, [40, 41, 42, 43]) == [40, 41, 42, 43]
    assert a.token_ids == [1, 2, 3, 10, 11, 40, 41, 42, 43] and a.ahead == [40]
    assert a.num_pending_tokens == 0 and a.num_computed_tokens == 5
    step3 = s.schedule()
    assert shape(step3) == [(1, 5, 4, True), (2, 4, 1, True)]
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert step3.new_blocks == [(0, a.block_table[2]), (1, b.block_table[1])]
    s.advance(step3)
    assert s.resolve(step2, [40, 22]) == [b]              # a's sample was known: skipped
    assert a.ahead == [] and s.num_fast_forward_mismatches == 0
    assert s.resolve(step3, [50, 23]) == [a, b]
    assert a.token_ids == [1, 2, 3, 10, 11, 40, 41, 42, 43, 50] and a.num_computed_tokens == 9


def test_fast_forward_without_a_step_in_flight_appends_every_forced_token():
    s = make(num_kv_blocks=16, block_size=4)
    a = seq(1, [1, 2, 3])
    s.add(a)
    s.postprocess(s.schedule(), [10])                     # no overlap: nothing in flight
    assert s.fast_forward(a, [40, 41]) == [40, 41]
    assert a.ahead == [] and a.num_computed_tokens == 3
    assert shape(s.schedule()) == [(1, 3, 3, True)]       # 10, 40, 41: three rows


def test_a_sample_other_than_the_forced_token_is_counted():
    s = make(num_kv_blocks=16, block_size=4)
    a = seq(1, [1, 2, 3])
    s.add(a)
    s.postprocess(s.schedule(), [10])
    step1 = s.schedule()
    s.advance(step1)
    s.fast_forward(a, [40])
    s.resolve(step1, [39])
    assert s.num_fast_forward_mismatches == 1 and a.token_ids[-1] == 40


@pytest.mark.parametrize("opts, forced, known, reason", [
    ({"stop_token_ids": (41,)}, [40, 41, 42], [40, 41], "stop"),
    ({"max_tokens": 3}, [40, 41, 42], [40, 41], "length"),
])
def test_fast_forward_ends_where_a_stop_id_or_the_length_limit_falls(opts, forced, known, reason):
    s = make(num_kv_blocks=16, block_size=4)
    a = seq(1, [1, 2, 3], **opts)
    s.add(a)
    s.postprocess(s.schedule(), [10])
    assert s.fast_forward(a, forced) == known
    assert a.status is F and a.finish_reason == reason and a.token_ids == [1, 2, 3, 10, *known]
    assert not s.has_work() and s.block_manager.num_free_blocks == 16


def test_fast_forward_rows_wait_for_blocks_by_preempting_the_newest():
    s = make(num_kv_blocks=3, block_size=4)
    a, b = seq(1, [1, 2, 3]), seq(2, [4, 5, 6])
    s.add(a)
    s.add(b)
    s.postprocess(s.schedule(), [10, 20])                 # a, b: one full block each
    s.fast_forward(a, [40, 41, 42, 43, 44])               # a needs 2 more blocks; 1 is free
    batch = s.schedule()
    assert shape(batch) == [(1, 3, 6, True)] and s.num_preemptions == 1
    assert b.status is W and len(a.block_table) == 3


def test_a_forced_run_longer_than_a_step_is_cut_to_fit_one():
    """max_num_seqs 4: a decode step has at most 4 rows, so at most 3 forced tokens are
    taken (with the sampled one before them); the sequence is never left unschedulable."""
    s = make(num_kv_blocks=16, block_size=4, max_num_seqs=4)
    a, b = seq(1, [1, 2, 3]), seq(2, [4, 5])
    s.add(a)
    s.add(b)
    s.postprocess(s.schedule(), [10, 20])
    assert s.fast_forward(a, list(range(40, 50))) == [40, 41, 42]
    batch = s.schedule()
    assert shape(batch) == [(1, 3, 4, True)]                # 4 rows: b waits for the next step
    s.postprocess(batch, [60])
    assert shape(s.schedule()) == [(1, 7, 1, True), (2, 2, 1, True)]
