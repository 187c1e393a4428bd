"""A checkpoint's config.json, read as the model code reads it: without transformers.

Why: transformers' AutoConfig cost the worker 6.9-8.8 s of every start on the H100 hosts
(tests/gpu/RESULTS.md: its configuration machinery imports torch.distributed.tensor and
the generation utilities), plus ~1.4 s to import transformers at all, for what is one
JSON file. Checkpoints written by `save_pretrained` carry every field; the defaults below
are transformers' own for the fields a hand-written config may leave out, so both readers
give the model the same values (tests/test_loader.py compares them field by field).
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama")

# transformers' defaults (Qwen3Config, Qwen3MoeConfig, Qwen2Config, LlamaConfig of 5.x) for
# the fields models/ reads directly (the optional ones are read with getattr and a default);
# num_key_value_heads None: as many as the attention heads.
_COMMON = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
           "rope_theta": 10000.0, "rope_scaling": None, "eos_token_id": None,
           "attention_bias": False, "num_key_value_heads": None}
_DEFAULTS = {
    "qwen3": {"vocab_size": 151936, "max_position_embeddings": 32768, "head_dim": 128,
              "num_key_value_heads": 32},
    "qwen3_moe": {"vocab_size": 151936, "max_position_embeddings": 32768,
                  "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen2": {"vocab_size": 151936, "max_position_embeddings": 32768,
              "num_key_value_heads": 32},
    "llama": {"vocab_size": 32000, "max_position_embeddings": 2048, "eos_token_id": 2},
}
# Names transformers 5 writes for a field (its attribute_map): Qwen3-MoE's expert count.
_ALIASES = {"num_local_experts": "num_experts"}


class ModelConfig(SimpleNamespace):
    """config.json's fields as attributes (what transformers' config objects offer)."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def merge_overrides(fields: dict, overrides: dict) -> dict:
    """fields updated by overrides, nested dicts merged key by key (vLLM's --hf-overrides):
    {"rope_scaling": {"factor": 8}} changes one key of the checkpoint's rope_scaling."""
    merged = dict(fields)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = merge_overrides(merged[key], value)
        merged[key] = value
    return merged


def load_config(model_dir: str, overrides: dict | None = None) -> ModelConfig:
    """config.json of model_dir, updated by `overrides` (the worker's --hf-overrides and
    --rope-scaling) before anything reads it, with transformers' defaults filled in;
    rejects model families we cannot build."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        fields = merge_overrides(json.load(f), overrides or {})
    model_type = fields.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} in {model_dir} "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):
        if key not in fields:
            raise ValueError(f"{path} has no {key!r}")
    fields = {_ALIASES.get(k, k): v for k, v in fields.items()}
    fields = {**_COMMON, **_DEFAULTS[model_type], **fields}
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    return ModelConfig(**fields)
