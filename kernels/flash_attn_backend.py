"""flash-attn (v2) paged attention: thin wrappers with the exact calls nano-vllm makes.

flash-attn is optional (no binary wheel; it is compiled on the GPU host), so nothing here
imports it at module import time. Constraints of flash-attn 2's paged KV path that the
caller must respect (from flash_attn_interface.flash_attn_with_kvcache's docstring):
* the cache layout is [num_blocks, page_block_size, Hkv, D] and page_block_size must be a
  multiple of 256;
* block_table [num_seqs, max_blocks] and cache_seqlens / cu_seqlens: int32 on the GPU;
* fp16/bf16 only (the nanoserve build is bf16 / head_dim 128 only, see DESIGN.md).
"""
from __future__ import annotations

import functools
import importlib

import torch


@functools.lru_cache(maxsize=None)
def flash_attn_available() -> bool:
    """True when `import flash_attn` works (its CUDA extension loads)."""
    try:
        importlib.import_module("flash_attn")
    except Exception:                      # ImportError, or an extension ABI/driver error
        return False
    return True


def check_supported(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Raise ValueError for inputs flash-attn's paged path rejects (clearer than its asserts)."""
    if k_cache.shape[1] % 256 != 0:
        raise ValueError(f"flash-attn paged KV needs block_size % 256 == 0, got {k_cache.shape[1]}")
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.is_cuda:
        raise ValueError(f"flash-attn needs fp16/bf16 CUDA tensors, got {q.dtype} on {q.device}")


def flash_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, block_tables: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Ragged causal attention of q [T, Hq, D] over the paged context (bottom-right aligned
    causal mask = queries are the last q_len positions of each context)."""
    from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, softmax_scale=scale,
                                  causal=True, block_table=block_tables)


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """One query token per sequence: q [num_seqs, Hq, D] -> [num_seqs, Hq, D]."""
    from flash_attn import flash_attn_with_kvcache
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                  block_table=block_tables, softmax_scale=scale, causal=True)
    return out.squeeze(1)
