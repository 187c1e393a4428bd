"""Qwen3's per-head q/k RMSNorm and neox rotary in one Triton pass, in place, optionally
also storing the token's K and V into the paged KV cache.

Unfused, a decode layer runs four kernels here (q norm, k norm, rotary, KV store), each a
round trip through HBM. This kernel reads every head of one token once (at decode sizes
q's heads in one program, k's in another), normalizes it (numerics of kernels/rmsnorm.py:
fp32 statistics, rounded to the activation dtype, times the weight, rounded), rotates it
(kernels/rotary.py: fp32 math), writes it back, and, given the caches, writes K and V at
the token's slot (quantized as kernels/kv_quant.py for an fp8 cache) as
kernels/store_kvcache.py would. Reference: `qk_norm_rotary_ref` = rms_norm_ref then
apply_rotary_ref (then store_kvcache_ref). Needs rot_dim == head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.kv_quant import check_cache, e4m3_scale, to_e4m3
from kernels.rmsnorm import rms_norm_ref
from kernels.roundings import scale_normed
from kernels.rotary import apply_rotary_ref
from kernels.store_kvcache import slot_rows


@dataclass(frozen=True)
class NormRotary:
    """What the decode attention kernel needs to do this file's work in its own prologue
    (kernels/paged_attention.paged_decode's norm_rotary): the raw k, v heads [T, Hkv, D]
    (views of the qkv output), the norms' weights and eps, the rotary cache and where each
    token's K/V go."""
    k: torch.Tensor
    v: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor

    def check(self, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        """The shapes qk_norm_rotary asserts, for q [T, Hq, D] and a [.., .., Hkv, D] cache."""
        t, _, d = q.shape
        assert self.k.shape == self.v.shape == (t, k_cache.shape[2], d) and d % 2 == 0
        assert self.cos_sin_cache.shape[-1] == d, "fused q/k norm + rotary needs rot_dim == head_dim"
        assert q.stride(-1) == self.k.stride(-1) == self.v.stride(-1) == 1
        assert self.cos_sin_cache.is_contiguous() and k_cache.stride(-1) == 1
        assert self.q_weight.shape == self.k_weight.shape == (d,)


# H100, Qwen3-0.6B heads (tests/gpu/RESULTS.md): 131 tokens 8.0 -> 7.6 us with two programs a
# token, 7,929 tokens 58 -> 61 us (bf16; fp8 cache 58 -> 67): more programs than SMs can hold.
TWO_PROGRAMS_MAX_TOKENS = 1024


def qk_norm_rotary_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary_ref(rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps),
                            positions, cos_sin_cache)


@triton.jit
def _head_rstd(x1, x2, eps, HALF: tl.constexpr):
    """1 / rms of each row [R] of heads given as their halves x1, x2 [R, BLOCK_HALF]."""
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    return 1.0 / tl.sqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)


@triton.jit
def _normed(x, rstd, w):
    """x [R, C] normalized by rstd [R] and weighted by w [1, C] (fp32), rounded as
    kernels/rmsnorm.py rounds, returned as fp32 for the rotation."""
    return scale_normed(x, rstd[:, None], w).to(x.dtype).to(tl.float32)


@triton.jit
def _norm_rotate_heads(X, W, token, stride_t, stride_h, cos, sin, eps,
                       NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    mask = (offs_h[:, None] < NUM_HEADS) & d_mask[None, :]
    p1 = X + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    rstd = _head_rstd(x1, x2, eps, HALF)
    y1 = _normed(x1, rstd, tl.load(W + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :])
    y2 = _normed(x2, rstd, tl.load(W + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :])
    o1 = (y1 * cos - y2 * sin).to(X.dtype.element_ty)
    o2 = (y2 * cos + y1 * sin).to(X.dtype.element_ty)
    tl.store(p1, o1, mask=mask)
    tl.store(p2, o2, mask=mask)
    return o1, o2


@triton.jit
def norm_rotate_rows(rows, mask, W, cos_sin, eps, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The heads starting at pointers rows [R, 1] (mask [R]), each normalized and rotated
    at the position whose cos/sin row starts at cos_sin [R, 1], as whole rows [R, BLOCK_D]
    in fp32 (the caller rounds them to the heads' dtype), not written anywhere:
    _norm_rotate_heads' numerics (the statistics from the two halves, each element's
    rotation partner loaded beside it) for a kernel that consumes them
    (kernels/paged_attention.py's decode prologue)."""
    offs_h = tl.arange(0, BLOCK_HALF)
    hm = mask[:, None] & (offs_h < HALF)[None, :]
    rstd = _head_rstd(tl.load(rows + offs_h[None, :], mask=hm, other=0.0),
                      tl.load(rows + HALF + offs_h[None, :], mask=hm, other=0.0), eps, HALF)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    dm = mask[:, None] & d_mask[None, :]
    y = _normed(tl.load(rows + offs_d[None, :], mask=dm, other=0.0), rstd,
                tl.load(W + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :])
    yp = _normed(tl.load(rows + partner[None, :], mask=dm, other=0.0), rstd,
                 tl.load(W + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :])
    at = offs_d % HALF
    cos = tl.load(cos_sin + at[None, :], mask=dm, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin + HALF + at[None, :], mask=dm, other=0.0).to(tl.float32)
    first = (offs_d < HALF)[None, :]
    return tl.where(first, y * cos - yp * sin, y * cos + yp * sin)


@triton.jit
def _store_halves(Cache, Scale, slot, x1, x2, stride_cb, stride_cs, stride_ch,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, FP8: tl.constexpr):
    """Write one token's [heads, 2 * HALF] row, given as its two halves, at `slot`."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    dst = (Cache + slot_rows(slot, offs_h, stride_cb, stride_cs, stride_ch, PAGE_SIZE)
           + offs_d[None, :])
    if FP8:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        scale = e4m3_scale(tl.maximum(tl.max(tl.max(tl.abs(f1), 1), 0),
                                      tl.max(tl.max(tl.abs(f2), 1), 0)))
        tl.store(dst, to_e4m3(f1, scale), mask=mask)
        tl.store(dst + HALF, to_e4m3(f2, scale), mask=mask)
        tl.store(Scale + slot, scale)
    else:
        tl.store(dst, x1, mask=mask)
        tl.store(dst + HALF, x2, mask=mask)


@triton.jit
def _qk_norm_rotary_kernel(
    Q, K, QW, KW, Positions, CosSin, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    V, KCache, VCache, KScale, VScale, SlotMapping, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,     # page, slot-in-page, kv-head strides of the caches
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, STORE: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(CosSin + pos * stride_cache + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cache + HALF + offs_d, mask=d_mask, other=0.0)
    cos, sin = cos[None, :], sin.to(tl.float32)[None, :]
    if tl.program_id(1) == 0:
        _norm_rotate_heads(Q, QW, token, stride_qt, stride_qh, cos, sin, eps,
                           NUM_Q_HEADS, BLOCK_HQ, HALF, BLOCK_HALF)
        if tl.num_programs(1) > 1:   # a second program of this token does k's heads
            return
    k1, k2 = _norm_rotate_heads(K, KW, token, stride_kt, stride_kh, cos, sin, eps,
                                NUM_K_HEADS, BLOCK_HK, HALF, BLOCK_HALF)
    if STORE:
        slot = tl.load(SlotMapping + token).to(tl.int64)
        if slot >= 0:                        # -1: padding, or KV already cached
            offs_h = tl.arange(0, BLOCK_HK)
            offs_d = tl.arange(0, BLOCK_HALF)
            mask = (offs_h[:, None] < NUM_K_HEADS) & (offs_d[None, :] < HALF)
            src = V + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            v1 = tl.load(src, mask=mask, other=0.0)
            v2 = tl.load(src + HALF, mask=mask, other=0.0)
            _store_halves(KCache, KScale, slot, k1, k2, stride_cb, stride_cs, stride_ch,
                          NUM_K_HEADS, BLOCK_HK, HALF, BLOCK_HALF, PAGE_SIZE, FP8)
            _store_halves(VCache, VScale, slot, v1, v2, stride_cb, stride_cs, stride_ch,
                          NUM_K_HEADS, BLOCK_HK, HALF, BLOCK_HALF, PAGE_SIZE, FP8)


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, v: torch.Tensor | None = None,
                   k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                   slot_mapping: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize and rotate q [T, Hq, D] and k [T, Hkv, D] in place (strided views of a
    fused qkv output are fine: last dim contiguous); returns (q, k). Given v [T, Hkv, D]
    and the caches, also stores K and V as store_kvcache(k, v, k_cache, v_cache,
    slot_mapping, k_scale, v_scale) would."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert cos_sin_cache.shape[-1] == head_dim, "fused q/k norm + rotary needs rot_dim == head_dim"
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.is_contiguous()
    assert positions.shape == (num_tokens,)
    assert q_weight.shape == k_weight.shape == (head_dim,)
    store = v is not None
    fp8 = False
    if store:
        assert v.shape == k.shape and v.stride(-1) == 1 and slot_mapping.shape == (num_tokens,)
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        assert k_cache.shape[2:] == (num_k_heads, head_dim) and v_cache.shape == k_cache.shape
        fp8 = check_cache(k.dtype, k_cache, v_cache, k_scale, v_scale)
    if num_tokens:
        half = head_dim // 2
        # Up to TWO_PROGRAMS_MAX_TOKENS tokens, two programs a token (q's heads; k's and
        # the store): there one program a token is a long dependent chain on few SMs.
        parts = 2 if num_tokens <= TWO_PROGRAMS_MAX_TOKENS else 1
        _qk_norm_rotary_kernel[(num_tokens, parts)](
            q, k, q_weight, k_weight, positions, cos_sin_cache, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            *((v, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
               slot_mapping, v.stride(0), v.stride(1), *k_cache.stride()[:3]) if store
              else (k, k, k, k, k, positions, 0, 0, 0, 0, 0)),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_k_heads),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
            PAGE_SIZE=k_cache.shape[1] if store else 1, STORE=store, FP8=fp8,
            **pdl.launch(q.device, num_tokens),
        )
    return q, k
