"""Scheduler unit tests for many callers: priority order and preemption, fair shares
between keys, deadlines before prefill (scheduler.py, wait_queue.py)."""
import time

from scheduler_service.scheduler import Scheduler, SchedulerConfig
from scheduler_service.sequence import SamplingOptions, Sequence, SequenceStatus

W, R, F = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


def make(num_kv_blocks=64, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=2, **kw))


def seq(seq_id, tokens, priority=0, tenant="", max_tokens=8, **kw) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingOptions(
        priority=priority, tenant=tenant, max_tokens=max_tokens, ignore_eos=True, **kw))


def model(tokens: list[int]) -> int:
    """A deterministic 'greedy model': the next token is a function of all before it."""
    h = 0
    for t in tokens:
        h = (h * 31 + t + 1) % 1000003
    return h % 97


def step(s: Scheduler):
    """One step with the model above (results folded in at once); the batch."""
    batch = s.schedule()
    assert batch is not None
    sampled = [model(x.token_ids) for x, smp in zip(batch.seqs, batch.sample) if smp]
    s.postprocess(batch, sampled)
    return batch


def run_all(s: Scheduler, arrivals: dict[int, list[Sequence]] = {}, limit=500) -> list[int]:
    """Steps until idle, adding arrivals[i] before step i; seq ids in finishing order."""
    done, live = [], []
    for i in range(limit):
        for x in arrivals.get(i, []):
            s.add(x)
            live.append(x)
        if not s.has_work() and i > max(arrivals, default=0):
            break
        if s.has_work():
            step(s)
        for x in live:
            if x.status is F and x.seq_id not in done:
                done.append(x.seq_id)
    return done


def test_waiting_order_is_priority_then_arrival():
    s = make(max_num_seqs=1)
    xs = [seq(1, [1], 5), seq(2, [2], 0), seq(3, [3], 5), seq(4, [4], -1), seq(5, [5], 0)]
    order = run_all(s, {0: xs})
    assert order == [4, 2, 5, 1, 3]


def test_high_priority_preempts_lowest_when_the_batch_is_full():
    low = [seq(i, [i, i + 1], priority=3, max_tokens=12) for i in (1, 2)]
    s = make(max_num_seqs=2)
    for x in low:
        s.add(x)
    step(s)
    step(s)
    high = seq(9, [9, 9], priority=0, max_tokens=4)
    s.add(high)
    batch = s.schedule()   # newest of the lowest class (2) gives its seat
    assert batch.is_prefill and [x.seq_id for x in batch.seqs] == [9]
    assert low[1].status is W and s.num_priority_preemptions == 1 and low[0].status is R
    assert [x.seq_id for x in s.waiting] == [2]
    s.postprocess(batch, [model(high.token_ids)])
    run_all(s)
    # outputs identical to a run that nobody preempted
    ref = make(max_num_seqs=2)
    alone = [seq(i, [i, i + 1], priority=3, max_tokens=12) for i in (1, 2)]
    run_all(ref, {0: alone})
    assert [x.token_ids for x in low] == [x.token_ids for x in alone]
    assert all(x.status is F and x.finish_reason == "length" for x in low + [high])


def test_equal_classes_and_the_gap_never_preempt():
    s = make(max_num_seqs=1, priority_preemption_gap=2)
    a = seq(1, [1], priority=1)
    s.add(a)
    step(s)
    s.add(seq(2, [2], priority=1))   # same class
    s.add(seq(3, [3], priority=0))   # one class higher: under the gap of 2
    assert not s.schedule().is_prefill and s.num_preemptions == 0


def test_high_priority_preempts_lowest_when_the_kv_cache_is_full():
    s = make(num_kv_blocks=8, max_num_seqs=8)
    lows = [seq(i, range(10 * i, 10 * i + 4), priority=2, max_tokens=20) for i in (1, 2)]
    for x in lows:
        s.add(x)
    step(s)   # 2 blocks each
    for _ in range(3):
        step(s)   # 7 tokens each: 4 blocks each, the cache is full
    assert s.block_manager.num_free_blocks == 0
    high = seq(9, range(90, 96), priority=0, max_tokens=2)   # needs 3 blocks
    s.add(high)
    batch = s.schedule()
    assert batch.is_prefill and [x.seq_id for x in batch.seqs] == [9]
    assert lows[1].status is W and lows[0].status is R
    s.postprocess(batch, [model(high.token_ids)])
    run_all(s)
    ref = make(num_kv_blocks=8, max_num_seqs=8)
    alone = [seq(i, range(10 * i, 10 * i + 4), priority=2, max_tokens=20) for i in (1, 2)]
    run_all(ref, {0: alone})
    assert [x.token_ids for x in lows] == [x.token_ids for x in alone]
    assert all(x.status is F for x in lows + [high])


def test_decode_kv_pressure_preempts_the_lowest_class_not_the_newest():
    s = make(num_kv_blocks=4, max_num_seqs=8)
    low = seq(1, [1, 2, 3], priority=5, max_tokens=10)   # older, lower class
    high = seq(2, [4], priority=0, max_tokens=10)
    s.add(low)
    s.add(high)
    step(s)   # high prefilled alone (a prefill step holds one class): 1 block
    step(s)   # low: 2 blocks
    step(s)   # both decode: low 5 tokens, high 3: each needs a block more, 1 free
    batch = s.schedule()
    assert low.status is W and high.status is R and s.num_preemptions == 1
    assert [x.seq_id for x in batch.seqs] == [2]


def test_fair_shares_between_keys_in_one_class():
    """Key a queues 12 requests before key b's 4: b's are admitted alternately with a's,
    not behind all of them; alone, a key is not held back."""
    s = make(max_num_seqs=2)
    a = [seq(i, [i], tenant="a", max_tokens=4) for i in range(1, 13)]
    b = [seq(100 + i, [i], tenant="b", max_tokens=4) for i in range(1, 5)]
    order = run_all(s, {0: a, 1: b})
    first_eight = order[:8]
    assert sum(x >= 100 for x in first_eight) == 4, order
    # a key alone keeps the batch full
    s = make(max_num_seqs=4)
    for x in [seq(i, [i], tenant="a", max_tokens=4) for i in range(1, 9)]:
        s.add(x)
    assert len(s.schedule().seqs) == 4


def test_priority_beats_fair_share():
    s = make(max_num_seqs=1)
    order = run_all(s, {0: [seq(1, [1], tenant="a"), seq(2, [2], tenant="b", priority=1),
                            seq(3, [3], tenant="a")]})
    assert order == [1, 3, 2]


def test_deadline_that_cannot_be_met_is_dropped_before_prefill():
    s = make(max_num_seqs=1)
    s.add(seq(1, [1], max_tokens=3))
    late = seq(2, [2], deadline=time.monotonic() + 0.05)
    fine = seq(3, [3], deadline=time.monotonic() + 60)
    s.add(late)
    s.add(fine)
    step(s)
    time.sleep(0.06)
    run_all(s)
    assert late.finish_reason == "deadline" and late.num_completion_tokens == 0
    assert fine.finish_reason == "length"
    assert s.drain_errors() == [(2, "DEADLINE_EXCEEDED",
                                 "the request's deadline passed before it could start")]
    assert s.num_deadline_drops == 1 and s.block_manager.num_free_blocks == 64


def test_an_idle_key_saves_up_no_burst():
    """Key a ran alone (nothing of it waiting when b arrives): b is lifted to a's counter,
    so a's next requests are not held back until b has caught up on a's whole history."""
    s = make(max_num_seqs=1)
    run_all(s, {0: [seq(i, [i], tenant="a", max_tokens=4) for i in range(1, 4)],
                1: [seq(100, [9], tenant="b", max_tokens=4)]})   # two keys: counting is on
    for i in range(4, 12):   # a alone for a while
        run_all(s, {0: [seq(i, [i], tenant="a", max_tokens=4)]})
    order = run_all(s, {0: [seq(200 + i, [i], tenant="b", max_tokens=4) for i in range(4)],
                        1: [seq(300 + i, [i], tenant="a", max_tokens=4) for i in range(4)]})
    assert any(x >= 300 for x in order[:4]), order   # a and b alternate from here


def test_a_prefill_step_holds_one_class():
    """A better class's prompts get a step of their own: the worse class's waiting prompts
    do not fill the rest of its token budget (they take the next step), and one class's
    prompts still share a step."""
    s = make(max_num_batched_tokens=64)
    for x in [seq(1, range(10, 20), 5), seq(2, range(20, 30), 0), seq(3, range(30, 40), 5),
              seq(4, range(40, 50), 0)]:   # (no shared prefix: none waits for another's blocks)
        s.add(x)
    first = step(s)
    assert first.is_prefill and [x.seq_id for x in first.seqs] == [2, 4]
    second = step(s)
    assert second.is_prefill and [x.seq_id for x in second.seqs] == [1, 3]


def test_deferred_prompts_go_back_to_their_places_without_a_lift():
    """WaitQueue.put_back (the scheduler's same-step deferrals): sequences taken from the
    head return to their places, behind an older one queued meanwhile (a preemption) and
    ahead of later arrivals, and their key's fair-share counter is not lifted (it never
    stopped waiting), where a key getting new work is lifted to the least waiting one's."""
    from scheduler_service.wait_queue import WaitQueue
    q = WaitQueue()
    old, x, y, later = (seq(i, [i], tenant="a") for i in (1, 2, 3, 4))
    other = seq(5, [5], tenant="b")
    for i, s in enumerate((old, x, y, later, other)):
        s.order = i + 1
    for s in (other, x, y):
        q.append(s)
    taken = [q.popleft(), q.popleft()]   # (equal counters: by arrival)
    assert taken == [x, y] and list(q) == [other]
    q.charge("b", 10)                     # b: 10, a: 0, a has nothing waiting
    q.put_back(taken)
    assert list(q) == [x, y, other] and q.counters.get("a", 0.0) == 0.0
    assert q.popleft() is x and q.popleft() is y
    q.append(old)                         # preempted meanwhile: older than both
    assert q.counters["a"] == 10          # (a key getting work again is lifted)
    q.append(later)
    q.put_back([x, y])
    assert list(q) == [old, x, y, later, other]
    assert [q.popleft() for _ in range(5)] == [old, x, y, later, other]


def test_a_background_class_prefills_beside_the_better_class_decodes():
    """While a better class has a request alive, a worse class's prompts go in at most
    max_background_prefill_tokens a step (chunked), as mixed steps: the decode rows of the
    running sequences plus the prompt chunk, so the better class's stream gets a token every
    step. Once the better class has been gone for background_hold_s, the full budget is back."""
    s = make(max_num_batched_tokens=64, max_background_prefill_tokens=8,
             background_hold_s=0.0)
    interactive = seq(1, range(100, 104), 0, max_tokens=12)
    s.add(interactive)
    assert step(s).is_prefill
    for i in range(4):   # 4 x 10 tokens, no shared prefix
        s.add(seq(10 + i, range(200 + 10 * i, 210 + 10 * i), 5, max_tokens=40))
    chunks = []   # the prompt tokens of each step while the interactive one runs
    while interactive.status is not F:
        b = s.schedule()
        assert not b.is_prefill and interactive in b.seqs[b.num_prefill:]
        chunks.append(sum(x.num_scheduled_tokens for x in b.seqs[:b.num_prefill]))
        s.postprocess(b, [model(x.token_ids) for x, smp in zip(b.seqs, b.sample) if smp])
    assert max(chunks) <= 8 and sum(chunks) == 40   # every flood prompt got in
    assert len(interactive.token_ids) == 4 + 12
    # the better class is gone (hold 0): a new flood prompt takes the whole budget
    late = seq(20, range(300, 340), 5)
    s.add(late)
    b = s.schedule()
    while not (b.is_prefill and late in b.seqs):
        s.postprocess(b, [model(x.token_ids) for x, smp in zip(b.seqs, b.sample) if smp])
        b = s.schedule()
    assert late.num_scheduled_tokens == 40 and b.num_tokens == 40


def test_background_prompts_beside_decodes_give_the_same_tokens():
    """The mixed steps change when tokens are computed, not which: every sequence's output
    equals the one the plain schedule gives (the deterministic 'model' above)."""
    def outputs(cap: int) -> dict[int, list[int]]:
        s = make(max_num_batched_tokens=64, max_background_prefill_tokens=cap,
                 background_hold_s=0.0)
        xs = [seq(1, range(100, 104), 0, max_tokens=12)] + [
            seq(10 + i, range(200 + 10 * i, 210 + 10 * i), 5, max_tokens=20) for i in range(4)]
        run_all(s, {0: xs[:1], 1: xs[1:]})
        return {x.seq_id: x.token_ids for x in xs}
    assert outputs(8) == outputs(0)


def test_one_class_or_the_cap_off_keeps_full_prefill_steps():
    """The mutants: with one class, or max_background_prefill_tokens 0, a prompt of the
    worse class fills the whole budget in one step."""
    for cap, better in ((8, None), (0, 0)):
        s = make(max_num_batched_tokens=64, max_background_prefill_tokens=cap)
        if better is not None:
            s.add(seq(1, range(100, 104), better, max_tokens=12))
            step(s)
        x = seq(2, range(200, 240), 5)
        s.add(x)
        b = s.schedule()
        assert b.is_prefill and x in b.seqs and b.num_tokens == 40


def test_after_a_verify_step_the_background_prompts_get_a_step_of_their_own():
    """A decode part that came back a verify step (proposals) carries no prompt chunk: the
    next step is the background's capped prefill step, so proposals every step cannot
    starve the background class."""
    s = make(max_num_batched_tokens=64, max_background_prefill_tokens=8)
    hi = seq(1, range(100, 104), 0, max_tokens=50)
    s.add(hi)
    step(s)
    lo = seq(10, range(200, 210), 5)
    s.add(lo)
    plain = s._schedule_decode

    def verify():   # the speculator proposed (nothing) for every running sequence
        b = plain()
        b.proposals = [[] for _ in b.seqs]
        return b
    s._schedule_decode = verify
    first = s.schedule()
    assert first.proposals is not None and first.num_prefill == 0 and lo.status is W
    s.postprocess(first, [model(x.token_ids) for x in first.seqs])
    second = s.schedule()
    assert second.is_prefill and second.seqs == [lo] and second.num_tokens == 8
