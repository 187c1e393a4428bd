"""Prefill through torch's built-in FlashAttention (torch.nn.attention.varlen.varlen_attn).

When no sequence of a prefill batch has a cached prefix, every key a query needs is among
this step's own k/v, so a contiguous varlen FlashAttention call replaces the paged Triton
prefill (which must gather keys block by block). Its reference is the same
kernels.attention.paged_attention_ref (the k/v are in the cache too).

varlen_attn's signature moved between torch releases (is_causal in 2.10; window_size and
scale later; enable_gqa from 2.12), so the call adapts to the installed one. It is only
used where K/V need no expansion (no GQA, or enable_gqa): on an H100 with torch 2.11
(GQA 2, K/V repeated) it took 197 us for a 4,102-token prefix-free Qwen3-0.6B-shaped batch
where the Triton paged prefill took 136 us (tests/gpu/RESULTS.md).
"""
from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=None)
def _api():
    """(varlen_attn, its parameter names), or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def usable(q: torch.Tensor, k: torch.Tensor, scale: float) -> bool:
    """Whether varlen_attn can run this batch without copying K/V (else it loses)."""
    api = _api()
    if api is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[1] != k.shape[1] and "enable_gqa" not in api[1]:
        return False
    head_dim = q.shape[-1]
    # Without a scale argument the kernel uses 1/sqrt(head_dim): only right if that is ours.
    return "scale" in api[1] or abs(scale - head_dim ** -0.5) < 1e-12


def varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   max_len: int, scale: float) -> torch.Tensor:
    """Causal attention of each sequence over itself: q [T, Hq, D], k/v [T, Hkv, D]."""
    fn, params = _api()
    kwargs = {}
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)           # no look-ahead = causal
    if "scale" in params:
        kwargs["scale"] = scale
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)
