"""CUDA graphs' static inputs (worker_service/cuda_graphs.py) on CPU.

A graph replays what `PrefillGraphs.forward(bucket)` (`DecodeGraphs._forward(bucket)`)
computes on its static inputs, so this runs that computation without a graph (CPU,
Triton interpreter) and checks that a step's rows padded to its bucket (one sequence,
several, prompt chunks beside decode rows, pooling rows) give the eager step's logits and
pooled states and write the same KV slots and no others, that a mixed step of more rows
split over a decode and a prefill replay gives the eager step's, and that a decode step
with fast-forward rows, loaded with its runs, gives what the rows give one by one. The
graphs themselves: tests/gpu/test_model_gpu.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nanoserve.v1 import worker_pb2
from tiny_checkpoint import tiny_qwen3_dir
from kernels.attention import decode_runs
from worker_service import step_meta
from types import SimpleNamespace

from worker_service.cuda_graphs import (ROWS, DecodeGraphs, PrefillGraphs, SplitGraphs, _Graph,
                                        rows_out, token_buckets)
from worker_service.executors import StepInputs
from worker_service.model_runner import ModelRunner, RunnerConfig

BS = 16


def test_token_buckets_pad_little():
    b = token_buckets(2048)
    assert b[:8] == list(range(64, 513, 64)) and b[8:] == list(range(640, 2049, 128))
    for n in range(1, 2049):
        pad = next(x for x in b if x >= n) - n
        assert pad < (64 if n <= 512 else 128)
    assert token_buckets(200) == [64, 128, 192] and token_buckets(63) == []


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tiny_qwen3_dir(tmp_path_factory)
    r = ModelRunner(RunnerConfig(model_dir=str(path), device="cpu", dtype="float32",
                                 attention_backend="triton", kv_cache_gb=0.01,
                                 max_model_len=256))
    r.init_kv(64, BS)
    return r


def prefill(step_id, seq_id, tokens, start, table=None, sample=True):
    req = worker_pb2.StepRequest(step_id=step_id)
    w = req.seqs.add(seq_id=seq_id, num_tokens=len(tokens), start_pos=start, sample=sample,
                     reset_block_table=table is not None)
    if table is not None:
        w.block_table_i32 = np.array(table, "<i4").tobytes()
        w.sampling.temperature = 0.0
    req.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    return req


def replayed(pg, step):
    """What PrefillGraphs.run gives, computed without a graph (load + forward)."""
    return rows_out(step.plan, *pg.forward(pg.load(step)))


def padded_matches_eager(runner, pg, plan):
    """Eager logits == padded logits; the padded run writes only the plan's slots, and the
    same values there."""
    before = runner.kv_cache.clone()
    eager = runner.forward(plan).out
    after_eager = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    padded = replayed(pg, StepInputs(plan)).out
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.kv_cache, after_eager, rtol=1e-5, atol=1e-5)
    slots = torch.from_numpy(plan.slot_mapping.astype(np.int64))
    flat = lambda kv: kv.reshape(2, kv.shape[1], -1, *kv.shape[-2:])   # [2, L, slots, Hkv, D]
    written = flat(runner.kv_cache)[:, :, slots]
    assert written.abs().sum() > 0
    untouched = torch.ones(flat(before).shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat(runner.kv_cache)[:, :, untouched], flat(before)[:, :, untouched])


@pytest.mark.parametrize("n", [2, 63, 64, 65, 130])
def test_padded_prefill_matches_eager(runner, n):
    runner.kv_cache.zero_()
    pg = PrefillGraphs(runner.model, 192, runner.max_model_len, BS, runner.device)
    gen = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
    table = list(range(3, 3 + -(-n // BS)))[::-1]   # blocks out of order
    plan = runner.table.plan(prefill(1, 100 + n, tokens, 0, table))
    assert pg.fits(StepInputs(plan))
    padded_matches_eager(runner, pg, plan)
    runner.table.commit(plan)


def test_padded_chunk_after_a_cached_prefix_matches_eager(runner):
    """The second chunk of a prompt attends to the first one's keys in the cache."""
    runner.kv_cache.zero_()
    pg = PrefillGraphs(runner.model, 192, runner.max_model_len, BS, runner.device)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, runner.vocab_size, (100,), generator=gen).tolist()
    table = [9, 2, 11, 5, 30, 6, 7]
    first = runner.table.plan(prefill(1, 7, tokens[:40], 0, table, sample=False))
    assert runner.forward(first).out is None          # a chunk that samples nothing
    runner.table.commit(first)
    second = runner.table.plan(prefill(2, 7, tokens[40:], 40))
    assert second.start_pos[0] == 40 and pg.fits(StepInputs(second))
    padded_matches_eager(runner, pg, second)


def several(step_id, rows):
    """rows: [(seq_id, tokens, start, table or None, sample)] -> one prefill StepRequest."""
    req = worker_pb2.StepRequest(step_id=step_id)
    for seq_id, tokens, start, table, sample in rows:
        w = req.seqs.add(seq_id=seq_id, num_tokens=len(tokens), start_pos=start, sample=sample,
                         reset_block_table=table is not None)
        if table is not None:
            w.block_table_i32 = np.array(table, "<i4").tobytes()
            w.sampling.temperature = 0.0
    req.token_ids_i32 = np.array([t for r in rows for t in r[1]], "<i4").tobytes()
    return req


def test_a_few_sequences_share_one_replay(runner):
    """Rows of a several-sequence prefill step, padded together to one bucket, give the
    eager batch's logits for the rows that sample."""
    runner.kv_cache.zero_()
    pg = PrefillGraphs(runner.model, 256, runner.max_model_len, BS, runner.device)
    gen = torch.Generator().manual_seed(11)
    tok = lambda n: torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
    head = tok(30)
    runner.table.commit(runner.table.plan(prefill(1, 21, head, 0, [40, 41, 42, 43], sample=False)))
    plan = runner.table.plan(several(2, [(20, tok(70), 0, [1, 2, 3, 4, 5], True),
                                         (21, tok(25), 30, None, True),      # after its prefix
                                         (22, tok(9), 0, [9], False),        # a first chunk
                                         (23, tok(130), 0, list(range(10, 19)), True)]))
    assert pg.fits(StepInputs(plan)) and plan.num_samples == 3
    padded_matches_eager(runner, pg, plan)


def test_chunks_beside_decode_rows_share_one_replay(runner):
    """A mixed step (a prompt chunk after its cached prefix, a new prompt, two decode rows
    whose input is the last step's sample, a placeholder filled on the device): one replay
    gives the eager step's logits and KV."""
    runner.kv_cache.zero_()
    pg = PrefillGraphs(runner.model, 128, runner.max_model_len, BS, runner.device)
    gen = torch.Generator().manual_seed(12)
    tok = lambda n: torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
    first = runner.table.plan(several(1, [(31, tok(20), 0, [50, 51], True),
                                          (32, tok(5), 0, [52], True),
                                          (33, tok(40), 0, [53, 54, 55, 56], False)]))
    runner.forward(first)
    runner.table.commit(first)
    req = several(2, [(33, tok(24), 40, None, True), (34, tok(17), 0, [57, 58], True)])
    req.decode.seq_ids_u64 = np.array([31, 32], "<u8").tobytes()
    req.decode.token_ids_i32 = np.array([-1, 7], "<i4").tobytes()   # 31's: last step's sample
    plan = runner.table.plan(req)
    assert not plan.is_decode and len(plan.rows) == 4 and plan.fill is not None
    sample = torch.tensor([11, 12, 13], dtype=torch.int64)   # the last step's samples (rows)
    fill = (torch.from_numpy(plan.fill[0]), sample[torch.from_numpy(plan.fill[1])])
    step = StepInputs(plan, fill=fill)
    assert pg.fits(step)
    before = runner.kv_cache.clone()
    eager = runner.executors[-1].run(step).out
    after_eager = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    torch.testing.assert_close(replayed(pg, step).out, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.kv_cache, after_eager, rtol=1e-5, atol=1e-5)


def test_pooling_rows_share_one_replay(runner, monkeypatch):
    """An embedding request's documents (pooling rows) beside a sampling row: one replay
    gives the eager step's pooled hidden states and logits."""
    monkeypatch.setattr(runner.table, "tasks", frozenset())   # (every task: generate + embed)
    runner.kv_cache.zero_()
    pg = PrefillGraphs(runner.model, 128, runner.max_model_len, BS, runner.device)
    gen = torch.Generator().manual_seed(13)
    tok = lambda n: torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
    req = several(1, [(41, tok(30), 0, [20, 21], True), (42, tok(12), 0, [22], True),
                      (43, tok(50), 0, [23, 24, 25, 26], True)])
    for w in (req.seqs[0], req.seqs[2]):
        w.pooling.kind = worker_pb2.WorkerPooling.KIND_EMBED
    plan = runner.table.plan(req)
    assert plan.pool.tolist() == [True, False, True] and plan.num_samples == 1
    step = StepInputs(plan)
    assert pg.fits(step)
    eager = runner.executors[-1].run(step)
    got = replayed(pg, step)
    torch.testing.assert_close(got.pooled, eager.pooled, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.out, eager.out, rtol=1e-4, atol=1e-4)


def without_graphs(g, forward) -> None:
    """Give executor `g` a stand-in graph per bucket whose replay runs `forward(bucket)` (the
    captured computation) into the bucket's output buffers, so `g.run` works on CPU."""
    for b in g.buckets:
        out = forward(b)
        def replay(b=b, out=out):
            for dst, src in zip(out if isinstance(out, tuple) else (out,),
                                (lambda o: o if isinstance(o, tuple) else (o,))(forward(b))):
                dst.copy_(src)
        g.graphs[b] = _Graph(SimpleNamespace(replay=replay), out)


def test_a_mixed_step_of_many_rows_splits_over_a_decode_and_a_prefill_replay(runner, monkeypatch):
    """22 rows: a one-token prompt (a decode-graph row), a 40-token prompt, two pooled
    documents (one of one token: it stays with the prefill replay), then 18 decode rows, one
    a placeholder: too many rows for one prefill replay, so SplitGraphs runs the decode
    rows through DecodeGraphs and the rest through PrefillGraphs; the logits (in the step's
    sampling order, which the two replays interleave), pooled states and KV equal eager's."""
    monkeypatch.setattr(runner.table, "tasks", frozenset())   # (every task: generate + embed)
    runner.kv_cache.zero_()
    dg = DecodeGraphs(runner.model, runner.backend, 32, runner.max_model_len, BS,
                      runner.num_kv_heads, runner.device)
    pg = PrefillGraphs(runner.model, 128, runner.max_model_len, BS, runner.device)
    without_graphs(dg, lambda b: dg._forward(b).out)
    without_graphs(pg, pg.forward)
    gen = torch.Generator().manual_seed(14)
    tok = lambda n: torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
    running = list(range(61, 79))
    first = runner.table.plan(several(1, [(s, tok(3), 0, [s - 31], True) for s in running]))
    runner.forward(first)
    runner.table.commit(first)
    req = several(2, [(80, tok(1), 0, [48], True), (81, tok(40), 0, [49, 50, 51], True),
                      (82, tok(12), 0, [52], True), (83, tok(1), 0, [53], True)])
    for w in (req.seqs[2], req.seqs[3]):
        w.pooling.kind = worker_pb2.WorkerPooling.KIND_EMBED
    req.decode.seq_ids_u64 = np.array(running, "<u8").tobytes()
    req.decode.token_ids_i32 = np.array([-1] + tok(17), "<i4").tobytes()   # 61's: last sample
    plan = runner.table.plan(req)
    assert len(plan.rows) == 22 and plan.num_samples == 20 and plan.fill is not None
    last = torch.arange(100, 118, dtype=torch.int64)   # the last step's samples (rows)
    step = StepInputs(plan, fill=(torch.from_numpy(plan.fill[0]),
                                  last[torch.from_numpy(plan.fill[1])]))
    split = SplitGraphs(dg, pg)
    assert not pg.fits(step) and split.fits(step)
    before = runner.kv_cache.clone()
    eager = runner.executors[-1].run(step)
    after_eager = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    got = split.run(step)
    torch.testing.assert_close(got.out, eager.out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.pooled, eager.pooled, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.kv_cache, after_eager, rtol=1e-5, atol=1e-5)
    # what does not fit: more prompt rows than one prefill replay holds, or no decode row
    many = runner.table.plan(several(3, [(s, tok(2), 0, [s - 90], True) for s in range(90, 107)]
                                     ))
    assert not split.fits(StepInputs(many)) and not split.fits(StepInputs(plan.subset(~split.decode_rows(plan))))


def test_what_fits(runner):
    pg = PrefillGraphs(runner.model, 128, runner.max_model_len, BS, runner.device)
    rows = lambda k, n: several(1, [(s, list(range(n)), 0, [s], True) for s in range(1, k + 1)])
    fits = lambda plan: pg.fits(StepInputs(plan))
    assert fits(runner.table.plan(rows(ROWS, 8)))                           # 128 tokens in all
    assert not fits(runner.table.plan(rows(ROWS, 9)))                       # 144: past the largest
    assert not fits(runner.table.plan(rows(ROWS + 1, 2)))                   # one row too many
    assert not fits(runner.table.plan(prefill(1, 3, [5], 0, [4])))         # one token: decode
    assert not fits(runner.table.plan(prefill(1, 4, list(range(129)), 0, list(range(9)))))


def test_decode_graph_inputs_with_fast_forward_rows_match_rows_one_by_one(runner, monkeypatch):
    """Seq 1's sample and 3 forced tokens as 4 decode rows (one run, crossing a block), seq
    2 one row. DecodeGraphs.load + _forward (the graph's computation, runs in its buffer)
    and the eager step with runs give the logits and KV of the eager step with a program
    per row (runs off)."""
    runner.kv_cache.zero_()
    first = runner.table.plan(prefill(1, 1, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
                                      0, [4, 9]))
    runner.forward(first).out
    runner.table.commit(first)
    second = runner.table.plan(prefill(2, 2, [21, 22, 23], 0, [7]))
    runner.forward(second).out
    runner.table.commit(second)
    req = worker_pb2.StepRequest(step_id=3)
    req.decode.seq_ids_u64 = np.array([1, 2], "<u8").tobytes()
    req.decode.token_ids_i32 = np.array([30, 31, 32, 33, 40], "<i4").tobytes()
    req.decode.num_tokens_i32 = np.array([4, 1], "<i4").tobytes()
    plan = runner.table.plan(req)
    assert plan.is_decode and decode_runs(plan.rows).tolist() == [[0, 1, 2, 3, 0], [4, 3, 2, 1, 1]]
    before = runner.kv_cache.clone()

    def fresh():
        runner.kv_cache.copy_(before)

    with_runs = runner.forward(plan).out
    kv_runs = runner.kv_cache.clone()
    fresh()
    with monkeypatch.context() as m:
        m.setattr(step_meta, "decode_runs", lambda rows: None)
        one_by_one = runner.forward(plan).out
    kv_rows = runner.kv_cache.clone()
    fresh()
    dg = DecodeGraphs(runner.model, runner.backend, 8, runner.max_model_len, BS,
                      runner.num_kv_heads, runner.device)
    bs = dg.load(StepInputs(plan))
    assert bs == 8 and dg.runs[:2 * bs].view(2, bs)[:, :5].tolist() == [[0, 1, 2, 3, 0], [4, 3, 2, 1, 1]]
    graph = dg._forward(bs).out[np.flatnonzero(plan.sample)]
    torch.testing.assert_close(with_runs, one_by_one, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graph, one_by_one, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_runs, kv_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.kv_cache, kv_rows, rtol=1e-5, atol=1e-5)


def test_a_decode_graph_samples_the_usual_step(runner, monkeypatch):
    """DecodeGraphs(sample=True): the replay's computation (load + _forward) samples each
    row from the temperatures and seeds among its static inputs, and the runner answers
    the step with those ids: the tokens the sampler (sample_plan, the fused kernel) draws
    from the same logits, seeded rows included, greedy rows their argmax. A step whose
    sampling is not the usual one (a row wants logprobs) is left to the sampler."""
    from models import kernel_choice
    from worker_service.logits_processors import graph_sampling, sample_plan
    from worker_service.model_runner import ModelRunner
    monkeypatch.setattr(kernel_choice, "FUSED_ON_CPU", True)   # the sampler's fused kernel
    monkeypatch.setattr(ModelRunner, "sample_in_graph", property(lambda self: True))
    runner.kv_cache.zero_()
    gen = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
    seqs = [(120, 0.0, None), (121, 0.9, 7), (122, 1.3, 11)]   # (seq id, temperature, seed)
    req = several(1, [(s, tok(5), 0, [40 + i], True) for i, (s, _, _) in enumerate(seqs)])
    for w, (_, temp, seed) in zip(req.seqs, seqs):
        w.sampling.temperature = temp
        if seed is not None:
            w.sampling.seed, w.sampling.has_seed = seed, True
    first = runner.table.plan(req)
    runner.forward(first)
    runner.table.commit(first)
    ids = tok(3)

    def decode(step_id):
        r = worker_pb2.StepRequest(step_id=step_id)
        r.decode.seq_ids_u64 = np.array([s for s, _, _ in seqs], "<u8").tobytes()
        r.decode.token_ids_i32 = np.array(ids, "<i4").tobytes()
        return r

    dg = DecodeGraphs(runner.model, runner.backend, 8, runner.max_model_len, BS,
                      runner.num_kv_heads, runner.device, sample=True)
    plan = runner.table.plan(decode(2))   # (not committed: step 3 plans the same step)
    sampling = graph_sampling(plan, runner.vocab_size, None, None, None)
    assert sampling is not None and sampling[0].tolist() == pytest.approx([0.0, 0.9, 1.3])
    before = runner.kv_cache.clone()
    bs = dg.load(StepInputs(plan, sampling=sampling))
    assert bs == 4 and dg.temperature[:bs].tolist() == pytest.approx([0.0, 0.9, 1.3, 0.0])
    out = dg._forward(bs)
    logits, tokens = out.out[:3], out.tokens[:3]
    reference = sample_plan(logits, plan, runner.vocab_size, None, None).tokens
    assert tokens.tolist() == reference.tolist()
    assert tokens[0] == logits[0].argmax()
    # the runner answers with the replay's ids (a stand-in graph runs the computation)
    for b in dg.buckets:
        f = dg._forward(b)

        def replay(b=b, f=f):
            g = dg._forward(b)
            f.out.copy_(g.out)
            f.tokens.copy_(g.tokens)
        dg.graphs[b] = _Graph(SimpleNamespace(replay=replay), f.out, None, f.tokens)
    runner.kv_cache.copy_(before)
    monkeypatch.setattr(runner, "executors", [dg, *runner.executors])
    calls = []
    monkeypatch.setattr(runner, "_sample",
                        lambda *a: calls.append(a) or ModelRunner._sample(runner, *a))
    answer = runner.finish(runner.launch(decode(3)))
    assert not calls   # sampled in the replay
    assert np.frombuffer(answer.sampled_token_ids_i32, "<i4").tolist() == tokens.tolist()
    # a row that wants logprobs: the sampler's step
    row = runner.table.row_of[121]
    runner.table.params[row] = dataclasses.replace(runner.table.params[row], logprobs=True)
    answer = runner.finish(runner.launch(decode(4)))
    assert len(calls) == 1 and len(answer.logprobs_f32) == 12


def test_a_decode_graph_gathers_placeholders_in_its_own_copy(runner):
    """A decode step whose every row is a placeholder (the last step's sample): DecodeGraphs.
    load sends the rows' places among the last samples with its other inputs and gathers
    the ids on the device, without StepInputs.placeholders' own copy and gather; with one
    explicit id beside them it fills the general way. Both give the ids input_ids (the
    eager path's) gives."""
    from worker_service.executors import input_ids
    seqs = [130, 131, 132]
    first = runner.table.plan(several(1, [(s, [5, 6, 7], 0, [50 + i], True)
                                          for i, s in enumerate(seqs)]))
    runner.table.commit(first)   # their samples are rows 0-2 of this step's
    last = torch.tensor([900, 901, 902], dtype=torch.int64)
    dg = DecodeGraphs(runner.model, runner.backend, 8, runner.max_model_len, BS,
                      runner.num_kv_heads, runner.device)
    for ids, gathered in (([-1, -1, -1], True), ([-1, 17, -1], False)):
        req = worker_pb2.StepRequest(step_id=2)
        req.decode.seq_ids_u64 = np.array(seqs[::-1], "<u8").tobytes()   # rows 2, 1, 0
        req.decode.token_ids_i32 = np.array(ids, "<i4").tobytes()
        plan = runner.table.plan(req)
        step = StepInputs(plan, last=last)
        dg.load(step)
        want = input_ids(StepInputs(plan, last=last), runner.device)
        assert dg.input_ids[:3].tolist() == want.tolist() == [
            902 if ids[0] < 0 else ids[0], 901 if ids[1] < 0 else ids[1], 900]
        assert (step.fill is None) == gathered   # placeholders() was not asked
