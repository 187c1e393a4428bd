"""FP8 weights: e4m3 with one scale per output channel, activations quantized per token.

Why: a decode step at large-model sizes reads every weight once; e4m3 halves those bytes.
Scales are dynamic for activations (each token's amax / 448, computed on the fly, so no
calibration) and per output channel for weights, the scheme vLLM's `--quantization fp8`
uses: y = (x_q @ w_q.T) * sx[token] * sw[channel], the product accumulated in float32.
On sm_89+ GPUs `torch._scaled_mm` does exactly that in one GEMM; elsewhere
`fp8_linear_ref` computes the same values from dequantized operands (the tests' and CPU's
path). Checkpoints published in FP8 (Qwen's: 128 x 128 blocks, `weight_scale_inv`) are
dequantized at load with `dequantize_blocks` and requantized per channel.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)   # 448


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (e4m3 [R, C], float32 scales [R, 1]) with t ~ q * scale, each row's
    largest magnitude mapped to 448."""
    scale = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


# Triton's CPU interpreter (the tests) casts float32 -> e4m3 wrongly where rounding carries
# into the next binade (125.7 -> 64, not 128); there values are rounded onto the e4m3 grid
# first (to nearest, ties to even), so the cast is exact. Compiled kernels cast natively.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _to_e4m3(q):
    if _INTERPRET:
        a = tl.abs(q)
        quantum = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0) - 3.0)
        n = a / quantum
        f = tl.floor(n)
        odd = f - 2.0 * tl.floor(f * 0.5)   # ties go to the even neighbour (RNE)
        r = tl.where(n - f > 0.5, f + 1.0, tl.where(n - f < 0.5, f, f + odd))
        q = tl.where(q < 0, -1.0, 1.0) * r * quantum
    return q.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(X, Q, Scale, K, stride_x, stride_q, BLOCK: tl.constexpr):
    """One row: its amax, then every element / (amax / 448) as e4m3; two passes over the row."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    tl.store(Scale + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(Q + row * stride_q + offs, _to_e4m3(q), mask=offs < K)


def quantize_rows_(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in one kernel launch (the decode path quantizes every linear layer's
    input: five torch ops each cost more than the GEMM saves)."""
    rows, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=1024)
    return q, scale


def fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (any float dtype), w_q [N, K] e4m3, w_scale [N, 1] float32 -> [T, N] in x's
    dtype: the per-token-quantized x times the weight, from dequantized operands."""
    x_q, x_scale = quantize_rows(x)
    y = (x_q.float() * x_scale) @ (w_q.float() * w_scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@functools.lru_cache(maxsize=None)
def scaled_mm_supported(device: torch.device) -> bool:
    """Asked by every FP8 linear layer of every eager step: answered once per device."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear_ref's values; one `torch._scaled_mm` (rowwise scales) on sm_89+."""
    if not scaled_mm_supported(x.device):
        return fp8_linear_ref(x, w_q, w_scale, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x_q, x_scale = quantize_rows_(x2)
    y = torch._scaled_mm(x_q, w_q.T, scale_a=x_scale, scale_b=w_scale.reshape(1, -1), out_dtype=x.dtype,
                         bias=bias)
    return y.reshape(*shape[:-1], w_q.shape[0])


def dequantize_blocks(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """A block-scaled FP8 checkpoint tensor (Qwen's `weight` + `weight_scale_inv`: one
    scale per block[0] x block[1] tile, edge tiles partial) back to `dtype`."""
    n, k = w_q.shape
    bn, bk = block
    scales = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w_q.float() * scales).to(dtype)
