"""worker_service.step_plan: the worker's side of the Step diff protocol, against a brute-force model.

A random schedule of prefills (whole tables), chunked prefills, packed decode steps with
appended blocks, drops and resends is applied to a SeqTable; every plan's positions,
slots, tables and placeholder rows are checked against a plain-Python bookkeeping of the
same schedule. Then every kind of bad request is rejected with a StepError.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from nanoserve.v1 import worker_pb2
from worker_service.step_plan import PLACEHOLDER, SeqTable, StepError

BS, NUM_BLOCKS, VOCAB, MAX_LEN = 4, 64, 100, 64


def prefill(step_id, seqs, tokens, reset=True, sample=True, temperature=0.5):
    """seqs: [(seq_id, table, start, n)] -> a StepRequest whose prefill part sends them."""
    req = worker_pb2.StepRequest(step_id=step_id)
    for seq_id, table, start, n in seqs:
        w = req.seqs.add(seq_id=seq_id, num_tokens=n, start_pos=start, sample=sample,
                         reset_block_table=reset)
        if reset:
            w.block_table_i32 = np.array(table, "<i4").tobytes()
            w.sampling.temperature = temperature
    req.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    return req


def decode(step_id, seq_ids, tokens=None, new_blocks=(), drops=()):
    req = worker_pb2.StepRequest(step_id=step_id, drop_seq_ids=list(drops))
    req.decode.seq_ids_u64 = np.array(seq_ids, "<u8").tobytes()
    if tokens is not None:
        req.decode.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    req.decode.new_blocks_i32 = np.array(new_blocks, "<i4").reshape(-1).tobytes()
    return req


def expected_slots(table, positions):
    return [table[p // BS] * BS + p % BS for p in positions]


def test_random_schedule_matches_plain_bookkeeping():
    rng = random.Random(0)
    num_blocks = 8 * MAX_LEN // BS    # room for 8 sequences at full length
    t = SeqTable(num_blocks, BS, VOCAB, MAX_LEN)
    free = list(range(num_blocks))
    rng.shuffle(free)
    state: dict[int, dict] = {}    # seq_id -> {"table": [...], "n": tokens in KV}
    next_id = 1
    sampled_last: list[int] = []   # seq ids of the last step that sampled, in order
    for step in range(1, 200):
        running = [s for s, st in state.items() if st["n"] < MAX_LEN - 1]
        if not running or (len(state) < 6 and rng.random() < 0.3):
            # prefill a new sequence (whole table for its prompt)
            n = rng.randint(1, 10)
            table = [free.pop() for _ in range(-(-n // BS))]
            seq_id, next_id = next_id, next_id + 1
            toks = [rng.randrange(VOCAB) for _ in range(n)]
            plan = t.plan(prefill(step, [(seq_id, table, 0, n)], toks))
            assert plan.positions.tolist() == list(range(n))
            assert plan.slot_mapping.tolist() == expected_slots(table, range(n))
            assert plan.token_ids.tolist() == toks and plan.fill is None
            state[seq_id] = {"table": table, "n": n}
            t.commit(plan)
            sampled_last = [seq_id]
            continue
        done = [s for s in state if s not in running]
        if done or (rng.random() < 0.1 and len(state) > 1):   # drop one (finished or preempted)
            victim = done[0] if done else rng.choice(list(state))
            free.extend(state.pop(victim)["table"])
            batch = [s for s in running if s != victim] or None
            drops = [victim]
        else:
            batch, drops = running, []
        if not batch:
            continue
        new_blocks = []
        for i, s in enumerate(batch):   # the next token's position needs a block?
            st = state[s]
            if st["n"] >= len(st["table"]) * BS:
                block = free.pop()
                st["table"].append(block)
                new_blocks.append((i, block))
        use_placeholders = all(s in sampled_last for s in batch) and rng.random() < 0.7
        tokens = None if use_placeholders else [rng.randrange(VOCAB) for _ in batch]
        plan = t.plan(decode(step, batch, tokens, new_blocks, drops))
        positions = [state[s]["n"] for s in batch]
        assert plan.seq_ids == batch
        assert plan.positions.tolist() == positions
        assert plan.context_lens.tolist() == [p + 1 for p in positions]
        assert plan.slot_mapping.tolist() == [expected_slots(state[s]["table"], [p])[0]
                                              for s, p in zip(batch, positions)]
        for row, s in enumerate(batch):
            table = state[s]["table"]
            assert plan.block_tables[row, :len(table)].tolist() == table
        if use_placeholders:
            assert plan.fill[0].tolist() == list(range(len(batch)))
            assert plan.fill[1].tolist() == [sampled_last.index(s) for s in batch]
        else:
            assert plan.fill is None
        assert plan.is_decode and plan.num_samples == len(batch)
        t.commit(plan)
        for s in batch:
            state[s]["n"] += 1
        sampled_last = batch
    assert len(t) == len(state)


def test_chunked_prefill_continues_without_resending_the_table():
    t = SeqTable(NUM_BLOCKS, BS, VOCAB, MAX_LEN)
    table = [7, 3, 9]
    p1 = t.plan(prefill(1, [(5, table, 0, 6)], list(range(6)), sample=False))
    assert p1.num_samples == 0
    t.commit(p1)
    p2 = t.plan(prefill(2, [(5, [], 6, 4)], list(range(4)), reset=False))
    assert p2.positions.tolist() == [6, 7, 8, 9]
    assert p2.slot_mapping.tolist() == expected_slots(table, range(6, 10))
    assert p2.num_samples == 1 and p2.sampling[0].temperature == 0.5
    t.commit(p2)
    p3 = t.plan(decode(3, [5]))   # position 10 is in block 2: no new block needed
    assert p3.positions.tolist() == [10] and p3.fill[1].tolist() == [0]


def test_mixed_prefill_and_decode_in_one_step():
    t = SeqTable(NUM_BLOCKS, BS, VOCAB, MAX_LEN)
    t.commit(t.plan(prefill(1, [(1, [0, 1], 0, 5)], [1] * 5)))
    req = prefill(2, [(2, [2], 0, 3)], [4, 5, 6])
    req.decode.seq_ids_u64 = np.array([1], "<u8").tobytes()
    plan = t.plan(req)
    assert plan.seq_ids == [2, 1]
    assert plan.positions.tolist() == [0, 1, 2, 5]
    assert plan.last_token_index().tolist() == [2, 3]
    assert plan.fill[0].tolist() == [3]   # seq 1's input: its sample from step 1


def fast_forward(step_id, seq_ids, per, tokens, new_blocks=()):
    req = decode(step_id, seq_ids, tokens, new_blocks)
    req.decode.num_tokens_i32 = np.array(per, "<i4").tobytes()
    return req


def test_fast_forward_tokens_run_as_decode_rows_of_their_sequence():
    """Seq 1 runs its sample (placeholder) and 3 forced tokens, crossing into a new block;
    seq 2 one token: 5 decode rows, one sample per sequence, at its last row."""
    t = SeqTable(NUM_BLOCKS, BS, VOCAB, MAX_LEN)
    t.commit(t.plan(prefill(1, [(1, [10], 0, 3), (2, [20], 0, 2)], [1, 2, 3, 4, 5])))
    plan = t.plan(fast_forward(2, [1, 2], [4, 1], [PLACEHOLDER, 7, 8, 9, PLACEHOLDER],
                               new_blocks=[(0, 11)]))
    assert plan.is_decode and plan.seq_ids == [1, 1, 1, 1, 2]
    assert plan.positions.tolist() == [3, 4, 5, 6, 2]
    assert plan.context_lens.tolist() == [4, 5, 6, 7, 3]
    assert plan.slot_mapping.tolist() == expected_slots([10, 11], [3, 4, 5, 6]) + [20 * BS + 2]
    assert plan.sample.tolist() == [False, False, False, True, True]
    assert plan.sampling_seq_ids == [1, 2]
    assert plan.fill[0].tolist() == [0, 4] and plan.fill[1].tolist() == [0, 1]
    t.commit(plan)
    nxt = t.plan(decode(3, [1, 2], new_blocks=()))
    assert nxt.positions.tolist() == [7, 3]                 # 4 and 1 tokens further on
    assert nxt.fill[1].tolist() == [0, 1]                   # their samples, in row order


@pytest.mark.parametrize("per, tokens, message", [
    ([2], [1, PLACEHOLDER], "first token"),
    ([0], [], "count >= 1"),
    ([1, 1], [1], "count >= 1"),
    ([2], [1, 2, 3], "token ids"),
])
def test_bad_fast_forward_rows_are_step_errors(per, tokens, message):
    t = SeqTable(NUM_BLOCKS, BS, VOCAB, MAX_LEN)
    t.commit(t.plan(prefill(1, [(1, [10, 11], 0, 3)], [1, 2, 3])))
    with pytest.raises(StepError, match=message):
        t.plan(fast_forward(2, [1], per, tokens))


def biased(ids, biases, banned=()):
    req = prefill(2, [(2, [0], 0, 1)], [1])
    req.seqs[0].sampling.logit_bias_ids_i32 = np.array(ids, "<i4").tobytes()
    req.seqs[0].sampling.logit_bias_f32 = np.array(biases, "<f4").tobytes()
    req.seqs[0].sampling.banned_ids_i32 = np.array(banned, "<i4").tobytes()
    req.seqs[0].sampling.banned_until = 9
    return req


def test_min_tokens_bans_are_minus_inf_until_their_length():
    """The worker's min_tokens: banned ids join the logit_bias entries at -inf while the
    row's context is shorter than banned_until, and only then."""
    import torch
    from worker_service.logits_processors import logit_bias
    t = SeqTable(NUM_BLOCKS, BS, VOCAB, MAX_LEN)
    params = t.plan(biased([5], [2.0], banned=[7, 8])).sampling
    rows, ids, biases = logit_bias(params, [8], torch.device("cpu"))
    assert rows.tolist() == [0, 0, 0] and ids.tolist() == [5, 7, 8]
    assert biases.tolist() == [2.0, float("-inf"), float("-inf")]
    rows, ids, biases = logit_bias(params, [9], torch.device("cpu"))
    assert ids.tolist() == [5] and biases.tolist() == [2.0]


@pytest.mark.parametrize("make, message", [
    (lambda: decode(2, [9]), "unknown"),
    (lambda: prefill(2, [(9, [], 0, 1)], [1], reset=False), "unknown"),
    (lambda: decode(2, [1, 1]), "twice"),
    (lambda: decode(2, [1], tokens=[VOCAB]), "out of range"),
    (lambda: decode(2, [1], tokens=[1, 2]), "token ids"),
    (lambda: decode(2, [1], new_blocks=[(3, 1)]), "decode row"),
    (lambda: decode(2, [1], new_blocks=[(0, NUM_BLOCKS)]), "out of range"),
    (lambda: prefill(2, [(2, [NUM_BLOCKS], 0, 1)], [1]), "out of range"),
    (lambda: prefill(2, [(2, [0], 0, BS + 1)], [1] * (BS + 1)), "exceed"),
    (lambda: prefill(2, [(2, [0], 0, 2)], [1]), "token ids"),
    (lambda: prefill(2, [(2, list(range(MAX_LEN // BS + 1)), 0, 1)], [1]), "max_model_len"),
    (lambda: prefill(2, [(2, [0], 0, 2)], [PLACEHOLDER, 1]), "last token"),
    (lambda: prefill(2, [(2, [0], 0, 1)], [PLACEHOLDER]), "follow a step"),
    (lambda: worker_pb2.StepRequest(step_id=2), "empty"),
    (lambda: biased([VOCAB], [1.0]), "logit_bias: token id out of range"),
    (lambda: biased([-1], [1.0]), "logit_bias: token id out of range"),
    (lambda: biased([3, 4], [1.0]), "2 ids but 1 biases"),
    (lambda: biased([], [], banned=[VOCAB]), "banned ids: token id out of range"),
])
def test_bad_requests_are_step_errors(make, message):
    t = SeqTable(NUM_BLOCKS, BS, VOCAB, MAX_LEN)
    t.commit(t.plan(prefill(1, [(1, [10], 0, 3)], [1, 2, 3])))
    with pytest.raises(StepError, match=message):
        t.plan(make())


def test_decode_past_the_table_needs_a_new_block():
    t = SeqTable(NUM_BLOCKS, BS, VOCAB, MAX_LEN)
    t.commit(t.plan(prefill(1, [(1, [10], 0, BS)], [1] * BS)))
    with pytest.raises(StepError, match="exceed"):
        t.plan(decode(2, [1]))
    t2 = SeqTable(NUM_BLOCKS, BS, VOCAB, MAX_LEN)
    t2.commit(t2.plan(prefill(1, [(1, [10], 0, BS)], [1] * BS)))
    plan = t2.plan(decode(2, [1], new_blocks=[(0, 11)]))
    assert plan.slot_mapping.tolist() == [11 * BS]


def test_dropped_rows_are_reused_and_forget_their_samples():
    t = SeqTable(NUM_BLOCKS, BS, VOCAB, MAX_LEN)
    t.commit(t.plan(prefill(1, [(1, [0], 0, 2), (2, [1], 0, 2)], [1, 2, 3, 4])))
    with pytest.raises(StepError, match="unknown"):
        t.plan(decode(2, [1], drops=[1]))
    t.commit(t.plan(prefill(3, [(3, [5, 6], 0, 5)], [1] * 5)))
    assert len(t) == 2 and set(t.row_of) == {2, 3}
