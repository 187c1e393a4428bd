"""Rotary position embedding, neox style (rotate halves), as Qwen3/Llama use it.

cos_sin_cache [max_position, rot_dim] holds cat(cos, sin) per position (each rot_dim / 2
wide, float32 recommended). The first rot_dim dims of every head are rotated:
    out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin,   x1 | x2 = halves of x[:rot_dim]
and any dims past rot_dim pass through. Math is float32 in both versions. The Triton kernel
rotates q and k in place in one launch: one program per token, all heads of it at once,
so cos/sin are read once per token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: q [T, Hq, D], k [T, Hkv, D], positions [T] -> new rotated (q, k)."""
    half = cos_sin_cache.shape[-1] // 2
    cos, sin = cos_sin_cache[positions.long()].float().split(half, dim=-1)   # [T, half] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1).to(x.dtype)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(X, token, stride_t, stride_h, cos, sin,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    p1 = X + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, Positions, CosSin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(CosSin + pos * stride_cache + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cache + HALF + offs_d, mask=d_mask, other=0.0)
    cos, sin = cos[None, :], sin.to(tl.float32)[None, :]
    _rotate_heads(Q, token, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, BLOCK_HQ, HALF, BLOCK_HALF)
    _rotate_heads(K, token, stride_kt, stride_kh, cos, sin, NUM_K_HEADS, BLOCK_HK, HALF, BLOCK_HALF)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (strided views allowed: last dim
    contiguous); returns (q, k). positions: int32/int64 [T]; cos_sin_cache contiguous."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and rot_dim <= head_dim
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.is_contiguous()
    assert positions.shape == (num_tokens,)
    if num_tokens:
        half = rot_dim // 2
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_k_heads),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        )
    return q, k
