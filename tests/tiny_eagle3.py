"""Tiny random EAGLE-3 draft-head checkpoints in the two published Hugging Face layouts.

layout="speculators" (vLLM speculators / RedHatAI `*-speculator.eagle3`): config.json with
  architectures ["Eagle3Speculator"], speculators_model_type "eagle3", speculators_config
  {algorithm, proposal_methods[{proposal_type, speculative_tokens, ...}],
  default_proposal_method, verifier{name_or_path, architectures}}, transformer_layer_config
  (a LlamaConfig dict: hidden_size, head_dim, num_attention_heads, ..., vocab_size = TARGET
  vocab), top-level draft_vocab_size, target_hidden_size, norm_before_residual,
  eagle_aux_hidden_state_layer_ids; weights layers.0.*, fc, norm, lm_head, d2t, t2d
  [, embed_tokens].
layout="eagle" (SafeAILab EAGLE / SpecForge / AngelSlim): a flat LlamaConfig with
  architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1, vocab_size = target vocab,
  draft_vocab_size, optional target_hidden_size and
  eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}; weights midlayer.*,
  fc, norm, lm_head, d2t, t2d [, embed_tokens].

`load_reference_state` reads either into the canonical names of tests/eagle3_reference.py.
Same arguments -> byte-identical files.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _random_state(*, target_hidden_size, vocab_size, draft_vocab_size, hidden_size, num_heads,
                  num_kv_heads, head_dim, intermediate_size, seed, with_embed) -> dict:
    g = torch.Generator().manual_seed(seed)
    H, I = hidden_size, intermediate_size

    def lin(out_f, in_f, std=0.08):
        return torch.randn(out_f, in_f, generator=g) * std

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {
        "fc.weight": lin(H, 3 * target_hidden_size, std=0.05),
        "layers.0.input_layernorm.weight": norm(H),
        "layers.0.hidden_norm.weight": norm(H),
        "layers.0.self_attn.q_proj.weight": lin(num_heads * head_dim, 2 * H),
        "layers.0.self_attn.k_proj.weight": lin(num_kv_heads * head_dim, 2 * H),
        "layers.0.self_attn.v_proj.weight": lin(num_kv_heads * head_dim, 2 * H),
        "layers.0.self_attn.o_proj.weight": lin(H, num_heads * head_dim),
        "layers.0.post_attention_layernorm.weight": norm(H),
        "layers.0.mlp.gate_proj.weight": lin(I, H),
        "layers.0.mlp.up_proj.weight": lin(I, H),
        "layers.0.mlp.down_proj.weight": lin(H, I),
        "norm.weight": norm(H),
        "lm_head.weight": lin(draft_vocab_size, H, std=0.1),
    }
    if with_embed:
        sd["embed_tokens.weight"] = lin(vocab_size, H, std=0.1)
    # Draft vocab = a sorted random subset of target ids (published mappings are sorted too).
    assert draft_vocab_size <= vocab_size
    used = torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values
    sd["d2t"] = (used - torch.arange(draft_vocab_size)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    sd["t2d"] = t2d
    return sd


def make_tiny_eagle3(path: str | os.PathLike, layout: str, *, target_hidden_size: int,
                     vocab_size: int, draft_vocab_size: int, hidden_size: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, intermediate_size: int, seed: int,
                     with_embed: bool = False, aux_layer_ids: list[int] | None = None,
                     rms_norm_eps: float = 1e-6, rope_theta: float = 1_000_000.0,
                     norm_before_residual: bool = False,
                     dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json + model.safetensors for a random 1-layer EAGLE-3 head; returns path."""
    assert layout in ("speculators", "eagle"), layout
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = _random_state(target_hidden_size=target_hidden_size, vocab_size=vocab_size,
                       draft_vocab_size=draft_vocab_size, hidden_size=hidden_size,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       intermediate_size=intermediate_size, seed=seed, with_embed=with_embed)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    dtype_name = str(dtype).removeprefix("torch.")
    llama = {
        "model_type": "llama", "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta, "rope_scaling": None,
        "max_position_embeddings": 40960, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "vocab_size": vocab_size, "torch_dtype": dtype_name,
    }
    if layout == "speculators":
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": None, "architectures": ["Qwen3ForCausalLM"]},
            },
            "transformer_layer_config": llama,
            "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": target_hidden_size,
            "norm_before_residual": norm_before_residual,
            "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids) if aux_layer_ids else None,
            "torch_dtype": dtype_name,
        }
    else:
        config = {"architectures": ["LlamaForCausalLMEagle3"], **llama,
                  "draft_vocab_size": draft_vocab_size, "target_hidden_size": target_hidden_size}
        if norm_before_residual:
            config["norm_before_residual"] = True
        if aux_layer_ids:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
                                      "use_aux_hidden_state": True}
        sd = {k.replace("layers.0.", "midlayer.", 1): v for k, v in sd.items()}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_reference_state(path: str | os.PathLike) -> tuple[dict, dict]:
    """Read either layout -> (canonical state dict, flat config dict for eagle3_reference)."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    sd = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v
          for k, v in load_file(str(path / "model.safetensors")).items()}
    if raw.get("speculators_model_type") == "eagle3":
        tl = raw["transformer_layer_config"]
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        # vLLM defaults a missing norm_before_residual to True for speculators configs.
        nbr = raw.get("norm_before_residual", True)
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            assert not raw.get(flag, False), f"{flag} variant not modelled by the reference"
    else:
        tl = raw
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or \
            (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        nbr = raw.get("norm_before_residual", False)
    H = tl["hidden_size"]
    cfg = {
        "hidden_size": H,
        "num_attention_heads": tl["num_attention_heads"],
        "num_key_value_heads": tl.get("num_key_value_heads", tl["num_attention_heads"]),
        "head_dim": tl.get("head_dim") or H // tl["num_attention_heads"],
        "intermediate_size": tl["intermediate_size"],
        "rms_norm_eps": tl["rms_norm_eps"],
        "rope_theta": tl.get("rope_theta", 10000.0),
        "vocab_size": tl["vocab_size"],
        "draft_vocab_size": raw.get("draft_vocab_size") or tl["vocab_size"],
        "target_hidden_size": raw.get("target_hidden_size") or H,
        "norm_before_residual": bool(nbr),
        "aux_layer_ids": list(aux) if aux else None,
    }
    assert sd["fc.weight"].shape == (H, 3 * cfg["target_hidden_size"]), sd["fc.weight"].shape
    return sd, cfg
