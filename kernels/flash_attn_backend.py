"""flash-attn (v2) paged attention: thin wrappers with the exact calls nano-vllm makes.

flash-attn is optional (no binary wheel; it is compiled on the GPU host), so nothing here
imports it at module import time. Constraints of flash-attn 2's paged KV path that the
caller must respect (from flash_attn_interface.flash_attn_with_kvcache's docstring):
* the cache layout is [num_blocks, page_block_size, Hkv, D] and page_block_size must be a
  multiple of 256;
* block_table [num_seqs, max_blocks] and cache_seqlens / cu_seqlens: int32 on the GPU;
* fp16/bf16 only; a build made by kernels/build_flash_attn.py has only the head dims,
  dtypes and GPU archs it was built for (its record: `flash_attn._nanoserve_build`), and
  `coverage_problem` says whether a model fits it.
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


HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256)   # flash-attn 2 rounds a head dim up to one
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.lru_cache(maxsize=None)
def build_record() -> dict | None:
    """What the installed flash_attn was built for (HEAD_DIMS, DTYPES, ARCHS), read from the
    module kernels/build_flash_attn.py puts in its wheel; None for any other build (a full
    upstream build has every kernel)."""
    try:
        mod = importlib.import_module("flash_attn._nanoserve_build")
    except ImportError:
        return None
    return {k: getattr(mod, k) for k in ("VERSION", "HEAD_DIMS", "DTYPES", "ARCHS")}


def coverage_problem(record: dict | None, head_dim: int | None, dtype: torch.dtype | None,
                     capability: tuple[int, int] | None) -> str | None:
    """None if a build with `record` has kernels for this model on this GPU, else why not.
    Unknown properties (None) are not held against it."""
    if head_dim is not None and head_dim > HEAD_DIM_BUCKETS[-1]:
        return f"head dim {head_dim} > {HEAD_DIM_BUCKETS[-1]}"
    if dtype is not None and dtype not in _DTYPE_NAMES:
        return f"dtype {dtype} is not fp16/bf16"
    if capability is not None and capability[0] < 8:
        return f"GPU sm_{capability[0]}{capability[1]} is older than Ampere (sm_80)"
    if record is None:
        return None
    if head_dim is not None:
        bucket = next(b for b in HEAD_DIM_BUCKETS if head_dim <= b)
        if bucket not in record["HEAD_DIMS"]:
            return f"head dim {head_dim} (kernel {bucket}) not built (built: {record['HEAD_DIMS']})"
    if dtype is not None and _DTYPE_NAMES[dtype] not in record["DTYPES"]:
        return f"dtype {_DTYPE_NAMES[dtype]} not built (built: {record['DTYPES']})"
    if capability is not None:
        # code=sm_80 cubins run on every sm_8x; sm_90 ones on sm_90 only (no PTX embedded).
        arch = "80" if capability[0] == 8 else f"{capability[0]}{capability[1]}"
        if arch not in record["ARCHS"]:
            return (f"GPU sm_{capability[0]}{capability[1]} not built "
                    f"(built: {', '.join('sm_' + a for a in record['ARCHS'])})")
    return None


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
