"""The elementwise arithmetic that fused kernels share with the kernels they stand in for:
RMSNorm's scaling, the residual add before it, SiLU. One expression each, so that a norm in a
GEMV's prologue or a SiLU in a GEMM's epilogue rounds as the norm and activation kernels do
(kernels/rmsnorm.py, kernels/activation.py, kernels/gemv.py, kernels/small_m.py,
kernels/qk_norm_rotary.py). It imports no other kernel module: every one of those may use it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_normed(x, rstd, w):
    """RMSNorm's arithmetic once 1 / rms is known (rstd, broadcast to x): x (activation
    dtype) times rstd in float32, rounded to x's dtype, times w (float32); float32. For
    kernels that reduce the row apart from where they normalize it (kernels/gemv.py's
    prologue, the per-head norms of kernels/qk_norm_rotary.py)."""
    return (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w


@triton.jit
def norm_input(X, Res, offs, mask, HAS_RES: tl.constexpr):
    """x (+ residual, added in float32 and rounded to x's dtype as kernels/rmsnorm.py adds
    it) at offs: the row a norm in a GEMV's (or small-M kernel's) prologue normalizes."""
    x = tl.load(X + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(Res + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def silu(g):
    """silu of float32 g as every kernel computes it (the activation kernel, the gated
    epilogues of kernels/gemv.py and kernels/small_m.py: the same expression, the same bits)."""
    return g / (1.0 + tl.exp(-g))
