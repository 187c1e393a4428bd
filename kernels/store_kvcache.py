"""Triton kernel: scatter this step's K/V rows into the paged KV cache.

Reference: `kernels.attention.store_kvcache_ref`. One program per token copies that
token's [num_kv_heads, head_dim] row of K and of V to `slot_mapping[token]`; slot -1
(CUDA-graph padding, or a token whose KV is already cached) is skipped. The cache is
addressed through its page / slot-in-page / head strides (`slot_rows`), so it may be
stored token-major or head-major (the worker's: kernels.attention.new_kv_cache). Slots are
widened to int64 before scaling by the strides: a 1 GiB-per-layer cache already has
more elements than int32 can address. An fp8 cache gets each row quantized on the way
with its per-token scale (kernels/kv_quant.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import check_cache, quantize_rows


@triton.jit
def slot_rows(slot, offs_h, stride_cb, stride_cs, stride_ch, PAGE_SIZE: tl.constexpr):
    """Offsets of slot's rows (one per kv head in offs_h) in a cache
    [num_blocks, PAGE_SIZE, Hkv, D] of any strides; slot is int64."""
    return ((slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
            + offs_h[:, None] * stride_ch)


@triton.jit
def _store_kvcache_kernel(
    K, V, KCache, VCache, KScale, VScale, SlotMapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,   # page, slot-in-page, kv-head strides of the caches
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(SlotMapping + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = K + token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = V + token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot_rows(slot, offs_h, stride_cb, stride_cs, stride_ch, PAGE_SIZE) + offs_d[None, :]
    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    if FP8:
        k, k_scale = quantize_rows(k.to(tl.float32))
        v, v_scale = quantize_rows(v.to(tl.float32))
        tl.store(KScale + slot, k_scale)
        tl.store(VScale + slot, v_scale)
    tl.store(KCache + dst, k, mask=mask)
    tl.store(VCache + dst, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at slot_mapping.

    k/v and the caches may be strided views (e.g. slices of a fused qkv projection, a
    head-major cache) as long as the last dim is contiguous. slot_mapping: int32 or
    int64, [T]. fp8 caches need k_scale/v_scale [num_blocks, block_size] float32 (one
    per slot).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "last dim of k/v must be contiguous"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    fp8 = check_cache(k.dtype, k_cache, v_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8,
    )
