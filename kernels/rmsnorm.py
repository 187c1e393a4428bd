"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Numerics follow Hugging Face's Qwen3RMSNorm, so CPU runs match `generate` token for token:
the residual sum is rounded to the activation dtype (HF adds in that dtype), the norm is
computed in float32, cast back to the activation dtype, then multiplied by the weight.
The Triton kernel does all of it in one pass over the row: read x (+ residual), write the
new residual, write the normalized output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_linear import FP8, QuantizedRows, fp8_rows, quantize_store
from kernels.roundings import scale_normed


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference: norm(x) or, with residual, (norm(x + residual), x + residual)."""
    dtype = x.dtype
    if residual is not None:
        x = (x.float() + residual.float()).to(dtype)
        residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y.to(dtype) * weight).to(dtype)
    return y if residual is None else (y, residual)


@triton.jit
def normalize_row(x, w, eps, N: tl.constexpr):
    """One row's RMSNorm as Hugging Face computes it: x (activation dtype; padding zeros)
    normalized in float32, rounded to x's dtype, times w (float32). Returns float32."""
    xf = x.to(tl.float32)
    return scale_normed(x, 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps), w)


@triton.jit
def _rms_norm_kernel(
    X, Residual, Weight, Out, Q, QScale, R,
    stride_x_outer, stride_x_inner, inner, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    # Row r of x is x[r // inner, r % inner, :] (inner = 1 for 2-D inputs), so strided
    # views such as per-head q/k slices of a fused qkv output are normalized in place of a copy.
    # QUANT: the output also goes out as e4m3 with its per-row scale (an FP8 GEMM's input);
    # programs from row R on only write that copy's zero padding rows.
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    real = mask & (row < R)
    x_ptr = X + (row // inner) * stride_x_outer + (row % inner) * stride_x_inner + offs
    x = tl.load(x_ptr, mask=real, other=0.0)
    if HAS_RESIDUAL:
        r_ptr = Residual + row * N + offs
        x = (x.to(tl.float32) + tl.load(r_ptr, mask=real, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(r_ptr, x, mask=real)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    out = normalize_row(x, w, eps, N).to(Out.dtype.element_ty)
    tl.store(Out + row * N + offs, out, mask=real)
    if QUANT:
        quantize_store(out.to(tl.float32), Q + row * N, QScale, row, offs, mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, fp8: bool = False):
    """Fused Triton RMSNorm over the last dim; returns a new contiguous output.

    With `residual` (contiguous, same shape as x): the sum x + residual is written back
    *into residual* (no extra allocation, CUDA-graph friendly) and (out, residual) returned.
    x may be any contiguous tensor or a 3-D strided view [T, H, N] with a contiguous last dim.
    fp8 (x 2-D): the output comes as QuantizedRows (kernels/fp8_linear.py), its e4m3 copy
    from the same pass, for the FP8 GEMM it feeds.
    """
    n = x.shape[-1]
    assert x.stride(-1) == 1 and weight.shape == (n,)
    if x.dim() == 3 and not x.is_contiguous():
        outer, inner = x.shape[0], x.shape[1]
        stride_outer, stride_inner = x.stride(0), x.stride(1)
    else:
        x = x.contiguous()
        outer, inner = x.numel() // max(n, 1), 1
        stride_outer, stride_inner = n, 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous()
        assert residual.dtype == x.dtype
    rows = outer * inner
    q = scale = out
    grid = rows
    if fp8:
        assert x.dim() == 2 and inner == 1
        grid = fp8_rows(rows)
        q = torch.empty(grid, n, dtype=FP8, device=x.device)
        scale = torch.empty(grid, 1, dtype=torch.float32, device=x.device)
    if grid:
        block_n = triton.next_power_of_2(n)
        _rms_norm_kernel[(grid,)](
            x, residual if residual is not None else x, weight, out, q, scale, rows,
            stride_outer, stride_inner, inner, eps,
            N=n, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None, QUANT=fp8,
            num_warps=min(max(block_n // 256, 1), 8), **pdl.launch(x.device, rows),
        )
    if fp8:
        out = QuantizedRows(out, q, scale)
    return out if residual is None else (out, residual)
