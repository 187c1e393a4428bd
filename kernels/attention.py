"""Paged attention entry point: the metadata a step carries and the backend that runs it.

The KV cache of one layer is two tensors `k_cache`, `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim] (flash-attn's paged layout). A step's
tokens are ragged: sequence i contributes query tokens cu_seqlens_q[i]:cu_seqlens_q[i+1],
at positions context_lens[i] - q_len_i .. context_lens[i] - 1, and attends causally to
every key of its own sequence up to its own position (cached prefix included).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [num_tokens] int32: block_id * block_size + offset; -1 = skip
    block_tables: torch.Tensor   # [num_seqs, max_blocks] int32, padded with 0 (never read)
    context_lens: torch.Tensor   # [num_seqs] int32: KV length after this step
    cu_seqlens_q: torch.Tensor   # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor   # [num_seqs + 1] int32: prefix sums of context_lens
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool              # every sequence has exactly one query token

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Reference: write k/v [T, Hkv, D] into the caches at slot_mapping (skip -1)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference: q [T, Hq, D] over the paged caches -> [T, Hq, D]. Slow, exact, any device."""
    block_size = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    cu_q = meta.cu_seqlens_q.tolist()
    ctx = meta.context_lens.tolist()
    tables = meta.block_tables.tolist()
    for i, ctx_len in enumerate(ctx):
        q_i = q[cu_q[i]:cu_q[i + 1]]                               # [Lq, Hq, D]
        q_len = q_i.shape[0]
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = torch.tensor(tables[i][:n_blocks], dtype=torch.long, device=q.device)
        k_i = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:ctx_len]
        v_i = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:ctx_len]
        k_i = k_i.repeat_interleave(group, dim=1).float()          # [Lk, Hq, D]
        v_i = v_i.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q_i.float(), k_i) * scale
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[cu_q[i]:cu_q[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v_i).to(q.dtype)
    return out


class TorchBackend:
    """Reference backend: runs anywhere, used on CPU."""
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)


def select_backend(name: str = "auto", device: torch.device | str = "cpu"):
    """Pick an attention backend: auto|flash_attn|triton|torch."""
    if name in ("auto", "torch"):
        return TorchBackend()
    raise ValueError(f"unknown or unavailable attention backend {name!r}")
