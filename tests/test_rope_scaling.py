"""RoPE scaling (models/rotary.py) against Hugging Face: yarn (with its attention factor),
llama3, linear and dynamic NTK, on tiny random Qwen3 and Llama checkpoints, fp32 on CPU,
at positions past original_max_position_embeddings and past max_position_embeddings.
The fused q/k norm + rotary kernel (Triton interpreter) reads the same scaled table."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from models.loader import load_model
from models.rotary import max_positions, rope_from_config
from paged_kv import PagedKV
from test_qwen3_vs_hf import assert_close, random_prompts, run_step
from tiny_checkpoint import tiny_qwen3_dir

MAX_POS = 24
ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 12},
    "yarn-mscale": {"rope_type": "yarn", "factor": 3.0, "mscale": 1.2, "mscale_all_dim": 0.8,
                    "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 12},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
FAMILIES = {"qwen3": dict(), "llama": dict(llama=True, seed=4)}
VOCAB = 389


def scaled_dir(tmp_path_factory, family: str, rope: str):
    """A tiny checkpoint of `family` whose config.json carries the `rope` scaling."""
    base = tiny_qwen3_dir(tmp_path_factory, max_position_embeddings=MAX_POS, **FAMILIES[family])
    path = tmp_path_factory.mktemp(f"{family}-{rope}")
    shutil.copytree(base, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    config["rope_parameters"] = {**ROPES[rope], "rope_theta": theta}
    (path / "config.json").write_text(json.dumps(config))
    return path


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager")


def hf_decode_logits(path, prompt: torch.Tensor, prefill: int) -> torch.Tensor:
    """HF's logits of every position: the first `prefill` tokens in one call, then one
    token a call over its KV cache (how HF's dynamic NTK rotates a long sequence)."""
    hf = hf_model(path)
    with torch.no_grad():
        out = hf(prompt[None, :prefill], use_cache=True)
        logits, past = [out.logits[0]], out.past_key_values
        for t in range(prefill, len(prompt)):
            out = hf(prompt[None, t:t + 1], past_key_values=past, use_cache=True)
            logits.append(out.logits[0])
            past = out.past_key_values
    return torch.cat(logits)


def ours_decode_logits(model, prompt: torch.Tensor, prefill: int) -> torch.Tensor:
    cache = PagedKV(model, [len(prompt)], block_size=4, seed=1)
    logits = run_step(model, cache, [prompt], [(0, 0, prefill)])
    for t in range(prefill, len(prompt)):
        logits += run_step(model, cache, [prompt], [(0, t, t + 1)], is_decode=True)
    return torch.cat(logits)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("rope", [r for r in ROPES if r != "dynamic"])
def test_prefill_and_decode_match_hf(tmp_path_factory, family, rope):
    """One prefill of a prompt past the original context (and past max_position_embeddings
    where the scaling extends it), then chunked prefill + decode: HF's logits."""
    path = scaled_dir(tmp_path_factory, family, rope)
    model, config = load_model(str(path))
    length = min(max_positions(config), 2 * MAX_POS)
    assert length > MAX_POS or rope == "llama3"
    prompts = random_prompts(VOCAB, [7, length], seed=3)
    hf = hf_model(path)
    with torch.no_grad():
        refs = [hf(p[None]).logits[0] for p in prompts]
    cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
    outs = run_step(model, cache, prompts, [(i, 0, len(p)) for i, p in enumerate(prompts)])
    for i, (ours, ref) in enumerate(zip(outs, refs)):
        assert_close(ours, ref, f"{family} {rope} prefill seq {i}")
    ours = ours_decode_logits(model, prompts[1], prefill=length - 6)
    assert_close(ours, refs[1], f"{family} {rope} decode")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dynamic_ntk_matches_hf_decoding_past_max_position(tmp_path_factory, family):
    path = scaled_dir(tmp_path_factory, family, "dynamic")
    model, config = load_model(str(path))
    assert max_positions(config) == 2 * MAX_POS
    prompt = random_prompts(VOCAB, [2 * MAX_POS - 2], seed=5)[0]
    prefill = MAX_POS - 4                       # HF rotates a prefill <= max_position plainly
    assert_close(ours_decode_logits(model, prompt, prefill),
                 hf_decode_logits(path, prompt, prefill), f"{family} dynamic")


@pytest.mark.parametrize("rope", ["yarn", "dynamic", "llama3"])
def test_fused_qk_norm_rotary_reads_the_scaled_table(tmp_path_factory, monkeypatch, rope):
    """Qwen3's fused q/k norm + rotary + KV store kernel (interpreter) gives the unfused
    layers' logits with a scaled table, positions past the original context included."""
    import models.kernel_choice
    import models.qwen3
    calls = []
    kernel = models.qwen3.qk_norm_rotary
    monkeypatch.setattr(models.qwen3, "qk_norm_rotary",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    path = scaled_dir(tmp_path_factory, "qwen3", rope)
    model, config = load_model(str(path))
    prompt = random_prompts(VOCAB, [min(max_positions(config), MAX_POS + 6)], seed=7)[0]
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(models.kernel_choice, "FUSED_ON_CPU", fused)
        runs.append(ours_decode_logits(model, prompt, prefill=MAX_POS - 2))
    assert calls
    assert_close(runs[1], runs[0], f"fused vs unfused {rope}")


def test_hf_overrides_equal_an_edited_config(tmp_path_factory):
    """load_model(hf_overrides=...) (the worker's --rope-scaling / --hf-overrides) builds
    what a config.json with those fields builds; nested dicts merge key by key."""
    base = tiny_qwen3_dir(tmp_path_factory, max_position_embeddings=MAX_POS)
    edited = scaled_dir(tmp_path_factory, "qwen3", "yarn")
    a, _ = load_model(str(base), hf_overrides={"rope_scaling": ROPES["yarn"]})
    b, _ = load_model(str(edited))
    ta = a.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    tb = b.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    assert ta.shape == tb.shape == (4 * 12, 16)
    torch.testing.assert_close(ta, tb, rtol=0, atol=0)
    _, config = load_model(str(edited), hf_overrides={"rope_parameters": {"factor": 2.0}})
    assert rope_from_config(config).factor == 2.0 and rope_from_config(config).kind == "yarn"


def test_worker_flags_become_overrides():
    from worker_service.__main__ import hf_overrides_of, parse_args
    args = parse_args(["--model", "m", "--hf-overrides", '{"max_position_embeddings": 99}',
                       "--rope-scaling", '{"rope_type": "yarn", "factor": 4.0}'])
    assert hf_overrides_of(args) == {"max_position_embeddings": 99,
                                     "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert hf_overrides_of(parse_args(["--model", "m"])) is None
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--rope-scaling", "[1]"])


def test_unsupported_rope_types_are_refused(tmp_path_factory):
    base = tiny_qwen3_dir(tmp_path_factory, max_position_embeddings=MAX_POS)
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'longrope'"):
        load_model(str(base), hf_overrides={"rope_scaling": {"rope_type": "longrope"}})
    with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
        load_model(str(base), hf_overrides={"rope_scaling": {"rope_type": "llama3", "factor": 8}})


@pytest.mark.slow
def test_worker_serves_past_max_position_with_rope_scaling_flag(tmp_path_factory):
    """`--rope-scaling` on a real worker behind the scheduler: the context grows past
    max_position_embeddings (original x factor) and greedy tokens are HF's with the same
    scaling in config.json, generated past max_position_embeddings."""
    from nanoserve.v1 import generate_pb2
    from services import generation_stub
    base = tiny_qwen3_dir(tmp_path_factory, max_position_embeddings=MAX_POS)
    prompt = random_prompts(VOCAB, [MAX_POS - 4], seed=9)[0].tolist()
    new = 10
    with generation_stub(base, worker_extra=["--rope-scaling", json.dumps(ROPES["yarn"])]) as stub:
        got = stub.Complete(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)),
            timeout=120).token_ids
    hf = hf_model(scaled_dir(tmp_path_factory, "qwen3", "yarn"))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert len(ids) > MAX_POS
    assert list(got) == ids[len(prompt):]
