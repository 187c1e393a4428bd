"""EAGLE-3 draft heads (models/eagle3.py, worker_service/drafter.Eagle3Drafter).

The reference is tests/eagle3_reference.py: a plain-torch head written from the published
architecture (vLLM / SGLang / speculators), run over whole sequences without a cache, fed
the target's hidden states from Hugging Face (output_hidden_states). The head's forward
equals it in both checkpoint layouts; the drafts a worker returns equal the reference's
greedy drafting after every step, whether the step's proposals were all accepted or all
rejected; through the services greedy output equals Hugging Face's (TP=2 too); heads made
for another target are refused at start.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from eagle3_reference import eagle3_draft_reference, eagle3_forward, eagle3_fuse
from nanoserve.v1 import generate_pb2
from services import ROOT, served, start_tp_workers, start_worker
from test_draft import _decode, _prefill, formats_unchanged_by_drafts
from test_structured import hf_greedy
from tiny_checkpoint import tiny_qwen3_dir
from tiny_eagle3 import load_reference_state, make_tiny_eagle3

VOCAB, HIDDEN, LAYERS, K, BS = 389, 64, 8, 3, 8
SCHED = ["--speculative", "draft", "--num-speculative-tokens", str(K), "--no-speculative-adaptive"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=LAYERS, seed=31)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def _head(tmp_path_factory, layout, **kw):
    return make_tiny_eagle3(tmp_path_factory.mktemp(f"eagle3-{layout}"), layout,
                            target_hidden_size=HIDDEN, vocab_size=VOCAB, draft_vocab_size=200,
                            hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=96, seed=kw.pop("seed", 3), **kw)


@pytest.fixture(scope="module", params=["speculators", "eagle"])
def head_dir(request, tmp_path_factory):
    return _head(tmp_path_factory, request.param)


def _aux(hf_target, ids, layers):
    """The target's features of ids: its hidden states entering `layers`, concatenated."""
    with torch.no_grad():
        out = hf_target(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


def test_head_forward_equals_the_reference(head_dir, target_dir, hf_target):
    from kernels.attention import new_kv_cache, select_backend
    from models.eagle3 import load_eagle3
    from worker_service.step_meta import step_metadata
    from worker_service.step_plan import StepPlan
    state, cfg = load_reference_state(head_dir)
    head = load_eagle3(str(head_dir), hf_target.config, hf_target.model.embed_tokens,
                       select_backend("torch"), torch.device("cpu"), torch.float32)
    assert head.cfg.aux_layers == (2, 4, 5)   # the default for 8 layers
    cache = new_kv_cache(1, 4, BS, 2, 16, torch.float32, "cpu")
    head.attn.k_cache, head.attn.v_cache = cache[0, 0], cache[1, 0]
    ids = [5, 9, 13, 40, 41, 7, 300, 2, 2, 90, 11]
    n = len(ids) - 1
    aux = _aux(hf_target, ids[:n], head.cfg.aux_layers)
    pos = np.arange(n)
    plan = StepPlan(step_id=0, seq_ids=[1], rows=np.array([0]), num_tokens=np.array([n]),
                    start_pos=np.array([0]), token_ids=np.zeros(n, np.int64), positions=pos,
                    slot_mapping=pos.astype(np.int32), block_tables=np.array([[0, 1]], np.int32),
                    sample=np.array([True]), fill=None)
    with torch.no_grad():
        got, h = head(torch.tensor(ids[1:]), head.fuse(aux), torch.tensor(pos),
                      step_metadata(plan, torch.device("cpu")))
        embeds = hf_target.model.embed_tokens.weight[torch.tensor(ids[1:])]
        logits, ref_h = eagle3_forward(state, cfg, embeds, eagle3_fuse(state, aux))
    torch.testing.assert_close(h, ref_h, rtol=1e-4, atol=1e-4)
    ref = logits.argmax(-1)
    assert got.tolist() == (ref + state["d2t"][ref]).tolist()


def _runner(target_dir, head_dir):
    from worker_service.model_runner import ModelRunner, RunnerConfig
    runner = ModelRunner(RunnerConfig(str(target_dir), device="cpu", dtype="float32",
                                      kv_cache_gb=0.01, draft_model=str(head_dir)))
    runner.init_kv(16, BS)
    return runner


def test_worker_drafts_equal_the_reference_after_every_step(head_dir, target_dir, hf_target):
    """Prefill, a plain step, a verify step whose proposals the target accepts (the target's
    own greedy tokens) and one whose proposals it rejects: after each, the drafts are the
    reference head's greedy drafting over the sequence so far."""
    state, cfg = load_reference_state(head_dir)
    runner = _runner(target_dir, head_dir)
    layers = runner.drafter.head.cfg.aux_layers
    emb = hf_target.model.embed_tokens.weight

    def reference(known):
        """The reference's drafts; and the head's KV checked against it: a query at the
        newest token's position - 1 over the worker's cache gives the reference's hidden
        output there (argmax drafts of a random head barely depend on its attention)."""
        from worker_service.step_meta import step_metadata
        aux = _aux(hf_target, known[:-1], layers)
        _, ref_h = eagle3_forward(state, cfg, emb[torch.tensor(known[1:])],
                                  eagle3_fuse(state, aux))
        head = runner.drafter.head
        pos = np.array([len(known) - 2])
        plan = runner.table.decode_plan(np.array([runner.table.row_of[1]]), pos)
        with torch.no_grad():
            _, h = head(torch.tensor(known[-1:]), head.fuse(aux[-1:]), torch.tensor(pos),
                        step_metadata(plan, torch.device("cpu"), np.array([-1], np.int32)))
        torch.testing.assert_close(h[0], ref_h[-1], rtol=1e-4, atol=1e-4)
        return eagle3_draft_reference(state, cfg, torch.tensor(known), aux, K, emb)

    prompt = [5, 9, 13, 5, 9, 13, 5, 9, 40, 41]
    known = _prefill(runner, prompt, 8)
    sampled, drafts = _decode(runner, 2, [-1], 1, K, len(known) - 1)
    known += sampled
    assert drafts == reference(known)
    truth = hf_greedy(hf_target, known, 2 * K + 2)
    # accepted: the target's own next tokens as proposals
    sampled, drafts = _decode(runner, 3, [known[-1], *truth[:K]], 1 + K, K, len(known) - 1)
    assert sampled == truth[:K + 1]
    known += sampled
    assert drafts == reference(known)
    # rejected: proposals that differ from every sample
    wrong = [(t + 1) % VOCAB for t in hf_greedy(hf_target, known, K)]
    sampled, drafts = _decode(runner, 4, [known[-1], *wrong], 1 + K, K, len(known) - 1)
    known += sampled[:1]
    assert drafts == reference(known)
    # and the drafts themselves as proposals, as the scheduler sends them
    for step in range(5, 8):
        sampled, new = _decode(runner, step, [known[-1], *drafts], 1 + K, K, len(known) - 1)
        a = 0
        while a < K and drafts[a] == sampled[a]:
            a += 1
        known += sampled[:a + 1]
        drafts = new
        assert drafts == reference(known), step
    assert known[len(prompt):] == hf_greedy(hf_target, prompt, len(known) - len(prompt))


def test_both_layouts_of_one_head_draft_alike(tmp_path_factory, target_dir):
    runners = [_runner(target_dir, _head(tmp_path_factory, layout, seed=8))
               for layout in ("speculators", "eagle")]
    outs = []
    for runner in runners:
        _prefill(runner, [3, 1, 4, 1, 5, 9], 4)
        outs.append(_decode(runner, 2, [-1], 1, K, 6))
    assert outs[0] == outs[1]


def test_a_head_for_another_target_is_refused(tmp_path_factory, target_dir, hf_target):
    from kernels.attention import select_backend
    from models.eagle3 import load_eagle3
    wide = make_tiny_eagle3(tmp_path_factory.mktemp("wide"), "eagle", target_hidden_size=96,
                            vocab_size=VOCAB, draft_vocab_size=200, hidden_size=HIDDEN,
                            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, seed=1)
    with pytest.raises(ValueError, match="hidden size of 96, the target's is 64"):
        load_eagle3(str(wide), hf_target.config, hf_target.model.embed_tokens,
                    select_backend("torch"), torch.device("cpu"), torch.float32)
    out = subprocess.run([sys.executable, "-m", "worker_service", "--model", str(target_dir),
                          "--device", "cpu", "--port", "0", "--draft-model", str(wide)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "hidden size of 96" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_through_the_services_equals_hf(tmp_path_factory, target_dir, hf_target, tp):
    head = _head(tmp_path_factory, "speculators")
    workers = ([start_worker(target_dir, extra=["--draft-model", str(head)])] if tp == 1 else
               start_tp_workers(target_dir, 2, extra=["--draft-model", str(head)]))
    with served(target_dir, workers, BS, SCHED) as stub:
        for p in ([5, 9, 13, 5, 9, 13, 5, 9], [30 + i for i in range(20)]):
            out = stub.Complete(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=p), sampling=generate_pb2.SamplingParams(
                    temperature=0.0, max_tokens=24, ignore_eos=True)), timeout=180)
            assert list(out.token_ids) == hf_greedy(hf_target, p, 24)
        assert stub.GetStats(generate_pb2.StatsRequest()).num_spec_proposed_tokens > 0


@pytest.mark.slow
def test_structured_output_with_a_head(tmp_path_factory, target_dir):
    """A format's forced tokens (fast-forward rows) and masked verify rows with an EAGLE-3
    head drafting: greedy output equals no speculation, sampled output validates."""
    head = _head(tmp_path_factory, "eagle")
    worker = start_worker(target_dir, extra=["--draft-model", str(head)])
    with served(target_dir, [worker], BS, ["--speculative", "eagle3", *SCHED[2:]]) as stub:
        formats_unchanged_by_drafts(stub, ("json_schema", "regex"), ([3, 5, 11],), 100)
        s = stub.GetStats(generate_pb2.StatsRequest())
        assert s.num_fast_forward_mismatches == 0 and s.num_decode_steps > 0


def test_the_head_rotates_with_its_configs_rope_scaling(tmp_path):
    """An EAGLE-3 head whose layer config scales RoPE (Llama 3.1 heads: rope_type llama3)
    rotates as that config says, not with plain RoPE of its theta."""
    from models.eagle3 import Eagle3Head, read_config
    from models.rotary import RopeScaling, _cos_sin_table
    path = make_tiny_eagle3(tmp_path / "head", "speculators", target_hidden_size=HIDDEN,
                            vocab_size=VOCAB, draft_vocab_size=200, hidden_size=HIDDEN,
                            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                            seed=3)
    raw = json.loads((path / "config.json").read_text())
    raw["transformer_layer_config"]["rope_scaling"] = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(raw))
    cfg = read_config(str(path))
    assert cfg.rope.kind == "llama3" and cfg.rope.factor == 8.0
    head = Eagle3Head(cfg, None, torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size), 256)
    want = _cos_sin_table(cfg.head_dim, RopeScaling(
        kind="llama3", theta=cfg.rope.theta, factor=8.0, max_position=256,
        original_max_position=64, low_freq_factor=1.0, high_freq_factor=4.0), torch.device("cpu"))
    plain = _cos_sin_table(cfg.head_dim, RopeScaling(theta=cfg.rope.theta, max_position=256),
                           torch.device("cpu"))
    assert head.rotary_emb.cos_sin_cache.shape[0] == 256
    torch.testing.assert_close(head.rotary_emb.cos_sin_cache, want)
    assert not torch.allclose(head.rotary_emb.cos_sin_cache, plain)
