"""Plain-torch reference for an EAGLE-3 draft head (one Llama-style layer), no KV cache.

Canonical state-dict names (= the "speculators" checkpoint names; the EAGLE/AngelSlim
layout spells `layers.0.` as `midlayer.`).  H = hidden_size, Ht = target hidden size,
nh/nkv = attention/kv heads, hd = head_dim, I = intermediate_size, V = target vocab,
Vd = draft vocab:
  fc.weight                                  [H, 3*Ht]   fuses cat(aux_low, aux_mid, aux_high)
  layers.0.input_layernorm.weight            [H]         RMSNorm on the token embeddings
  layers.0.hidden_norm.weight                [H]         RMSNorm on the hidden input
  layers.0.self_attn.q_proj.weight           [nh*hd, 2H] input = cat(norm(embeds), norm(hidden))
  layers.0.self_attn.k_proj.weight / v_proj  [nkv*hd, 2H]
  layers.0.self_attn.o_proj.weight           [H, nh*hd]
  layers.0.post_attention_layernorm.weight   [H]
  layers.0.mlp.{gate,up}_proj.weight         [I, H];  layers.0.mlp.down_proj.weight [H, I]
  norm.weight                                [H]         final norm (logits only)
  lm_head.weight                             [Vd, H]
  d2t  int64 [Vd]   target_id = draft_id + d2t[draft_id]
  t2d  bool  [V]    True exactly at target ids reachable from the draft vocab (unused here)
  embed_tokens.weight [V, H]  optional; when absent the TARGET model's embedding is used.

Config dict keys: hidden_size, num_attention_heads, num_key_value_heads, head_dim,
intermediate_size, rms_norm_eps, rope_theta, draft_vocab_size, target_hidden_size,
optional norm_before_residual (default False).

Sources: vLLM vllm/model_executor/models/llama_eagle3.py (first layer: input_layernorm on
embeds, hidden_norm on hidden, cat([embeds, hidden]) into qkv of width 2H, residual = the
UN-normed hidden unless norm_before_residual; final `norm(h, residual)` returns
(normed -> lm_head, pre-norm sum -> next step's hidden input); compute_logits scatters draft
logits to `arange(Vd) + d2t`); SGLang python/sglang/srt/models/llama_eagle3.py (same layer,
"capture the hidden state before norm" for draft decode; fc applied only to the 3*Ht-wide
target features; hot_token_id = d2t + arange); speculators
src/speculators/models/eagle3/{core,model_definitions,data}.py (training: pair token x[i+1]
with target feature g[i]; next TTT step feeds the pre-norm layer output back).
Rotary: standard Llama/NeoX rotate-half RoPE over head_dim, positions = 0..T-1 (only
relative offsets matter without a cache).  Attention: plain GQA, scale hd**-0.5, no qk-norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * w.float()


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [heads, T, hd]; NeoX/Llama rotate-half convention."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos.float()[:, None] * inv[None, :]                      # [T, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def eagle3_fuse(state: dict, aux_hidden) -> torch.Tensor:
    """fc over cat(low, mid, high) target features -> [T, H].  aux_hidden: [T, 3*Ht] or a
    sequence of 3 tensors [T, Ht] in the order of the aux layer ids."""
    if isinstance(aux_hidden, (list, tuple)):
        aux_hidden = torch.cat(list(aux_hidden), dim=-1)
    return aux_hidden.float() @ state["fc.weight"].float().T


def eagle3_forward(state: dict, cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor | None = None):
    """One head pass over a whole sequence with full causal attention.

    embeds: [T, H] embeddings of tokens x[1..T]; hidden: [T, H] hidden input (fc(...) of the
    target features g[0..T-1], or the head's own previous output for drafted positions).
    Returns (logits [T, Vd] over the DRAFT vocab, hidden_out [T, H] pre-final-norm)."""
    p = lambda n: state["layers.0." + n].float()  # noqa: E731
    eps, T = cfg["rms_norm_eps"], embeds.shape[0]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    pos = torch.arange(T) if positions is None else positions

    h_normed = _rms(hidden, p("hidden_norm.weight"), eps)
    residual = h_normed if cfg.get("norm_before_residual", False) else hidden.float()
    x = torch.cat([_rms(embeds, p("input_layernorm.weight"), eps), h_normed], dim=-1)  # [T, 2H]

    q = (x @ p("self_attn.q_proj.weight").T).view(T, nh, hd).transpose(0, 1)
    k = (x @ p("self_attn.k_proj.weight").T).view(T, nkv, hd).transpose(0, 1)
    v = (x @ p("self_attn.v_proj.weight").T).view(T, nkv, hd).transpose(0, 1)
    q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = (q @ k.transpose(1, 2)) * hd ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, nh * hd)
    h = residual + attn @ p("self_attn.o_proj.weight").T

    m = _rms(h, p("post_attention_layernorm.weight"), eps)
    m = (F.silu(m @ p("mlp.gate_proj.weight").T) * (m @ p("mlp.up_proj.weight").T))
    h = h + m @ p("mlp.down_proj.weight").T                      # pre-norm output

    logits = _rms(h, state["norm.weight"], eps) @ state["lm_head.weight"].float().T
    return logits, h


def draft_to_target(state: dict, draft_ids: torch.Tensor) -> torch.Tensor:
    return draft_ids + state["d2t"][draft_ids]


def eagle3_draft_reference(state: dict, cfg: dict, token_ids: torch.Tensor, aux_hidden,
                           k: int, embed_weight: torch.Tensor | None = None) -> list[int]:
    """Greedy k-token draft, recomputing the full sequence every step.

    token_ids: [n+1] target ids x[0..n], where x[n] is the token the target just produced;
    aux_hidden: features g[0..n-1] of the target's forward over x[0..n-1] ([n, 3*Ht] or a list
    of 3 [n, Ht]).  Pairing: hidden g[i] goes with token x[i+1] and predicts x[i+2].
    embed_weight: the target's embedding, used when the head has no embed_tokens.weight.
    Returns k draft tokens as TARGET vocab ids (via d2t)."""
    emb = state.get("embed_tokens.weight", embed_weight)
    assert emb is not None, "head has no embed_tokens.weight: pass the target's embedding"
    tokens = [int(t) for t in token_ids[1:]]                     # x[1..n]
    hidden = eagle3_fuse(state, aux_hidden)                      # [n, H]
    assert hidden.shape[0] == len(tokens), (hidden.shape, len(tokens))
    out: list[int] = []
    for _ in range(k):
        embeds = emb.float()[torch.tensor(tokens)]
        logits, h_out = eagle3_forward(state, cfg, embeds, hidden)
        draft_id = logits[-1].argmax()
        tgt = int(draft_to_target(state, draft_id))
        out.append(tgt)
        # next step: the new token is paired with the head's own pre-norm output at the
        # last position (not fc(...)); earlier positions keep their fused target features.
        tokens.append(tgt)
        hidden = torch.cat([hidden, h_out[-1:]], dim=0)
    return out
