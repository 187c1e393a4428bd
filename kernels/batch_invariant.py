"""Batch-invariant GEMM: y = x @ W.T (* per-channel scale) (+ bias), each row's result a
function of that row alone, whatever the number of rows (--deterministic, issue 68).

Why a kernel of its own: cuBLAS picks its algorithm (tile shape, split-K, stream-K) from
M, so one token's logits change with the batch beside it; the GEMV (kernels/gemv.py) that
serves one row and the GEMM that serves more are two reduction orders by construction.
Here one program owns a BLOCK_M x BLOCK_N output tile and walks K from 0, accumulating in
float32 with tl.dot; K is never split and nothing is atomic. An output element's sum is then
the same sequence of the same products for every M: on the GPU every tl.dot is a chain of
16-wide MMAs (or FMAs for fp32) accumulated into the running tile in K order, so neither
the row's place in its tile, nor the tile's shape, nor BLOCK_K changes an element's order,
and the tiles may follow the row count (`tiles`: narrow, deep-pipelined tiles for a decode
step's few rows, which are bound by the weights' bandwidth; 128 x 128 for prefill, bound by
the MMAs). tests/gpu/bench_invariant_linear.py checks that on the GPU (every config against
every other, bit for bit) and times them against cuBLAS. The interpreter's tl.dot is a
numpy matmul added to the accumulator, so there BLOCK_K groups the sum: it runs one fixed
tile. The alternative, cuBLAS on the batch padded to one fixed bucket, keeps cuBLAS's
speed at that bucket only, and which algorithm cuBLAS runs inside it is still its own
choice per GPU and library version.

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

BLOCK_M = 64    # the interpreter's one tile (see above): BLOCK_M x block_n(N) x BLOCK_K
BLOCK_K = 64


def block_n(n: int) -> int:
    """The interpreter's output channels per tile: 64, or 32 for narrow layers."""
    return 32 if n <= 2048 else 64


def tiles(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for m rows of an n-channel layer (16-bit
    operands; invariant_linear halves BLOCK_K for float32 on a GPU). The interpreter: its
    one tile. A GPU: the fastest invariant config of tests/gpu/bench_invariant_linear.py on
    an H200 (bf16, Qwen3-0.6B / 8B shapes) per row range. Up to 64 rows the weights'
    bandwidth decides: enough programs to cover the SMs and deep pipelines (8B down 85.6 ->
    35.3 us at 1 row, cuBLAS 30.1); past 512 the MMAs do (8B gate_up at 2048 rows 1174 ->
    767 us)."""
    if INTERPRET_ENV:
        return BLOCK_M, block_n(n), BLOCK_K, 4, 3
    if m <= 64:
        return (64, 32, 128, 4, 5) if n <= 4096 else (64, 64, 256, 4, 3)
    if m <= 512 and n < 16384:
        return 64, 128, 128, 8, 3
    return 128, 128, 64, 8, 3


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
                     bias: torch.Tensor | None = None,
                     config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """invariant_linear_ref's values, each row's bits independent of the other rows:
    x [..., K] (bf16 / fp16 / fp32), w [N, K] (rows contiguous; e4m3 needs scale [N, 1]
    float32), bias [N] or None -> [..., N] in x's dtype. No host sync: CUDA-graph safe.
    config: a tile instead of `tiles`' choice (tests/gpu/bench_invariant_linear.py times
    the candidates; every one gives the same bits on a GPU)."""
    shape = x.shape
    x2, N = linear_rows(x, w, scale, bias)
    K = shape[-1]
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        bm, bn, bk, warps, stages = config or tiles(M, N)
        if x.dtype == torch.float32 and not INTERPRET_ENV:
            bk //= 2   # float32 operands: the stages still fit in shared memory
        sc = scale.reshape(-1).contiguous() if scale is not None else None
        _matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            x2, w, sc if sc is not None else y, bias if bias is not None else y, y,
            M, N, K, x2.stride(0), w.stride(0), y.stride(0),
            HAS_SCALE=sc is not None, HAS_BIAS=bias is not None,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            RNE_BF16=INTERPRET_ENV and x.dtype == torch.bfloat16,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y.reshape(*shape[:-1], N)
