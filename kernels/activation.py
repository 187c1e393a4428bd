"""SiLU-and-mul (SwiGLU gate) in one Triton pass: read gate and up once, write silu(gate)*up.

The torch version (F.silu + chunk + mul) launches two kernels and round-trips an
intermediate through HBM; on the decode path every such extra kernel counts.
Numerics follow Hugging Face: silu and the product are computed in the activation dtype's
rounding (silu in fp32, rounded, then multiplied and rounded), matching `silu_and_mul_ref`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_linear import FP8, ONE_BLOCK_MAX, QuantizedRows, fp8_rows, quantize_store
from kernels.roundings import silu


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: [..., 2 * d] (gate then up) -> silu(gate) * up, [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(X, Out, Q, QScale, R, D: tl.constexpr, BLOCK: tl.constexpr,
                         QUANT: tl.constexpr, PDL: tl.constexpr):
    """Program (row, j): BLOCK outputs of a row. QUANT (one program a row, BLOCK >= D):
    the row also goes out as e4m3 with its scale; rows from R on only write that copy's
    zero padding."""
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    real = mask & (row < R)
    gate = tl.load(X + row * 2 * D + offs, mask=real, other=0.0)
    up = tl.load(X + row * 2 * D + D + offs, mask=real, other=0.0)
    g = gate.to(tl.float32)
    act = silu(g).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * D + offs, out, mask=real)
    if QUANT:
        quantize_store(out.to(tl.float32), Q + row * D, QScale, row, offs, mask)


def silu_and_mul(x: torch.Tensor, fp8: bool = False):
    """Fused Triton silu(gate) * up over the last dim of a contiguous [..., 2 * d] tensor.
    fp8 (x 2-D, d <= ONE_BLOCK_MAX): the output comes as QuantizedRows
    (kernels/fp8_linear.py), its e4m3 copy from the same pass, for the FP8 GEMM it feeds."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = x.numel() // max(2 * d, 1)
    if fp8:
        assert x.dim() == 2 and d <= ONE_BLOCK_MAX
        grid = (fp8_rows(rows), 1)
        block = triton.next_power_of_2(d)
        q = torch.empty(grid[0], d, dtype=FP8, device=x.device)
        scale = torch.empty(grid[0], 1, dtype=torch.float32, device=x.device)
        warps = min(16, max(4, block // 1024))
    else:
        block = min(triton.next_power_of_2(d), 1024)
        grid, q, scale, warps = (rows, triton.cdiv(d, block)), out, out, 4
    if rows:
        _silu_and_mul_kernel[grid](x, out, q, scale, rows, D=d, BLOCK=block, QUANT=fp8,
                                   num_warps=warps, **pdl.launch(x.device, rows))
    return QuantizedRows(out, q, scale) if fp8 else out
