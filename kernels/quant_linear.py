"""Weight-only int4 / int8 linear (GPTQ and AWQ checkpoints): y = x @ W (+ bias), with
W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] and g = g_idx[k].

Why: at batch 1 a decode step costs its weight bytes, and int4 reads a quarter of bf16's.
Both formats are converted at load (models/quantized.py) to one layout, so one pair of
kernels serves them:
  qweight [K / P, N] int32, P = 32 / bits values a word packed along K: the value of row k
          is bits [(k % P) * bits, (k % P + 1) * bits) of word k // P (GPTQ's order)
  scales  [G, N] and zeros [G, N] in the activation dtype (zeros: the true zero point)
  g_idx   [K] int32: the group of each input row (GPTQ act-order permutes it; otherwise
          k // group_size, offset by the rank's first row under row-parallel TP)
Dequantization happens in registers: the GEMV (a few token rows, decode) has each program
own BLOCK_N output channels over all of K and multiply on CUDA cores in float32; the GEMM
(prefill) dequantizes one [BLOCK_K, BLOCK_N] tile at a time into the activation dtype and
feeds tl.dot. The reference dequantizes, rounds W to x's dtype, then multiplies.
No host sync, grid from shapes only: CUDA-graph safe. Not yet measured on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpret import INTERPRET_ENV, cast, dot

BITS = (4, 8)
GEMV_MAX_TOKENS = 4   # up to this many rows the GEMV, above the GEMM (untuned)
ON_CPU = False        # tests set it to run the model's quantized layers in the interpreter


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   g_idx: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] float32 W of the layout above."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, device=qweight.device, dtype=torch.int32)
    q = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)   # [K/P, P, N]
    q = q.reshape(qweight.shape[0] * per_word, qweight.shape[1]).float()
    g = g_idx.long()
    return (q - zeros.float()[g]) * scales.float()[g]


def quant_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W (rounded to x's dtype) + bias, in float32, returned in x's dtype."""
    w = dequantize_ref(qweight, scales, zeros, g_idx, bits).to(x.dtype).float()
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def _dequant_tile(QW, S, Z, G, k0, offs_n, n_mask, K, N, BITS: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_K, BLOCK_N] float32 W of rows k0.. (k0 a multiple of BLOCK_K, itself of the
    values a word holds), zero past K. Each packed word is read once and split in registers;
    a tile whose rows share one group (consecutive groups, as without act-order) reads one
    row of scales and zeros, others each row's."""
    PER_WORD: tl.constexpr = 32 // BITS
    offs_w = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    words = tl.load(QW + offs_w[:, None] * N + offs_n[None, :],
                    mask=(offs_w < K // PER_WORD)[:, None] & n_mask[None, :], other=0)
    shifts = tl.arange(0, PER_WORD) * BITS
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)   # row = word * P + j
    q = tl.reshape(q, [BLOCK_K, BLOCK_N]).to(tl.float32)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    g = tl.load(G + offs_k, mask=k_mask, other=0)
    g_lo = tl.min(tl.where(k_mask, g, 2147483647), 0)
    g_hi = tl.max(tl.where(k_mask, g, -1), 0)
    if g_lo == g_hi:
        s = tl.load(S + g_lo * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(Z + g_lo * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        w = (q - z[None, :]) * s[None, :]
    else:
        rows = g[:, None] * N + offs_n[None, :]
        mask = k_mask[:, None] & n_mask[None, :]
        s2 = tl.load(S + rows, mask=mask, other=0.0).to(tl.float32)
        z2 = tl.load(Z + rows, mask=mask, other=0.0).to(tl.float32)
        w = (q - z2) * s2
    return tl.where(k_mask[:, None], w, 0.0)


@triton.jit
def _quant_gemv_kernel(X, QW, S, Z, G, Bias, Y, N, K, stride_xm, stride_ym,
                       BITS: tl.constexpr, HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dt = Y.dtype.element_ty
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = _dequant_tile(QW, S, Z, G, k0, offs_n, n_mask, K, N, BITS, BLOCK_K, BLOCK_N)
        w = cast(w, dt, RNE_BF16).to(tl.float32)          # the reference's rounding of W
        acc += tl.sum(x[:, None] * w, axis=0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs_n, cast(acc, dt, RNE_BF16), mask=n_mask)


@triton.jit
def _quant_gemm_kernel(X, QW, S, Z, G, Bias, Y, M, N, K, stride_xm, stride_ym,
                       BITS: tl.constexpr, HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    dt = Y.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = cast(_dequant_tile(QW, S, Z, G, k0, offs_n, n_mask, K, N, BITS, BLOCK_K, BLOCK_N),
                 dt, RNE_BF16)
        acc = dot(x, w, acc, PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], cast(acc, dt, RNE_BF16),
             mask=m_mask[:, None] & n_mask[None, :])


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W + bias in x's dtype: the GEMV up to GEMV_MAX_TOKENS rows, else the GEMM."""
    assert bits in BITS, bits
    K, N = qweight.shape[0] * (32 // bits), qweight.shape[1]
    assert x.shape[-1] == K and qweight.dtype == torch.int32 and qweight.is_contiguous()
    assert scales.shape == zeros.shape and scales.shape[1] == N and g_idx.shape == (K,)
    assert scales.is_contiguous() and zeros.is_contiguous() and g_idx.dtype == torch.int32
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        common = dict(BITS=bits, HAS_BIAS=bias is not None,
                      RNE_BF16=INTERPRET_ENV and x.dtype == torch.bfloat16)
        b = bias if bias is not None else scales
        if M <= GEMV_MAX_TOKENS:
            block_n = 64
            _quant_gemv_kernel[(triton.cdiv(N, block_n), M)](
                x2, qweight, scales, zeros, g_idx, b, y, N, K, x2.stride(0), y.stride(0),
                BLOCK_N=block_n, BLOCK_K=128, num_warps=4, **common)
        else:
            block_m = 16 if M <= 16 else 32 if M <= 32 else 64
            _quant_gemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, 64))](
                x2, qweight, scales, zeros, g_idx, b, y, M, N, K, x2.stride(0), y.stride(0),
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4, **common)
    return y.reshape(*x.shape[:-1], N)
