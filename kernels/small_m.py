"""Linear layers for a few token rows (2-16: a small batch's decode step): one tl.dot kernel
with the weight as the dot's left operand, for e4m3 weights with scales (kernels/fp8_linear.py's
fp8_small_m_linear) and bf16 / fp16 ones (small_m_linear).

Why: at batch 8 a decode step was 258 kernels on an H200 (Qwen3-0.6B): per layer two RMSNorms
and a SiLU-and-mul beside four cuBLAS GEMMs (one split-K with its reduce). Unscaled on bf16
this kernel reads the weights about as fast as cuBLAS at 2-16 rows (tests/gpu/bench_gemv.py),
and like the one-token GEMV (kernels/gemv.py) it takes the norm before it in its prologue
(GemvNorm: x + residual, normalized, the sum written once) and the SwiGLU after it in its
epilogue (gated), and launches with PDL (kernels/pdl.py): the step's layers are then five
kernels each, as at batch 1.

The weight tile [BLOCK_N, BLOCK_K] is the dot's left operand and the tokens its right
([BLOCK_K, BLOCK_T]): the token side is padded to the dot's minimum of 16, never the channel
side, and the loop is the pipelined weight stream (num_stages) alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.gemv import GemvNorm, linear_rows, norm_args
from kernels.interpret import INTERPRET_ENV, cast
from kernels.roundings import norm_input, scale_normed, silu


@triton.jit
def _rows_rstd(X, Res, ResOut, x_offs, t_mask, K, eps, write, BLOCK_K: tl.constexpr,
               BLOCK_T: tl.constexpr, HAS_RES: tl.constexpr, K_PAD: tl.constexpr):
    """1 / rms of the program's token rows (x + residual where HAS_RES), reduced a
    [BLOCK_K, BLOCK_T] tile at a time: one pass of independent loads (a row at a time, as the
    norm kernel reduces it, cost ~3 us more a call on an H200: its loads in series). The
    pass is unrolled (K_PAD, K rounded up to tiles, is a constant) so the tiles' loads can
    issue together: a run-time loop waited for each (an H200, 8 tokens, the 0.6B's gate_up
    9.0 us with the norm, 5.8 without). Where `write` (== 0), the sums x + residual go to
    ResOut."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K, BLOCK_T], dtype=tl.float32)
    for k0 in tl.static_range(0, K_PAD, BLOCK_K):
        mask = (offs_k < K - k0)[:, None] & t_mask[None, :]
        x = norm_input(X, Res, x_offs + k0, mask, HAS_RES)
        if HAS_RES:
            if write == 0:
                tl.store(ResOut + x_offs + k0, x, mask=mask)
        xf = x.to(tl.float32)
        acc += xf * xf
    return 1.0 / tl.sqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def _small_m_kernel(XQ, XScale, W, WScale, Bias, Y, T, N, K, stride_xt, stride_wn, stride_yt,
                    Res, ResOut, NormW, eps,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_T: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                    RNE_BF16: tl.constexpr, SCALED: tl.constexpr = True,
                    NORM: tl.constexpr = False, NORM_RES: tl.constexpr = False,
                    GATED: tl.constexpr = False, PDL: tl.constexpr = False,
                    NORM_K_PAD: tl.constexpr = 0):
    """Y[t, n] = (sum_k XQ[t, k] * W[n, k]) * XScale[t] * WScale[n] (+ Bias[n]) for BLOCK_N
    channels and BLOCK_T tokens (SCALED; else bf16 / fp16 XQ and W, no scales). Programs
    walk the token tiles fastest: those sharing a weight tile run side by side, so past
    BLOCK_T tokens the weight is read from HBM once and from L2 by the rest.
    Unscaled only: NORM: XQ is first normalized (+ Res where NORM_RES; the sum to ResOut by
    the first channel tile's programs) with NormW, as GemvNorm; GATED (W = [gate; up], N
    rows each): the program's channels' gate and up rows, two dots, and Y = silu(gate) * up
    rounded as kernels/gemv.py's gated epilogue rounds it."""
    num_t = tl.cdiv(T, BLOCK_T)
    pid_n = tl.program_id(0) // num_t
    pid_t = tl.program_id(0) % num_t
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    t_mask = offs_t < T
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_offs = offs_t[None, :].to(tl.int64) * stride_xt + offs_k[:, None]
    pdl.wait(PDL)
    rstd = tl.zeros([BLOCK_T], dtype=tl.float32)
    if NORM:
        rstd = _rows_rstd(XQ, Res, ResOut, x_offs, t_mask, K, eps, pid_n, BLOCK_K, BLOCK_T,
                          NORM_RES, NORM_K_PAD)
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            k_mask = offs_k < BLOCK_K
            x_mask = t_mask[None, :]
            w_mask = n_mask[:, None] | EVEN_N
        else:
            k_mask = offs_k < K - k0
            x_mask = k_mask[:, None] & t_mask[None, :]
            w_mask = n_mask[:, None] & k_mask[None, :]
        if NORM:
            x = norm_input(XQ, Res, x_offs + k0, x_mask, NORM_RES)
            g = tl.load(NormW + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = scale_normed(x, rstd[None, :], g[:, None]).to(x.dtype)
        else:
            x = tl.load(XQ + x_offs + k0, mask=x_mask, other=0.0)
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
        if GATED:
            wu = tl.load(w_ptrs + N * stride_wn + k0, mask=w_mask, other=0.0)
        # max_num_imprecise_acc: Hopper's fp8 tensor cores keep a narrower sum than float32,
        # which Triton lets run over all of K by default (0.4% off fp8_linear_ref on an
        # H100); adding each 32-wide product into the float32 accumulator keeps _scaled_mm's
        # precision for ~4% of an 8B batch-8 step (tests/gpu/RESULTS.md).
        if SCALED:
            acc = tl.dot(w, x, acc, max_num_imprecise_acc=32)
        elif RNE_BF16:   # (the interpreter's dot cannot take bf16: its values, widened)
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
            if GATED:
                acc_up = tl.dot(wu.to(tl.float32), x.to(tl.float32), acc_up,
                                input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
            if GATED:
                acc_up = tl.dot(wu, x, acc_up)
    if SCALED:
        acc = acc * tl.load(WScale + offs_n, mask=n_mask, other=0.0)[:, None]
        acc = acc * tl.load(XScale + offs_t, mask=t_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    dt: tl.constexpr = Y.dtype.element_ty
    if GATED:
        gate = cast(acc, dt, RNE_BF16).to(tl.float32)
        up = cast(acc_up, dt, RNE_BF16).to(tl.float32)
        acc = cast(silu(gate), dt, RNE_BF16).to(tl.float32) * up
    y_ptrs = Y + offs_t[None, :].to(tl.int64) * stride_yt + offs_n[:, None]
    tl.store(y_ptrs, cast(acc, dt, RNE_BF16), mask=n_mask[:, None] & t_mask[None, :])


def small_m_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                   gated: bool = False, norm: GemvNorm | None = None,
                   block_n: int | None = None, block_k: int = 256, block_t: int = 16,
                   num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T (+ bias) for a few tokens, x and w bf16 / fp16, in one launch.
    gated (w = [gate; up], no bias): silu(gate) * up, [..., N // 2], as gemv(gated=True).
    norm: the linear of rms_norm(x (+ norm.residual)), the sum to norm.residual_out
    (GemvNorm's contract, for every row). Default tiles: fp8_linear.SMALL_M_TILES' 64 x 256
    in 5 stages, gated two tiles of 32 rows (the same bytes a stage), 4 stages where the
    norm adds its residual's tile (5 would take 239 KB of shared memory, past sm_90's 227).
    The norm's rstd pass walks K a tile at a time, so block_k sets its serial loads: two
    of 64 x 128, 8 tokens on an H200, were faster without the norm (0.6B gate_up 6.3 ->
    5.8 us) and slower with it in the 0.6B's batch-8 step (112 calls 833 -> 984 us)."""
    assert w.dtype == x.dtype in (torch.bfloat16, torch.float16), (w.dtype, x.dtype)
    assert not gated or (bias is None and w.shape[0] % 2 == 0)
    block_n = block_n or (32 if gated else 64)
    num_stages = num_stages or (4 if norm is not None else 5)
    return small_m_launch(x, w, bias, None, None, block_n, block_k, block_t, num_warps,
                          num_stages, gated=gated, norm=norm)


def small_m_launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, quantize,
                   w_scale: torch.Tensor | None, block_n: int, block_k: int, block_t: int,
                   num_warps: int, num_stages: int, gated: bool = False,
                   norm: GemvNorm | None = None) -> torch.Tensor:
    """The launch behind small_m_linear and fp8_small_m_linear: x [..., K] as contiguous rows,
    quantize(rows) -> (e4m3 rows, scales) for the scaled kernel (None: unscaled)."""
    shape = x.shape
    K = shape[-1]
    x2, N = linear_rows(x, w, w_scale, bias)
    if norm is not None:   # (the prologue reads x and the residual with one row stride)
        assert quantize is None
        x2 = x2.contiguous()
    T = x2.shape[0]
    res, res_out, norm_w, eps = norm_args(norm, x2)
    out_n = N // 2 if gated else N
    y = torch.empty(T, out_n, dtype=x.dtype, device=x.device)
    if T and N:
        x_q, x_scale = quantize(x2) if quantize is not None else (x2, y)
        grid = (triton.cdiv(out_n, block_n) * triton.cdiv(T, block_t),)
        _small_m_kernel[grid](
            x_q, x_scale, w, w_scale if w_scale is not None else y,
            bias if bias is not None else y, y, T, out_n, K,
            x_q.stride(0), w.stride(0), y.stride(0), res, res_out, norm_w, eps,
            HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=block_t,
            EVEN_N=out_n % block_n == 0, EVEN_K=K % block_k == 0,
            RNE_BF16=INTERPRET_ENV and x.dtype == torch.bfloat16,
            SCALED=quantize is not None, NORM=norm is not None,
            NORM_RES=norm is not None and norm.residual is not None, GATED=gated,
            NORM_K_PAD=triton.cdiv(K, block_k) * block_k if norm is not None else 0,
            num_warps=num_warps, num_stages=num_stages, **pdl.launch(x.device, T))
    return y.reshape(*shape[:-1], out_n)
