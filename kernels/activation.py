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


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: [..., 2 * d] (gate then up) -> silu(gate) * up, [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def silu(g):
    """silu of float32 g as every kernel computes it (kernels/gemv.py's gated epilogue too:
    the same expression gives the same bits)."""
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _silu_and_mul_kernel(X, Out, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(X + row * 2 * D + offs, mask=mask, other=0.0)
    up = tl.load(X + row * 2 * D + D + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = silu(g).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * D + offs, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Fused Triton silu(gate) * up over the last dim of a contiguous [..., 2 * d] tensor."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = x.numel() // max(2 * d, 1)
    if rows:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x, out, D=d, BLOCK=block,
                                                             num_warps=4, **pdl.launch(x.device, rows))
    return out
