"""EAGLE-3 draft head: one Llama-style decoder layer that drafts from the target's own
hidden states (the speculative `draft` proposer's cheap model; worker_service/drafter.py).

Input of a position i: the embedding of the token after it, x[i+1], and a hidden state: the
target's features at i (its hidden states before three of its layers, `aux_layers`: low,
mid, high, fused by `fc`), or, for a drafted position, the head's own output at the one
before. Both are RMS-normed, concatenated (embedding first) into the attention's q/k/v
projections (2H wide); the residual is the un-normed hidden (normed with
`norm_before_residual`); then MLP, final norm and an LM head over a draft vocabulary whose
ids map to the target's by `d2t` (target id = draft id + d2t[draft id]). Output: the logits
and the pre-norm hidden the next drafted position takes. Follows vLLM's llama_eagle3.py and
SGLang's; tests/eagle3_reference.py is the plain-torch reference.

Checkpoints in the two published layouts: speculators (config `speculators_model_type:
eagle3`, a `transformer_layer_config`, weights `layers.0.*`) and EAGLE / AngelSlim (a flat
Llama config with `draft_vocab_size`, weights `midlayer.*`). Without `embed_tokens` the
target's embedding is used. The head is small: every TP rank holds all of it.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from torch import nn

from kernels.attention import AttentionMetadata
from models.attention import Attention
from models.layernorm import RMSNorm
from models.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from models.rotary import RopeScaling, RotaryEmbedding, max_positions, rope_from_config


@dataclass
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeScaling          # the layer config's RoPE, scaled where it says (rotary.py)
    vocab_size: int            # the target's
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layers: tuple[int, ...] | None   # None: the default for the target's depth


def is_eagle3(model_dir: str) -> bool:
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    return raw.get("speculators_model_type") == "eagle3" or any(
        "eagle3" in a.lower() for a in raw.get("architectures") or ())


def read_config(model_dir: str) -> Eagle3Config:
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    if raw.get("speculators_model_type") == "eagle3":
        layer = raw["transformer_layer_config"]
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        before = raw.get("norm_before_residual", True)   # vLLM's default for this layout
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if raw.get(flag):
                raise ValueError(f"EAGLE-3 head {model_dir}: the {flag} variant is not supported")
    else:
        layer = raw
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or \
            (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        before = raw.get("norm_before_residual", False)
    if layer.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"EAGLE-3 head {model_dir}: {layer['num_hidden_layers']} layers (one expected)")
    h = layer["hidden_size"]
    return Eagle3Config(
        hidden_size=h, num_heads=layer["num_attention_heads"],
        num_kv_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        head_dim=layer.get("head_dim") or h // layer["num_attention_heads"],
        intermediate_size=layer["intermediate_size"], rms_norm_eps=layer["rms_norm_eps"],
        rope=rope_from_config(SimpleNamespace(**{"rope_theta": 10000.0, **{
            k: v for k, v in layer.items() if v is not None}})),
        vocab_size=layer["vocab_size"],
        draft_vocab_size=raw.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=raw.get("target_hidden_size") or h,
        norm_before_residual=bool(before), aux_layers=tuple(aux) if aux else None)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and speculators' choice: low, middle and high."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, backend, embed: nn.Module, max_position: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.embed = embed
        self.fc = RowParallelLinear(3 * cfg.target_hidden_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.hidden_norm = RMSNorm(h, eps=eps)
        self.qkv_proj = QKVParallelLinear(2 * h, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, h, bias=False)
        # the table as long as the target serves; dynamic NTK's threshold is the config's own
        rope = cfg.rope if cfg.rope.kind == "dynamic" else replace(cfg.rope, max_position=max_position)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, rope=rope)
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              cfg.head_dim ** -0.5, backend)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.gate_up_proj = MergedColumnParallelLinear(h, [cfg.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, eps=eps)
        self.lm_head = RowParallelLinear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's features [T, 3 Ht] -> the hidden input [T, H]."""
        return self.fc(aux)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [T] (target vocabulary), hidden [T, H] -> (greedy next ids in the
        target's vocabulary [T], the pre-norm output [T, H])."""
        cfg = self.cfg
        normed = self.hidden_norm(hidden)
        residual = normed if cfg.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(self.embed(ids)), normed], dim=-1)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
        k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        attn = self.o_proj(self.attn(q, k, v, meta).reshape(-1, q_size))
        x, h = self.post_attention_layernorm(attn, residual)
        x, h = self.norm(self.down_proj(self.gate_up_proj.swiglu(x)), h)
        draft = self.lm_head(x).argmax(-1)
        return draft + self.d2t[draft], h


def load_eagle3(model_dir: str, target_config, target_embed: nn.Module, backend,
                device: torch.device, dtype: torch.dtype) -> Eagle3Head:
    """The head of `model_dir` for this target; refused where it was made for another
    (hidden size, vocabulary)."""
    cfg = read_config(model_dir)
    if cfg.target_hidden_size != target_config.hidden_size:
        raise ValueError(f"EAGLE-3 head {model_dir} was made for a hidden size of "
                         f"{cfg.target_hidden_size}, the target's is {target_config.hidden_size}")
    if cfg.vocab_size != target_config.vocab_size:
        raise ValueError(f"EAGLE-3 head {model_dir} was made for a vocabulary of {cfg.vocab_size} "
                         f"tokens, the target's has {target_config.vocab_size}")
    n = target_config.num_hidden_layers
    aux = cfg.aux_layers or default_aux_layers(n)
    if len(aux) != 3 or sorted(set(aux)) != list(aux) or not 0 <= aux[0] or aux[-1] >= n:
        raise ValueError(f"EAGLE-3 head {model_dir}: auxiliary layers {list(aux)} must be three "
                         f"distinct ascending layers of the target's {n}")
    cfg.aux_layers = tuple(aux)
    state: dict[str, torch.Tensor] = {}
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"EAGLE-3 head {model_dir}: no *.safetensors")
    for f in files:
        for name, t in load_file(f).items():
            state[name.replace("midlayer.", "layers.0.", 1)] = t
    own_embed = state.pop("embed_tokens.weight", None)
    embed = target_embed
    if own_embed is not None:
        embed = nn.Embedding(*own_embed.shape, device=device, dtype=dtype)
        embed.weight.data.copy_(own_embed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(cfg, backend, embed, max_positions(target_config))
    finally:
        torch.set_default_dtype(previous)
    p = "layers.0."
    try:
        w = {
            head.fc.weight: state["fc.weight"],
            head.input_layernorm.weight: state[p + "input_layernorm.weight"],
            head.hidden_norm.weight: state[p + "hidden_norm.weight"],
            head.qkv_proj.weight: torch.cat([state[p + f"self_attn.{x}_proj.weight"]
                                             for x in "qkv"]),
            head.o_proj.weight: state[p + "self_attn.o_proj.weight"],
            head.post_attention_layernorm.weight: state[p + "post_attention_layernorm.weight"],
            head.gate_up_proj.weight: torch.cat([state[p + "mlp.gate_proj.weight"],
                                                 state[p + "mlp.up_proj.weight"]]),
            head.down_proj.weight: state[p + "mlp.down_proj.weight"],
            head.norm.weight: state["norm.weight"],
            head.lm_head.weight: state["lm_head.weight"],
        }
    except KeyError as e:
        raise ValueError(f"EAGLE-3 head {model_dir}: weight {e.args[0]} missing") from None
    for param, t in w.items():
        if param.shape != t.shape:
            raise ValueError(f"EAGLE-3 head {model_dir}: a weight of shape {tuple(t.shape)} where "
                             f"{tuple(param.shape)} was expected")
        param.data.copy_(t)
    d2t = state.get("d2t")
    if d2t is not None:
        if d2t.shape != head.d2t.shape or int((torch.arange(len(d2t)) + d2t).max()) >= cfg.vocab_size:
            raise ValueError(f"EAGLE-3 head {model_dir}: d2t does not map into the target's vocabulary")
        head.d2t.copy_(d2t)
    return head.eval()
