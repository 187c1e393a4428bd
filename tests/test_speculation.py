"""Speculative decoding's parts, without services: the proposers, the cost model, the
scheduler's verify steps against a deterministic stand-in model, and the acceptance rule's
output distribution with the worker's own sampler.

The services' end-to-end checks (greedy and seeded outputs unchanged through gRPC and the
OpenAI API) are tests/test_speculative.py.
"""
from __future__ import annotations

import random
from array import array

import pytest
import torch

from scheduler_service.scheduler import Batch, Scheduler, SchedulerConfig
from scheduler_service.sequence import PENDING_TOKEN, SamplingOptions, Sequence, SequenceStatus
from scheduler_service.speculation import (SpecConfig, SpecState, Speculator, StepCost,
                                           follow_prediction, ngram_proposal)
from worker_service.sampler import SamplingBatch, sample
from worker_service.step_plan import SamplingParams


# ---- proposers -------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match_with_room():
    c = array("i", [1, 2, 3, 4, 5, 9, 8, 1, 2, 3, 4, 1, 2, 3])
    assert ngram_proposal(c, 4, 3, 2) == [4, 1, 2, 3]   # the latest match with 4 after it
    assert ngram_proposal(c, 2, 3, 2) == [4, 1]         # room: the latest of all
    assert ngram_proposal(array("i", [7] * 20), 4, 4, 2) == [7, 7, 7, 7]
    assert ngram_proposal(array("i", [1, 2, 3, 4]), 4, 4, 2) == []   # no earlier match
    assert ngram_proposal(array("i", [5, 1, 6, 1]), 3, 4, 2) == []   # n_min 2: 1-grams don't count
    assert ngram_proposal(array("i", [5, 1, 6, 1]), 3, 4, 1) == [6, 1]


def follow(prediction: list[int], output: list[int], steps: list[int]) -> list[int | None]:
    """pred_pos after each prefix of output of the given lengths."""
    st, pred = SpecState(), array("i", prediction)
    out = []
    for n in steps:
        follow_prediction(st, pred, output[:n], 4)
        out.append(st.pred_pos)
    return out


def test_prediction_realigns_after_substitution_insertion_and_deletion():
    rng = random.Random(5)
    text = [rng.randrange(1000, 2000) for _ in range(60)]
    assert follow(text, text, [1, 10, 60]) == [1, 10, 60]
    sub = text[:20] + [7, 8, 9] + text[23:]          # 3 tokens replaced
    assert follow(text, sub, [20, 21, 23, 24, 30]) == [20, None, None, 24, 30]
    ins = text[:20] + [7, 8, 9] + text[20:]          # 3 tokens inserted
    assert follow(text, ins, [22, 24, 33]) == [None, 21, 30]
    dele = text[:20] + text[25:]                     # 5 tokens deleted
    assert follow(text, dele, [20, 21, 30]) == [20, 26, 35]


def test_prediction_realigns_nearest_in_repetitive_text():
    """A tail that occurs often ("} \\n"): the occurrence an edit of the same length would
    have reached wins over the first one after the disagreement."""
    unit = [10, 11, 12]
    pred = unit * 10 + [50] + unit * 10
    out = unit * 10 + [60, 10, 11, 12, 10]            # [50] replaced by [60]
    assert follow(pred, out, [31, len(out)])[-1] == 35


# ---- cost model ------------------------------------------------------------------------

def test_step_cost_fits_rows_and_sets_the_bar():
    cost = StepCost()
    for _ in range(5):
        for rows in (1, 8, 32, 128):
            cost.observe(rows, 5.0 + 0.02 * rows)
    assert cost.a == pytest.approx(5.0, abs=0.05) and cost.b == pytest.approx(0.02, rel=0.05)
    assert cost.threshold(1) < 0.01 < cost.threshold(32) < cost.threshold(128) < 1


# ---- the scheduler's verify steps ------------------------------------------------------

def model(prev: int, pos: int) -> int:
    """The stand-in target: the greedy token after `prev` at position `pos`."""
    return (prev * 31 + pos * 7) % 97 + 3


def run_scheduler(prompts, predictions, max_tokens, num_kv_blocks, stop_id=None, k=4):
    """Drive a Scheduler with verify steps through a stand-in worker (every row samples
    model(input, position)); checks block invariants as it goes; returns the outputs."""
    cfg = SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=4, max_num_seqs=8,
                          max_model_len=256, eos_token_id=stop_id)
    sched = Scheduler(cfg, Speculator(SpecConfig(num_tokens=k)))
    seqs = [Sequence(i, p, SamplingOptions(temperature=0.0, max_tokens=m, prediction=tuple(pred),
                                           ignore_eos=stop_id is None))
            for i, (p, pred, m) in enumerate(zip(prompts, predictions, max_tokens))]
    for s in seqs:
        sched.add(s)
    bm = sched.block_manager
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        rows = []   # (input token, position) of each sampling row
        for seq, samples in zip(batch.seqs, batch.sample):
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start:start + seq.num_scheduled_tokens - len(seq.proposal)] \
                + seq.proposal
            assert PENDING_TOKEN not in tokens
            if batch.is_prefill:
                if samples:
                    rows.append((tokens[-1], start + len(tokens)))
            else:
                rows += [(t, start + i + 1) for i, t in enumerate(tokens)][-1 - len(seq.proposal):]
        sched.advance(batch)
        sched.resolve(batch, [model(t, pos) for t, pos in rows])
        for s in sched.running:
            assert s.num_computed_tokens <= s.num_tokens - 1
            for i in range(s.num_hashed_blocks):   # hashes cover accepted tokens only
                assert bm.blocks[s.block_table[i]].token_ids == tuple(s.token_ids[4 * i:4 * i + 4])
    assert bm.num_free_blocks == num_kv_blocks, "blocks leaked"
    assert sched.num_kv_stale == 0
    return seqs


def greedy(prompt: list[int], n: int, stop_id=None) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(model(ids[-1], len(ids)))
        if ids[-1] == stop_id:
            break
    return ids[len(prompt):]


@pytest.mark.parametrize("num_kv_blocks", [200, 14])   # 14: preemptions
def test_verify_steps_give_greedy_outputs_and_free_every_block(num_kv_blocks):
    rng = random.Random(num_kv_blocks)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randrange(1, 9))] for _ in range(6)]
    lens = [rng.randrange(1, 30) for _ in prompts]
    answers = [greedy(p, 40) for p in prompts]
    predictions = [answers[0], answers[1][:5], [t if i % 7 else 1 for i, t in enumerate(answers[2])],
                   [], answers[4] + answers[4], [rng.randrange(3, 100) for _ in range(30)]]
    seqs = run_scheduler(prompts, predictions, lens, num_kv_blocks)
    for s, p, n in zip(seqs, prompts, lens):
        assert s.completion_token_ids == greedy(p, n) and s.finish_reason == "length"
    assert seqs[0].spec.num_accepted > 0


def test_a_stop_inside_an_accepted_run_ends_the_output_there():
    prompt = [5, 6, 7]
    answer = greedy(prompt, 40)
    stop = answer[6]
    (seq,) = run_scheduler([prompt], [answer], [40], 200, stop_id=stop, k=8)
    assert seq.completion_token_ids == greedy(prompt, 40, stop) and seq.finish_reason == "stop"
    assert seq.completion_token_ids[-1] == stop


# ---- the acceptance rule's distribution --------------------------------------------------

def filtered(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The target distribution written out (temperature, then top-k, top-p, min-p)."""
    p = torch.softmax(logits / t, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if rank < top_k and mass < top_p:
            keep[i] = True
        mass += float(p[i])
    keep &= p >= min_p * p.max()
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("mutant", [False, True])
def test_accepted_runs_are_distributed_as_the_target(mutant):
    """Two tokens drawn with a verify step proposing x then y (a point-mass proposer) have
    the target's joint distribution p1(t1) p2(t2 | t1): each row is drawn by the worker's
    sampler from the filtered target, the scheduler keeps proposals equal to the draw before
    them. A resolver that draws again from p1 where x was refused (skipping the residual
    distribution p1 without x) must be caught."""
    torch.manual_seed(0)
    n, v, x, y = 30_000, 6, 2, 4
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, min_p=0.02)
    l1 = torch.tensor([1.0, 0.2, 0.9, -0.5, 0.4, 0.1])
    l2 = torch.randn(v, v)   # row t1: the logits after t1
    p1 = filtered(l1, 0.8, 5, 0.95, 0.02)
    p2 = torch.stack([filtered(l2[i], 0.8, 5, 0.95, 0.02) for i in range(v)])
    exact = p1[:, None] * p2

    def draw(logits: torch.Tensor) -> list[int]:
        batch = SamplingBatch.build([params] * len(logits), [10] * len(logits), v, torch.device("cpu"))
        return sample(logits, batch)[0].tolist()

    sched = Scheduler(SchedulerConfig(num_kv_blocks=4 * n, block_size=16, max_model_len=64))
    seqs = [Sequence(i, [1], SamplingOptions(max_tokens=8, ignore_eos=True)) for i in range(n)]
    for s in seqs:
        sched.add(s)
        s.status, s.num_pending_tokens, s.spec = SequenceStatus.RUNNING, 1, SpecState()
        s.token_ids.append(PENDING_TOKEN)
    sched.waiting.clear()
    sched.running.extend(seqs)
    rows = torch.stack([l1, l2[x], torch.zeros(v)] * n)   # rows: after the last token, after x,
    # after y (the bonus row: not looked at)
    sampled = draw(rows)
    batch = Batch(seqs, is_prefill=False, sample=[True] * n, proposals=[[x, y]] * n)
    sched.resolve(batch, sampled)
    t1 = [s.token_ids[1] for s in seqs]
    if mutant:
        again = draw(l1.repeat(n, 1))
        t1 = [a if t != x else t for t, a in zip(t1, again)]
    t2 = [s.token_ids[2] if len(s.token_ids) > 2 else None for s in seqs]
    need = [i for i, t in enumerate(t2) if t is None or mutant]   # a plain step draws t2
    fresh = draw(l2[torch.tensor([t1[i] for i in need])])
    for i, t in zip(need, fresh):
        t2[i] = t
    counts = torch.zeros(v, v)
    for a, b in zip(t1, t2):
        counts[a, b] += 1
    tv = 0.5 * (counts / n - exact).abs().sum().item()
    noise = 0.5 * (exact * (1 - exact) / n).sqrt().sum().item()   # TV's expected size by chance
    assert (tv > 3 * noise) == mutant, (tv, noise)


def test_a_verify_step_in_flight_is_waited_for_when_speculation_stops():
    """Requests arrive while a verify step is in flight and push the batch past
    max_batch: the next steps overlap again, but the verifying sequence waits for its
    answer (how many of its rows count is unknown until then), then decodes plainly
    from where its accepted run left it, its workers told to rewind past rejected rows."""
    cfg = SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)
    sched = Scheduler(cfg, Speculator(SpecConfig(num_tokens=4, max_batch=1, adaptive=False)))
    prompt = [5, 6, 7]
    answer = greedy(prompt, 20)
    a = Sequence(0, prompt, SamplingOptions(temperature=0.0, max_tokens=20, ignore_eos=True,
                                            prediction=tuple(answer[:3] + [1, 1, 1])))
    sched.add(a)
    first = sched.schedule()            # a's prefill
    sched.advance(first)
    sched.resolve(first, [answer[0]])
    verify = sched.schedule()           # a's verify step: answer[1], answer[2], then 1, 1
    assert verify.proposals == [[answer[1], answer[2], 1, 1]]
    sched.advance(verify)               # ... in flight
    for i in (1, 2):
        sched.add(Sequence(i, [9 + i, 4], SamplingOptions(max_tokens=5, ignore_eos=True)))
    prefill = sched.schedule()
    assert a not in prefill.seqs and prefill.is_prefill
    sched.advance(prefill)
    decode = sched.schedule()           # overlapped (3 running > max_batch): a sits out
    assert a not in decode.seqs and decode.proposals is None and len(decode.seqs) == 2
    sched.resolve(verify, [answer[1], answer[2], answer[3], 50, 51])
    assert a.completion_token_ids == answer[:4] and a.num_computed_tokens == len(prompt) + 3
    assert sched.num_kv_stale == 1
    sched.resolve(prefill, [1, 2])
    sched.advance(decode)
    after = sched.schedule()            # a again, plainly, with its rewind
    assert a in after.seqs and after.proposals is None


def test_an_unknown_speculative_method_fails_at_start_with_the_choices():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "scheduler_service", "--model", "m", "--workers",
                           "127.0.0.1:1", "--speculative", "eagle"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'eagle'" in proc.stderr \
        and "'off', 'ngram'" in proc.stderr
    with pytest.raises(ValueError, match="num speculative tokens"):
        SpecConfig(num_tokens=0)


def test_a_draft_that_stops_paying_is_asked_for_now_and_then():
    """--speculative draft: k follows the sequence's acceptance and the rows' measured cost;
    where even one draft does not pay, none is asked for (the steps overlap again), but
    one every MAX_BACKOFF steps, since acceptance is measured only on proposals."""
    from scheduler_service.speculation import SpecConfig, Speculator, SpecState
    spec = Speculator(SpecConfig(method="draft", num_tokens=4))
    spec.cost.a, spec.cost.b = 1.0, 2 / 3   # a row must be accepted with chance > 0.4
    seq = Sequence(0, [1, 2, 3], SamplingOptions(max_tokens=50))
    seq.spec = SpecState()
    assert spec.num_drafts(seq, 40, 1) == 2   # the prior (0.7): 0.7, 0.49 > 0.4 > 0.34
    for _ in range(12):
        seq.spec.record(4, 0)                  # never accepted
    asked = [spec.num_drafts(seq, 40, 1) for _ in range(2 * Speculator.MAX_BACKOFF)]
    assert asked == ([0] * (Speculator.MAX_BACKOFF - 1) + [1]) * 2
    for _ in range(12):
        seq.spec.record(4, 4)                  # all accepted again
    assert spec.num_drafts(seq, 40, 1) == 4
    assert spec.num_drafts(seq, 2, 1) == 2     # no more than the room
    pred = Sequence(1, [1], SamplingOptions(max_tokens=9, prediction=(5, 6)))
    assert spec.num_drafts(pred, 40, 1) == 0   # a prediction is proposed instead
