"""Batch-invariant GEMM: y = x @ W.T (* per-channel scale) (+ bias), each row's result a
function of that row alone, whatever the number of rows (--deterministic, issue 68).

Why a kernel of its own: cuBLAS picks its algorithm (tile shape, split-K, stream-K) from
M, so one token's logits change with the batch beside it; the GEMV (kernels/gemv.py) that
serves one row and the GEMM that serves more are two reduction orders by construction.
Here one program owns a BLOCK_M x BLOCK_N output tile and walks K from 0 in BLOCK_K
steps, accumulating in float32 with tl.dot; the tile sizes are constants, never chosen
from M, K is never split and nothing is atomic. An output element's sum is then the same
sequence of the same dots for every M: the row's place in its tile does not change an
MMA's per-element order (nor BLAS's in the interpreter), and other rows only fill other
lanes. The alternative, cuBLAS on the batch padded to one fixed bucket, keeps cuBLAS's
speed at that bucket only: a decode batch padded to 256 rows, or a prefill cut into
256-row slices that each re-read the weights, costs more than fixed tiles at both ends,
and which algorithm cuBLAS runs inside the bucket is still its own choice per GPU and
library version. The tiles are a function of N and K only (allowed: they are the layer's,
not the batch's); their GPU cost is unmeasured (README: deterministic mode).

W may be bf16 / fp16 / fp32, or e4m3 with one float32 scale per output channel: widened
to x's dtype in the tile (exact), weight-only (x is not quantized), so the values are
kernels/fp8_linear.py's fp8_weight_only_ref, not the W8A8 GEMM's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv import linear_rows
from kernels.interpret import INTERPRET, INTERPRET_ENV, cast

BLOCK_M = 64    # rows per tile: fixed, the rule (never from the row count)
BLOCK_K = 64


def block_n(n: int) -> int:
    """Output channels per tile: 64, or 32 for narrow layers (more programs for a decode
    step's few rows). A function of the layer, never of the row count."""
    return 32 if n <= 2048 else 64


def invariant_linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The values (not the bits): x [..., K] @ (w [N, K] * scale [N, 1]).T + bias in float32,
    returned in x's dtype."""
    wf = w.float() if scale is None else w.float() * scale.float().reshape(-1, 1)
    y = x.float() @ wf.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(X, W, Scale, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                   RNE_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):      # K in order from 0, never split
        k_mask = offs_k < K - k0
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if INTERPRET:   # numpy has no bf16 / e4m3: both widened (exact), float32 dot
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:
        acc = acc * tl.load(Scale + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, cast(acc, Y.dtype.element_ty, RNE_BF16),
             mask=m_mask[:, None] & n_mask[None, :])


def invariant_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """invariant_linear_ref's values, each row's bits independent of the other rows:
    x [..., K] (bf16 / fp16 / fp32), w [N, K] (rows contiguous; e4m3 needs scale [N, 1]
    float32), bias [N] or None -> [..., N] in x's dtype. No host sync: CUDA-graph safe."""
    shape = x.shape
    x2, N = linear_rows(x, w, scale, bias)
    K = shape[-1]
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        bn = block_n(N)
        sc = scale.reshape(-1).contiguous() if scale is not None else None
        _matmul_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, bn))](
            x2, w, sc if sc is not None else y, bias if bias is not None else y, y,
            M, N, K, x2.stride(0), w.stride(0), y.stride(0),
            HAS_SCALE=sc is not None, HAS_BIAS=bias is not None,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            RNE_BF16=INTERPRET_ENV and x.dtype == torch.bfloat16,
            BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)
    return y.reshape(*shape[:-1], N)
