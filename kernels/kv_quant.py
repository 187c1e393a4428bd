"""FP8 (e4m3) KV cache: how a token's K or V row is quantized, in torch and in Triton.

Each token's row of this rank's K (all its kv heads x head_dim values) gets one float32
scale, amax / 448 (448 = e4m3's largest finite value), and its values are stored as
e4m3(x / scale); V likewise. A per-token scale needs no calibration and can never
overflow, whatever the model's activations; it costs 4 bytes per token per layer for K
and V each (a 1024-byte fp8 row for Qwen3-0.6B: 1.99x the tokens of bf16 in the same
memory). Attention reads e4m3 -> the activation dtype (exact) and applies the scales to
the scores (K) and the probabilities (V), so no dequantized tile is ever written.

`quantize_ref` is the reference; `quantize_rows` is the same arithmetic inside a Triton
kernel. The fp32 value is rounded to the e4m3 grid before the cast (ties to even, as
torch's cast does), so the cast itself is exact: Triton's CPU interpreter rounds fp8
casts wrongly (it drops the mantissa carry), and this keeps kernel == reference bit for
bit on CPU and GPU alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-8            # an all-zero row still gets a finite, positive scale


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (e4m3 [T, H, D], float32 scale [T]) with one scale per token."""
    xf = x.float()
    amax = xf.abs().amax(dim=(1, 2)).clamp(min=MIN_AMAX)
    scale = amax / torch.full_like(amax, FP8_MAX)   # a tensor divisor: CUDA divides a tensor
                                                    # by a scalar as times its reciprocal
    q = (xf / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def check_cache(dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the caches are fp8 (then with contiguous float32 per-slot scales), else
    of the activation dtype."""
    assert v_cache.dtype == k_cache.dtype
    if k_cache.dtype != FP8_DTYPE:
        assert k_cache.dtype == dtype and k_scale is None and v_scale is None
        return False
    assert k_scale is not None and v_scale is not None, "an fp8 KV cache needs its scales"
    assert k_scale.shape == v_scale.shape == k_cache.shape[:2]
    assert k_scale.dtype == v_scale.dtype == torch.float32
    assert k_scale.is_contiguous() and v_scale.is_contiguous()
    return True


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [..., H, D] with scale [...] -> dtype."""
    return (q.float() * scale[..., None, None]).to(dtype)


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even."""
    bits = x.to(tl.int32, bitcast=True)
    # normals: keep 3 of fp32's 23 mantissa bits, rounding the 20 dropped ones
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = bits.to(tl.float32, bitcast=True)
    # subnormals (|x| < 2^-6) sit on a fixed 2^-9 grid: adding 1.5 * 2^14 rounds to it
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def e4m3_scale(amax):
    """The scale of a row whose largest |value| is amax (as quantize_ref)."""
    return tl.math.div_rn(tl.maximum(amax, 1e-8), 448.0)


@triton.jit
def to_e4m3(x, scale):
    """fp32 x / scale as e4m3 (as quantize_ref)."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    return _round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit
def quantize_rows(x):
    """One token's 2-D row x (fp32) -> (e4m3 values, scale), as quantize_ref."""
    scale = e4m3_scale(tl.max(tl.max(tl.abs(x), 1), 0))
    return to_e4m3(x, scale), scale
