"""Loader: strict name matching, config validation, dtype handling, TP shard math."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loader import load_model
from models.parallel import TPGroup
from models.rotary import rope_theta_from_config
from tiny_checkpoint import tiny_qwen3_dir


@pytest.fixture
def ckpt(tmp_path_factory, tmp_path) -> Path:
    """A private, editable copy of the default tiny checkpoint (single file)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3_dir(tmp_path_factory), dst)
    return dst


def edit_weights(path: Path, fn) -> None:
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path: Path, fn) -> None:
    config = json.loads((path / "config.json").read_text())
    fn(config)
    (path / "config.json").write_text(json.dumps(config))


def test_loads_and_every_param_matches_checkpoint(tmp_path_factory):
    path = tiny_qwen3_dir(tmp_path_factory)
    model, config = load_model(str(path))
    ckpt = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    qkv = params["model.layers.1.self_attn.qkv_proj.weight"]
    p = "model.layers.1.self_attn."
    torch.testing.assert_close(qkv, torch.cat([ckpt[p + "q_proj.weight"], ckpt[p + "k_proj.weight"],
                                               ckpt[p + "v_proj.weight"]]), rtol=0, atol=0)
    assert not model.training and config.model_type == "qwen3"
    # one rotary table for all layers (48 copies were 1 GB a rank at 30B-A3B), still exact
    tables = {layer.self_attn.rotary_emb.cos_sin_cache.data_ptr() for layer in model.model.layers}
    table = model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    assert len(tables) == 1 and table.dtype == torch.float32
    d = table.shape[1]
    inv = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).double() / d))
    angles = torch.arange(table.shape[0]).double()[:, None] * inv
    torch.testing.assert_close(table.double(), torch.cat([angles.cos(), angles.sin()], -1),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("drop, reported", [
    ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj.weight[k]"),
    ("model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight[1]"),
    ("model.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
])
def test_missing_tensor_is_reported(ckpt, drop, reported):
    edit_weights(ckpt, lambda t: t.pop(drop))
    with pytest.raises(ValueError, match="never loaded") as err:
        load_model(str(ckpt))
    assert reported in str(err.value)


def test_extra_tensor_is_reported(ckpt):
    edit_weights(ckpt, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="no destination") as err:
        load_model(str(ckpt))
    assert "model.layers.0.mlp.extra.weight" in str(err.value)


def test_wrong_shape_is_rejected(ckpt):
    edit_weights(ckpt, lambda t: t.update(
        {"model.norm.weight": torch.ones(t["model.norm.weight"].numel() + 1)}))
    with pytest.raises(ValueError, match="shape"):
        load_model(str(ckpt))


def test_non_qwen3_model_type_rejected(ckpt):
    edit_config(ckpt, lambda c: c.update(model_type="mistral", architectures=["MistralForCausalLM"]))
    with pytest.raises(ValueError, match="unsupported model_type '(mistral|ministral)'"):
        load_model(str(ckpt))


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                         "long_factor": [1.0], "short_factor": [1.0]}},
    {"rope_parameters": None, "rope_theta": 10000.0,
     "rope_scaling": {"type": "proportional", "factor": 2.0}},     # transformers 4 spelling
])
def test_unsupported_rope_scaling_rejected(ckpt, rope):
    edit_config(ckpt, lambda c: c.update(rope))
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        load_model(str(ckpt))


def test_rope_theta_both_config_spellings():
    v4 = SimpleNamespace(rope_theta=1e6, rope_scaling=None)
    v5 = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert rope_theta_from_config(v4) == 1e6
    assert rope_theta_from_config(v5) == 5e5
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        rope_theta_from_config(SimpleNamespace(rope_theta=1e4, rope_scaling={"rope_type": "mrope"}))


def test_dtype_from_config_and_override(tmp_path_factory):
    bf16_dir = tiny_qwen3_dir(tmp_path_factory, dtype=torch.bfloat16)
    model, _ = load_model(str(bf16_dir))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model32, _ = load_model(str(bf16_dir), dtype=torch.float32)
    assert {p.dtype for p in model32.parameters()} == {torch.float32}
    # fp32 checkpoint loaded as bf16: params are bf16 and equal to the rounded weights
    fp32_dir = tiny_qwen3_dir(tmp_path_factory)
    model16, _ = load_model(str(fp32_dir), dtype=torch.bfloat16)
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    ckpt = load_file(fp32_dir / "model.safetensors")
    torch.testing.assert_close(model16.model.norm.weight, ckpt["model.norm.weight"].bfloat16(),
                               rtol=0, atol=0)
    assert model16.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_bf16_forward_runs_close_to_fp32(tmp_path_factory):
    from test_qwen3_vs_hf import PagedKV, run_step
    path = tiny_qwen3_dir(tmp_path_factory)
    prompt = [torch.arange(1, 11)]
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_model(str(path), dtype=dtype)
        cache = PagedKV(model, [10], block_size=4)
        assert cache.kv.dtype == dtype
        (logits[dtype],) = run_step(model, cache, prompt, [(0, 0, 10)])
    assert logits[torch.bfloat16].dtype == torch.bfloat16
    err = (logits[torch.bfloat16].float() - logits[torch.float32]).abs().max()
    assert err < 0.1 * logits[torch.float32].abs().max()


@pytest.mark.parametrize("tied", [False, True])
def test_tp2_shards_concatenate_to_full_weights(tmp_path_factory, tied):
    """Load rank 0 and rank 1 separately (no process group needed) and reassemble."""
    path = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, tie_word_embeddings=tied, shards=2)
    full, config = load_model(str(path))
    ranks = [dict(load_model(str(path), tp=TPGroup(r, 2))[0].named_parameters()) for r in (0, 1)]
    full_params = dict(full.named_parameters())
    assert set(ranks[0]) == set(full_params)
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([ranks[0][name], ranks[1][name]], dim)

    for name, ref in full_params.items():
        if "qkv_proj" in name:
            parts = [r[name].split([q // 2, kv // 2, kv // 2]) for r in ranks]
            got = torch.cat([torch.cat([parts[0][i], parts[1][i]]) for i in range(3)])
        elif "gate_up_proj" in name:
            parts = [r[name].chunk(2) for r in ranks]
            got = torch.cat([parts[0][0], parts[1][0], parts[0][1], parts[1][1]])
        elif "o_proj" in name or "down_proj" in name:
            got = cat(name, 1)
        elif "embed_tokens" in name or "lm_head" in name:
            shard = ranks[0][name].shape[0]
            assert shard == 195                      # ceil(389 / 2); rank 1 has a zero pad row
            assert ranks[1][name][-1].abs().sum() == 0
            got = cat(name, 0)[:config.vocab_size]
        else:                                        # norms: replicated
            for r in ranks:
                torch.testing.assert_close(r[name], ref, rtol=0, atol=0)
            continue
        torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=name)
    # tied: lm_head shares the embedding Parameter, so named_parameters lists it once
    assert ("lm_head.weight" not in ranks[0]) == tied


def test_tp_rejects_indivisible_heads(tmp_path_factory):
    path = tiny_qwen3_dir(tmp_path_factory)        # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="num_key_value_heads 2"):
        load_model(str(path), tp=TPGroup(0, 4))
    with pytest.raises(ValueError):
        TPGroup(2, 2)


def _as_model_reads(config) -> dict:
    """Every value models/ takes from a config (directly, through getattr defaults, or
    through the helpers that interpret it)."""
    from models.loader import config_dtype
    from models.moe import is_sparse_layer
    from models.qwen3 import _head_dim
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
            "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
            "eos_token_id", "model_type")
    got = {k: getattr(config, k) for k in keys}
    for k, default in (("tie_word_embeddings", False), ("hidden_act", "silu"),
                       ("attention_bias", False), ("mlp_bias", False), ("num_experts", 0),
                       ("use_sliding_window", False), ("layer_types", None)):
        got[k] = getattr(config, k, default)
    got["sliding"] = "sliding_attention" in (got.pop("layer_types") or ())
    got["head_dim"] = _head_dim(config)
    got["rope_theta"] = rope_theta_from_config(config)
    got["dtype"] = config_dtype(config)
    got["sparse"] = [is_sparse_layer(config, i) for i in range(config.num_hidden_layers)]
    if got["num_experts"]:
        for k in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
            got[k] = getattr(config, k)
    return got


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen2", "llama"])
@pytest.mark.parametrize("written", ["minimal", "save_pretrained"])
def test_config_reader_gives_what_transformers_gives(tmp_path, model_type, written):
    """models/config.py (no transformers) against AutoConfig, field by field as the model
    reads them: a hand-written config.json with only the shape (transformers' defaults fill
    the rest), and one written by save_pretrained with non-default values."""
    import transformers

    from models.config import load_config
    shape = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 3, "intermediate_size": 96}
    if written == "minimal":
        (tmp_path / "config.json").write_text(json.dumps(shape))
    else:
        extra = {"num_key_value_heads": 2, "vocab_size": 300, "rms_norm_eps": 1e-5,
                 "max_position_embeddings": 4096, "tie_word_embeddings": True,
                 "rope_theta": 5e5, "eos_token_id": 7, "torch_dtype": "bfloat16",
                 "head_dim": 32}
        if model_type == "qwen3_moe":
            extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                         norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[0])
        cfg = transformers.AutoConfig.for_model(**{**shape, **extra})
        cfg.save_pretrained(tmp_path)
    ours = _as_model_reads(load_config(str(tmp_path)))
    theirs = _as_model_reads(transformers.AutoConfig.from_pretrained(tmp_path))
    assert ours == theirs


def test_worker_model_code_does_not_import_transformers():
    """The worker's start pays for torch, not for transformers (models/config.py)."""
    import subprocess
    import sys
    code = ("import sys, worker_service.model_runner, worker_service.drafter, models.loader; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
