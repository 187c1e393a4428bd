"""Speculative decoding with a draft model (`--draft-model` on the workers, `--speculative
draft` on the scheduler; worker_service/drafter.py).

In-process: the drafts a step returns are the draft model's own greedy continuation (Hugging
Face on the draft checkpoint) after the sequence's newest token, whatever the step verified:
its KV follows the target's through prefill, placeholders and rejected rows. Through the
services: greedy output equals Hugging Face on the target with a draft that disagrees and
with the target as its own draft (then every proposal is accepted), seeded sampling equals
no speculation, TP=2 (gloo) equals TP=1, and bad set-ups are refused at start.
"""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import transformers

from nanoserve.v1 import generate_pb2, worker_pb2
from services import ROOT, engine_idle, served, start_null_worker, start_tp_workers, start_worker, \
    wait_until
from test_structured import hf_greedy
from tiny_checkpoint import tiny_qwen3_dir

VOCAB = 389
K = 3
BS = 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=21)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A different (smaller) model with the target's tokenizer."""
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=1, hidden_size=32,
                          num_heads=2, num_kv_heads=2, seed=5)


def _hf(path):
    return transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return _hf(target_dir)


# ---- in-process: the drafter ------------------------------------------------------------------

def _prefill(runner, prompt, blocks, **sampling):
    """Step 1: sequence 1's prompt in blocks 0..blocks-1, greedy (or `sampling`) -> its
    prompt + sample."""
    req = worker_pb2.StepRequest(step_id=1)
    w = req.seqs.add(seq_id=1, num_tokens=len(prompt), start_pos=0, sample=True,
                     reset_block_table=True, block_table_i32=np.arange(blocks, dtype="<i4").tobytes())
    w.sampling.temperature = 0.0
    for key, value in sampling.items():
        setattr(w.sampling, key, value)
    req.token_ids_i32 = np.array(prompt, "<i4").tobytes()
    return prompt + np.frombuffer(runner.step(req).sampled_token_ids_i32, "<i4").tolist()


def _decode(runner, step_id, tokens, num_samples, num_drafts, kv_len=None):
    """One decode step of sequence 1 (tokens: its rows' inputs, -1 = the last sample;
    kv_len: its tokens in KV, rejected rows cut off)."""
    req = worker_pb2.StepRequest(step_id=step_id)
    d = req.decode
    if kv_len is not None:
        d.kv_len_i32 = np.array([0, kv_len], "<i4").tobytes()
    d.seq_ids_u64 = np.array([1], "<u8").tobytes()
    d.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    d.num_tokens_i32 = np.array([len(tokens)], "<i4").tobytes()
    d.num_samples_i32 = np.array([num_samples], "<i4").tobytes()
    d.num_drafts_i32 = np.array([num_drafts], "<i4").tobytes()
    resp = runner.step(req)
    return (np.frombuffer(resp.sampled_token_ids_i32, "<i4").tolist(),
            np.frombuffer(resp.draft_token_ids_i32, "<i4").tolist())


@pytest.mark.parametrize("same", [False, True], ids=["other-draft", "target-as-draft"])
def test_drafts_are_the_draft_models_greedy_continuation(target_dir, draft_dir, hf_target, same):
    from worker_service.model_runner import ModelRunner, RunnerConfig
    draft = target_dir if same else draft_dir
    hf_draft = hf_target if same else _hf(draft_dir)
    runner = ModelRunner(RunnerConfig(str(target_dir), device="cpu", dtype="float32",
                                      kv_cache_gb=0.01, draft_model=str(draft)))
    runner.init_kv(16, BS)
    mirrored = []   # rows the draft model is run on beside the target (the mirror)
    eager = runner.drafter.executors[-1]   # (no CUDA graphs on a CPU)
    forward = eager.run

    def spy(step):
        if step.ids is None:   # a mirror (the draft passes bring their own ids)
            mirrored.append(len(step.plan.token_ids))
        return forward(step)
    eager.run = spy
    prompt = [5, 9, 13, 5, 9, 13, 5, 9, 40, 41]
    known = _prefill(runner, prompt, 6)
    # a plain decode step (input: the placeholder) that asks for drafts
    sampled, drafts = _decode(runner, 2, [-1], 1, K)
    known += sampled
    assert known[len(prompt):] == hf_greedy(hf_target, prompt, 2)
    assert drafts == hf_greedy(hf_draft, known, K)
    # verify steps: the drafts as proposals; new drafts follow the accepted run. Their
    # rows are the last step's drafts, whose KV the draft passes wrote: no mirror
    assert mirrored == [len(prompt), 1]
    accepted = []
    for step in range(3, 7):
        sampled, new = _decode(runner, step, [known[-1], *drafts], 1 + K, K, len(known) - 1)
        a = 0
        while a < K and drafts[a] == sampled[a]:
            a += 1
        accepted.append(a)
        known += sampled[:a + 1]
        assert known[len(prompt):] == hf_greedy(hf_target, prompt, len(known) - len(prompt))
        drafts = new
        assert drafts == hf_greedy(hf_draft, known, K), step
    assert mirrored == [len(prompt), 1]
    if same:
        assert accepted == [K] * 4
    # k past the sequence's blocks: as many as fit, -1 after
    room = 6 * BS - len(known)
    sampled, drafts = _decode(runner, 9, [known[-1]], 1, room + 2, len(known) - 1)
    assert drafts[room:] == [-1, -1] and -1 not in drafts[:room]


@pytest.mark.parametrize("catch_up, piece", [(True, 4096), (True, 4), (False, 4096)],
                         ids=["caught-up", "in-pieces", "mutant-without"])
def test_recorded_steps_are_caught_up_before_drafting(target_dir, hf_target, monkeypatch,
                                                      catch_up, piece):
    """Steps bigger than MIRROR_ROWS that ask for no drafts are recorded, not mirrored; when
    a sequence drafts again its recorded positions are run through the draft first (one
    chunked prefill for both sequences here, or pieces of 4 tokens in order), so the drafts
    are the draft model's greedy continuation of the whole context, as if every step had
    been mirrored. Without the catch-up they are not. (The target drafts for itself: a
    draft of two layers, whose KV past the first depends on the positions before.)"""
    from worker_service import drafter as drafter_module
    from worker_service.model_runner import ModelRunner, RunnerConfig
    monkeypatch.setattr(drafter_module, "MIRROR_ROWS", 0)
    monkeypatch.setattr(drafter_module, "CATCH_UP_TOKENS", piece)
    if not catch_up:
        monkeypatch.setattr(drafter_module.Drafter, "_catch_up", lambda self, table, plan: None)
    runner = ModelRunner(RunnerConfig(str(target_dir), device="cpu", dtype="float32",
                                      kv_cache_gb=0.01, draft_model=str(target_dir)))
    runner.init_kv(16, BS)
    hf_draft = hf_target
    prompts = {1: [5, 9, 13, 5, 9, 13, 5, 9, 40, 41], 2: [30 + i for i in range(13)]}
    req = worker_pb2.StepRequest(step_id=1)
    for s, p in prompts.items():
        w = req.seqs.add(seq_id=s, num_tokens=len(p), start_pos=0, sample=True,
                         reset_block_table=True,
                         block_table_i32=np.arange(4 * s - 4, 4 * s, dtype="<i4").tobytes())
        w.sampling.temperature = 0.0
    req.token_ids_i32 = np.array(prompts[1] + prompts[2], "<i4").tobytes()
    known = {s: p + [t] for (s, p), t in zip(prompts.items(),
             np.frombuffer(runner.step(req).sampled_token_ids_i32, "<i4").tolist())}
    for step in range(2, 6):   # plain decode steps (placeholders), recorded
        req = worker_pb2.StepRequest(step_id=step)
        d = req.decode
        d.seq_ids_u64 = np.array([1, 2], "<u8").tobytes()
        d.token_ids_i32 = np.array([-1, -1], "<i4").tobytes()
        d.num_tokens_i32 = np.array([1, 1], "<i4").tobytes()
        if step == 5:
            d.num_samples_i32 = np.array([1, 1], "<i4").tobytes()
            d.num_drafts_i32 = np.array([K, K], "<i4").tobytes()
        resp = runner.step(req)
        for s, t in zip((1, 2), np.frombuffer(resp.sampled_token_ids_i32, "<i4").tolist()):
            known[s].append(t)
    assert runner.drafter.written == sum(map(len, prompts.values())) + 2 * 3
    drafts = np.frombuffer(resp.draft_token_ids_i32, "<i4").reshape(2, K).tolist()
    right = [drafts[i] == hf_greedy(hf_draft, known[s], K) for i, s in enumerate((1, 2))]
    assert right == ([True, True] if catch_up else [False, False])
    assert not runner.drafter.behind or not catch_up


def test_records_the_ring_lost_leave_stale_draft_kv_not_errors(target_dir, draft_dir,
                                                               monkeypatch):
    """A prompt bigger than the ring is not recorded: its sequence's catch-up finds the gap
    and drafts from stale KV (any ids: the target verifies them), and nothing is left behind."""
    from worker_service import drafter as drafter_module
    from worker_service.model_runner import ModelRunner, RunnerConfig
    monkeypatch.setattr(drafter_module, "MIRROR_ROWS", 0)
    monkeypatch.setattr(drafter_module, "RECORD_TOKENS", 2)
    runner = ModelRunner(RunnerConfig(str(target_dir), device="cpu", dtype="float32",
                                      kv_cache_gb=0.01, draft_model=str(draft_dir)))
    runner.init_kv(16, BS)
    known = _prefill(runner, [30 + i for i in range(12)], 6)   # 12 tokens > the ring of 2
    assert runner.drafter.written == 0 and 1 not in runner.drafter.behind
    for step in range(2, 5):   # recorded, wrapping the ring
        known += _decode(runner, step, [-1], 1, 0)[0]
    sampled, drafts = _decode(runner, 5, [-1], 1, K)
    assert len(drafts) == K and all(0 <= t < VOCAB for t in drafts)
    assert not runner.drafter.behind


def test_sampled_drafts_of_the_target_itself_are_all_accepted(target_dir, hf_target):
    """--draft-sampling sampled: a sampled request's drafts are drawn from the draft's q and
    its verify rows keep each with probability min(1, p / q). With the target as its own
    draft q = p, so every draft is kept (the greedy point-mass rule keeps one only where
    the sample happens to equal it), though the drafts are not the greedy continuation."""
    from worker_service.model_runner import ModelRunner, RunnerConfig
    runner = ModelRunner(RunnerConfig(str(target_dir), device="cpu", dtype="float32",
                                      kv_cache_gb=0.01, draft_model=str(target_dir),
                                      draft_sampling="sampled"))
    runner.init_kv(16, BS)
    checked = []
    match = runner.drafter.match

    def spy(plan):
        check = match(plan)
        checked.append(0 if check is None else len(check.rows))
        return check
    runner.drafter.match = spy
    prompt = [5, 9, 13, 5, 9, 13, 5, 9, 40, 41]
    known = _prefill(runner, prompt, 8, temperature=1.0, has_seed=True, seed=3)
    sampled, drafts = _decode(runner, 2, [-1], 1, K)
    known += sampled
    greedy_drafts = 0
    for step in range(3, 9):
        greedy_drafts += drafts == hf_greedy(hf_target, known, K)
        sampled, new = _decode(runner, step, [known[-1], *drafts], 1 + K, K, len(known) - 1)
        assert sampled[:K] == drafts, step   # every draft kept
        known += sampled
        drafts = new
    assert checked == [0, 0] + [K] * 6   # (prefill, first decode; each verify step)
    assert greedy_drafts < 6


def test_fp8_weights_quantize_the_draft_too(target_dir, draft_dir):
    """--quantization fp8 loads the draft as FP8 beside the FP8 target: its drafts are the
    greedy continuation of the same draft run alone in FP8 (its own runner)."""
    from worker_service.model_runner import ModelRunner, RunnerConfig
    runner = ModelRunner(RunnerConfig(str(target_dir), device="cpu", dtype="float32",
                                      kv_cache_gb=0.01, draft_model=str(draft_dir),
                                      quantization="fp8"))
    runner.init_kv(16, BS)
    assert runner.drafter.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    prompt = [5, 9, 13, 5, 9, 13, 5, 9, 40, 41]
    known = _prefill(runner, prompt, 6)
    sampled, drafts = _decode(runner, 2, [-1], 1, K)
    known += sampled
    alone = ModelRunner(RunnerConfig(str(draft_dir), device="cpu", dtype="float32",
                                     kv_cache_gb=0.01, quantization="fp8"))
    alone.init_kv(16, BS)
    ref = _prefill(alone, known, 6)[len(known):]
    for step in range(2, K + 1):
        ref += _decode(alone, step, [-1], 1, 0)[0]
    assert drafts == ref


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(target_dir, tmp_path_factory):
    from worker_service.drafter import check_draft
    other = tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB + 11, num_layers=1, seed=5)
    with pytest.raises(ValueError, match="vocabulary of 400 tokens"):
        check_draft(str(other), str(target_dir), VOCAB)
    renamed = tmp_path_factory.mktemp("renamed")
    for f in target_dir.iterdir():
        (renamed / f.name).write_bytes(f.read_bytes())
    tok = renamed / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"a"', '"A"', 1))
    with pytest.raises(ValueError, match="tokenizer.json differs"):
        check_draft(str(renamed), str(target_dir), VOCAB)
    # the worker refuses to start with it
    out = subprocess.run([sys.executable, "-m", "worker_service", "--model", str(target_dir),
                          "--device", "cpu", "--port", "0", "--draft-model", str(other)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "a draft must share the target's tokenizer" in out.stderr


def test_drafts_without_a_draft_model_are_a_step_error(target_dir):
    from worker_service.model_runner import ModelRunner, RunnerConfig
    from worker_service.step_plan import StepError
    runner = ModelRunner(RunnerConfig(str(target_dir), device="cpu", dtype="float32",
                                      kv_cache_gb=0.01))
    runner.init_kv(8, BS)
    req = worker_pb2.StepRequest(step_id=1)
    req.seqs.add(seq_id=1, num_tokens=2, start_pos=0, sample=True, reset_block_table=True,
                 block_table_i32=np.arange(2, dtype="<i4").tobytes())
    req.token_ids_i32 = np.array([3, 4], "<i4").tobytes()
    runner.step(req)
    with pytest.raises(StepError, match="no --draft-model"):
        _decode(runner, 2, [-1], 1, 2)


# ---- through the services -----------------------------------------------------------------------

def request(prompt, **sampling) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt),
                                        sampling=generate_pb2.SamplingParams(**sampling))


def stats(stub) -> generate_pb2.Stats:
    return stub.GetStats(generate_pb2.StatsRequest())


SCHED = ["--speculative", "draft", "--num-speculative-tokens", str(K), "--no-speculative-adaptive"]
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [30 + i for i in range(20)], [7]]


def _worker(target_dir, draft):
    return start_worker(target_dir, extra=["--draft-model", str(draft)])


def _serve(target_dir, workers, extra=()):
    """The Generation stub of a scheduler speculating with the workers' drafts; everything
    stopped at the end (services.served)."""
    return served(target_dir, workers, BS, [*SCHED, *extra])


@pytest.mark.slow
@pytest.mark.parametrize("same", [False, True], ids=["other-draft", "target-as-draft"])
def test_greedy_and_seeded_output_unchanged(target_dir, draft_dir, hf_target, same):
    with _serve(target_dir, [_worker(target_dir, target_dir if same else draft_dir)]) as stub:
        before = stats(stub)
        for p in PROMPTS:   # alone
            out = stub.Complete(request(p, temperature=0.0, max_tokens=30, ignore_eos=True),
                                timeout=120)
            assert list(out.token_ids) == hf_greedy(hf_target, p, 30)
        after = stats(stub)
        proposed = after.num_spec_proposed_tokens - before.num_spec_proposed_tokens
        accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
        assert after.num_verify_steps > before.num_verify_steps and proposed > 0
        if same:   # every proposal accepted: k + 1 tokens a verify step
            assert accepted == proposed
        prompts = PROMPTS + [[11, 12, 11, 12], [100 + 3 * i for i in range(30)]]
        with ThreadPoolExecutor(8) as pool:   # together, stops and limits inside runs
            futs = [pool.submit(stub.Complete, request(p, temperature=0.0, max_tokens=10 + 7 * i,
                                                       ignore_eos=True), timeout=120)
                    for i, p in enumerate(prompts)]
            for i, (p, f) in enumerate(zip(prompts, futs)):
                assert list(f.result().token_ids) == hf_greedy(hf_target, p, 10 + 7 * i)
        kw = dict(temperature=0.8, top_p=0.9, seed=77, max_tokens=30, ignore_eos=True,
                  logprobs=True, n=2)
        plain = stub.Complete(request(PROMPTS[1], speculative=False, **kw), timeout=120)
        spec = stub.Complete(request(PROMPTS[1], **kw), timeout=120)
        for a, b in zip(plain.choices, spec.choices):
            assert list(a.token_ids) == list(b.token_ids)
            assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=1e-4)
        assert wait_until(lambda: engine_idle(stub)), "blocks leaked"


@pytest.mark.slow
def test_tp2_with_a_draft_equals_hf(target_dir, draft_dir, hf_target):
    workers = start_tp_workers(target_dir, 2, extra=["--draft-model", str(draft_dir)])
    with _serve(target_dir, workers) as stub:
        for p in PROMPTS[:2]:
            out = stub.Complete(request(p, temperature=0.0, max_tokens=24, ignore_eos=True),
                                timeout=180)
            assert list(out.token_ids) == hf_greedy(hf_target, p, 24)
        assert stats(stub).num_verify_steps > 0


def test_null_worker_drafts_are_all_accepted(target_dir):
    """The control plane alone: the null worker drafts its own next ids, so every verify
    step gives k + 1 tokens, and the streams are the null worker's ids."""
    from worker_service.null_worker import expected_tokens
    with _serve(target_dir, [start_null_worker(target_dir)]) as stub:
        prompts = [[3 + i, 4, 5] for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(stub.Complete, request(p, temperature=0.0, max_tokens=40,
                                                       ignore_eos=True), timeout=60)
                    for p in prompts]
            for p, f in zip(prompts, futs):
                assert list(f.result().token_ids) == expected_tokens(p, 40, VOCAB, 0) or \
                    list(f.result().token_ids) == _null_ids(target_dir, p, 40)
        s = stats(stub)
        assert s.num_spec_proposed_tokens > 0
        assert s.num_spec_accepted_tokens == s.num_spec_proposed_tokens
        assert s.num_decode_steps < 6 * 40 / 2   # most steps give k + 1 tokens


def _null_ids(model_dir, prompt, n):
    from worker_service.null_worker import expected_tokens, model_limits
    lim = model_limits(str(model_dir))
    return expected_tokens(prompt, n, lim["vocab_size"], lim["eos_token_id"])


def test_scheduler_refuses_draft_without_a_draft_model(target_dir):
    worker = start_worker(target_dir)
    try:
        out = subprocess.run([sys.executable, "-m", "scheduler_service", "--model", str(target_dir),
                              "--workers", f"127.0.0.1:{worker.port}", "--port", "0", *SCHED],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0
        assert "the workers have no draft model" in out.stderr + out.stdout
    finally:
        worker.stop()


def test_plan_subset_keeps_its_rows_and_their_placeholders():
    """The mirror's sub-plan: the kept rows' tokens, positions, slots and tables, the
    placeholders re-pointed at their new places, nothing sampled; sampled (SplitGraphs'
    halves): the kept rows' sampling too."""
    from worker_service.step_plan import SeqTable
    table = SeqTable(num_blocks=8, block_size=4, vocab_size=50, max_model_len=32)
    req = worker_pb2.StepRequest(step_id=1)
    for seq_id, n in ((1, 3), (2, 2)):
        w = req.seqs.add(seq_id=seq_id, num_tokens=n, start_pos=0, sample=True,
                         reset_block_table=True,
                         block_table_i32=np.array([2 * seq_id, 2 * seq_id + 1], "<i4").tobytes())
    req.token_ids_i32 = np.array([1, 2, 3, 4, 5], "<i4").tobytes()
    table.commit(table.plan(req))
    req = worker_pb2.StepRequest(step_id=2)
    d = req.decode
    d.seq_ids_u64 = np.array([1, 2], "<u8").tobytes()
    d.token_ids_i32 = np.array([9, 10, 11, -1], "<i4").tobytes()   # seq 1: 3 rows, seq 2: 1
    d.num_tokens_i32 = np.array([3, 1], "<i4").tobytes()
    d.num_samples_i32 = np.array([3, 1], "<i4").tobytes()
    plan = table.plan(req)
    sub = plan.subset(np.array([False, False, True, True]), sampled=False)
    assert sub.seq_ids == [1, 2] and sub.token_ids.tolist() == [11, -1]
    assert sub.positions.tolist() == [5, 2] and sub.slot_mapping.tolist() == [13, 18]
    assert sub.fill[0].tolist() == [1] and sub.fill[1].tolist() == [1] and not sub.sample.any()
    assert sub.block_tables.tolist() == [[2, 3], [4, 5]]
    assert plan.subset(np.zeros(4, bool)) is None
    kept = plan.subset(np.array([False, True, False, True]))
    assert kept.sample.tolist() == [plan.sample[1], plan.sample[3]]
    assert kept.sampling == [p for p, k in zip(plan.sampling, [False, True, False, True])
                             if k] and len(kept.sampling) == kept.num_samples == 2


def test_launcher_gives_every_worker_the_draft_and_the_scheduler_draft_speculation():
    from scheduler_service.launch import commands, parse_args
    cmds = commands(parse_args(["--model", "/m", "--tp", "2", "--draft-model", "/d", "--",
                                "--num-speculative-tokens", "3"]))
    for worker in cmds[:2]:
        assert worker[worker.index("--draft-model") + 1] == "/d"
    sched = cmds[-1]
    assert sched[sched.index("--speculative") + 1] == "draft"
    assert sched[-2:] == ["--num-speculative-tokens", "3"]
    assert "--draft-model" not in commands(parse_args(["--model", "/m"]))[0]


@pytest.mark.slow
def test_preemption_and_a_killed_worker_keep_greedy_output(target_dir, draft_dir, hf_target):
    """A KV cache too small for the batch (sequences preempted while their drafts hold
    reserved blocks), then the worker SIGKILLed mid-run and started again with its draft
    model (its draft KV rebuilt with the target's by re-prefill): every stream is HF
    greedy, and no block stays in use."""
    extra = ["--draft-model", str(draft_dir)]
    workers = [start_worker(target_dir, extra=extra)]
    with _serve(target_dir, workers, ["--num-kv-blocks", "24"]) as stub:
        n = 70
        prompts = [PROMPTS[0], PROMPTS[1], [40 + i for i in range(12)], [9, 8, 7, 6, 5]]
        refs = [hf_greedy(hf_target, p, n) for p in prompts]
        streams = [stub.Generate(request(p, temperature=0.0, max_tokens=n, ignore_eos=True),
                                 timeout=240) for p in prompts]
        got = [[] for _ in streams]
        while len(got[0]) < 25:
            got[0] += next(streams[0]).token_ids
        port = workers[0].port
        workers[0].stop(sig=9)
        workers[0] = start_worker(target_dir, port=port, extra=extra)
        for i, s in enumerate(streams):
            for chunk in s:
                got[i] += chunk.token_ids
        assert got == refs
        s = stats(stub)
        assert s.num_preemptions > 0 and s.num_verify_steps > 0
        assert wait_until(lambda: engine_idle(stub)), "blocks leaked"


def formats_unchanged_by_drafts(stub, kinds, prompts, max_tokens: int) -> None:
    """Each output format's greedy output with drafts equals the request's without
    speculation, and both validate, as a sampled one does."""
    from test_structured import FORMATS, judge
    for kind in kinds:
        fmt = generate_pb2.StructuredOutput(**FORMATS[kind])
        for prompt in prompts:
            def req(**kw):
                r = request(prompt, max_tokens=max_tokens, **kw)
                r.sampling.structured.CopyFrom(fmt)
                r.skip_special_tokens = True
                return r
            plain = stub.Complete(req(temperature=0.0, speculative=False), timeout=120)
            judge(kind, plain.text)
            out = stub.Complete(req(temperature=0.0), timeout=120)
            assert list(out.token_ids) == list(plain.token_ids), kind
            judge(kind, stub.Complete(req(temperature=1.0, seed=3), timeout=120).text)


@pytest.mark.slow
def test_structured_output_with_drafts(target_dir):
    """Constrained requests take drafts too: the engine core cuts what the format forbids
    from them, the sampling rank masks every verify row. With the target as its own draft
    the proposals are its unconstrained greedy tokens, often right, sometimes forbidden:
    greedy output equals the same request without speculation, sampled output validates,
    and the engine core's forced tokens never disagree with the worker's samples."""
    with _serve(target_dir, [_worker(target_dir, target_dir)]) as stub:
        before = stats(stub)
        formats_unchanged_by_drafts(stub, ("json_schema", "regex", "grammar"),
                                    ([3, 5, 11], [3, 9, 11, 20]), 120)
        after = stats(stub)
        assert after.num_spec_proposed_tokens > before.num_spec_proposed_tokens
        assert after.num_fast_forward_mismatches == 0


@pytest.mark.slow
def test_penalties_and_logprobs_with_drafts_equal_no_speculation(target_dir):
    """Penalties count a verify row's proposals before it (the sampling rank's penalty
    state), top logprobs are the raw model's: with the target as its own draft (proposals
    accepted) both equal the request without speculation."""
    with _serve(target_dir, [_worker(target_dir, target_dir)]) as stub:
        for kw in (dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
                   dict(temperature=0.0, frequency_penalty=0.4, logprobs=True, top_logprobs=3),
                   dict(temperature=0.7, seed=5, repetition_penalty=1.2, n=2)):
            common = dict(max_tokens=40, ignore_eos=True, **kw)
            plain = stub.Complete(request(PROMPTS[0], speculative=False, **common), timeout=120)
            spec = stub.Complete(request(PROMPTS[0], **common), timeout=120)
            assert len(plain.choices) == len(spec.choices) == kw.get("n", 1)
            for a, b in zip(plain.choices, spec.choices):
                assert list(a.token_ids) == list(b.token_ids), kw
                assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=1e-4)
                assert [list(t.token_ids) for t in a.top_logprobs] == \
                    [list(t.token_ids) for t in b.top_logprobs]
        assert stats(stub).num_spec_accepted_tokens > 0


@pytest.mark.slow
def test_tp2_sampled_drafts_of_the_target_are_all_accepted(target_dir, hf_target, monkeypatch):
    """--draft-sampling sampled at TP=2 (gloo): both ranks draw the same drafts (noise keyed
    by step and pass, or a seeded request's seed and position), so with the target as its
    own draft q = p and every sampled draft is kept; greedy output stays HF's, and a seeded
    request draws the same tokens twice. Every step that asks for no drafts (the prefills)
    is recorded, not mirrored (NANOSERVE_DRAFT_MIRROR_ROWS=0): the catch-up before the
    first drafts must leave the draft's KV as a mirror would, or drafts are rejected."""
    monkeypatch.setenv("NANOSERVE_DRAFT_MIRROR_ROWS", "0")
    workers = start_tp_workers(target_dir, 2, extra=["--draft-model", str(target_dir),
                                                     "--draft-sampling", "sampled"])
    with _serve(target_dir, workers) as stub:
        out = stub.Complete(request(PROMPTS[1], temperature=0.0, max_tokens=16, ignore_eos=True),
                            timeout=180)
        assert list(out.token_ids) == hf_greedy(hf_target, PROMPTS[1], 16)
        before = stats(stub)
        kw = dict(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, n=2)
        first = stub.Complete(request(PROMPTS[0], **kw), timeout=180)
        again = stub.Complete(request(PROMPTS[0], **kw), timeout=180)
        assert [list(c.token_ids) for c in first.choices] == \
            [list(c.token_ids) for c in again.choices]
        stub.Complete(request(PROMPTS[1], temperature=1.0, max_tokens=24, ignore_eos=True, n=2),
                      timeout=180)   # (unseeded: noise keyed by the step)
        after = stats(stub)
        proposed = after.num_spec_proposed_tokens - before.num_spec_proposed_tokens
        assert proposed > 30
        assert after.num_spec_accepted_tokens - before.num_spec_accepted_tokens == proposed
