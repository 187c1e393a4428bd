"""Decode GEMV: y = x @ W.T (* per-channel scale) (+ bias) for a handful of tokens.

Why: at batch 1 a decode step is a chain of matrix-vector products whose cost is the
weight bytes they read. On an H100 at Qwen3-8B shapes cuBLAS reads bf16 weights at
1.9-2.8 TB/s of the 3.35 peak and a tl.dot weight-only FP8 kernel (since replaced by
kernels/fp8_linear.py's small-M one) e4m3 ones at 1.4-2.2 (tests/gpu/bench_gemv.py): a dot pads one token to 16 rows, and few programs stream long
rows each. Here each program owns BLOCK_N output channels over all of K and reads its rows
once in wide, contiguous loads; many small programs in flight per SM hide the memory
latency. The products run on CUDA cores in float32 (bf16 and e4m3 widen exactly) into a
[T, BLOCK_N, BLOCK_K] accumulator reduced once after the K loop. At one token it is
1.05-1.3x faster than both (the 8B bf16 step 6.47 -> 5.95 ms); at 2-4 tokens the
accumulator crowds registers and cuBLAS wins, so GEMV_MAX_TOKENS is 1.

W may be bf16 / fp16 / fp32 (no scale) or e4m3 with one float32 scale per output channel
(kernels/fp8_linear.py's layout). No host sync, grid from shapes only: CUDA-graph safe.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.interpret import INTERPRET_ENV, cast
from kernels.roundings import norm_input, scale_normed, silu

# Up to this many tokens the model's linear layers take gemv (NANOSERVE_GEMV_MAX_TOKENS=0
# turns it off, for before/after measurements); the token dimension is padded to a power
# of two in registers. The rule that reads both is models/kernel_choice.py's.
GEMV_MAX_TOKENS = int(os.environ.get("NANOSERVE_GEMV_MAX_TOKENS", "1"))
ON_CPU = False   # tests set it to run the model's GEMVs in the Triton interpreter


@dataclass
class GemvLora:
    """One token's LoRA delta, added to the GEMV's output before it is rounded:
    y[n] += scale[s] * (b[s, n] @ h[p(n)*R:(p(n)+1)*R]) with s = slot[0] (-1: none) and p(n)
    the part of column n (kernels/lora.py's layout: b [num_slots, N, R] with the parts' B
    stacked along N, h [1, P*R] float32 from lora_shrink). It saves the separate expand
    launch of every adapted layer at batch 1."""
    h: torch.Tensor                 # [1, P*R] float32 (any strides)
    b: torch.Tensor                 # [num_slots, N, R]
    scale: torch.Tensor             # [num_slots] float32
    slot: torch.Tensor              # [1] int32
    part_sizes: tuple[int, ...]     # P <= 3 sizes summing to N


@dataclass
class GemvNorm:
    """The RMSNorm (and the residual add) before a one-token GEMV, computed in its prologue
    with kernels/rmsnorm.py's numerics: the GEMV reads x (a sublayer's output), adds the
    residual, normalizes with `weight` and multiplies by W, with no norm launch of its own
    and no normalized row in memory. The sum x + residual goes to residual_out, a buffer
    apart: every program reads the residual, so none may write it in place."""
    weight: torch.Tensor                     # [K]
    eps: float
    residual: torch.Tensor | None = None     # [1, K]; None: x itself is normalized
    residual_out: torch.Tensor | None = None # [1, K]: gets x + residual (program 0 writes it)


def norm_args(norm: GemvNorm | None, x2: torch.Tensor) -> tuple:
    """A prologue norm's kernel arguments over rows x2 [T, K]: (residual, residual_out,
    weight, eps), x2 standing in for what is absent, after GemvNorm's contract is checked
    (weight [K]; residual and residual_out both or neither, each x2's shape, contiguous, in
    x2's dtype). The GEMV and kernels/small_m.py take the same."""
    if norm is None:
        return x2, x2, x2, 0.0
    assert norm.weight.shape == (x2.shape[-1],)
    assert (norm.residual is None) == (norm.residual_out is None)
    for r in (norm.residual, norm.residual_out):
        assert r is None or (r.shape == x2.shape and r.is_contiguous() and r.dtype == x2.dtype)
    if norm.residual is None:
        return x2, x2, norm.weight, norm.eps
    return norm.residual, norm.residual_out, norm.weight, norm.eps


def gemv_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (w [N, K] * scale [N, 1]).T + bias, in float32, returned in x's dtype."""
    wf = w.float() if scale is None else w.float() * scale.float().reshape(-1, 1)
    y = x.float() @ wf.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def _normed_x(X, Res, NormW, offs, mask, rstd, HAS_RES: tl.constexpr):
    """[1, len(offs)] of the norm's output (GemvNorm): (x + residual) normalized as
    kernels/rmsnorm.py's kernel does it, in X's dtype."""
    x = norm_input(X, Res, offs, mask, HAS_RES)
    w = tl.load(NormW + offs, mask=mask, other=0.0).to(tl.float32)
    return scale_normed(x, rstd, w).to(x.dtype)[None, :]


@triton.jit
def _norm_rstd(X, Res, ResOut, K, eps, pid, K_PAD: tl.constexpr, HAS_RES: tl.constexpr):
    """1 / rms of the row x (+ residual) over all K, as kernels/rmsnorm.py computes it;
    program 0 writes the sum x + residual to ResOut."""
    offs = tl.arange(0, K_PAD)
    mask = offs < K
    x = norm_input(X, Res, offs, mask, HAS_RES)
    if HAS_RES:
        if pid == 0:
            tl.store(ResOut + offs, x, mask=mask)
    xf = x.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / K + eps)


@triton.jit
def _gemv_kernel(X, W, Scale, Bias, Y, T, N, K, stride_xt, stride_wn, stride_yt,
                 H, LB, LScale, Slot, R, E0, E1, stride_h, stride_bs, stride_bn, HALF,
                 Res, ResOut, NormW, eps,
                 T_PAD: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_LORA: tl.constexpr, GATED: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                 EVEN_K: tl.constexpr, RNE_BF16: tl.constexpr, NORM: tl.constexpr,
                 NORM_RES: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr):
    """Y[t, n] for every token t and the BLOCK_N channels of this program; HAS_LORA (one
    token): plus its adapter's delta (GemvLora; columns from E0 on are part 1, from E1 on
    part 2). EVEN_K: the first weight tile is loaded before the PDL wait (kernels/pdl.py):
    weights are no kernel's output, so they stream while the kernel before finishes.
    GATED (W = [gate; up], HALF rows each): the program's rows are BLOCK_N // 2 channels'
    gate and up rows, interleaved, and it stores silu(gate) * up, rounded as
    kernels/activation.py rounds it: the SwiGLU without its own launch. NORM (one token):
    x is normalized first, the residual added (NORM_RES), in the prologue (GemvNorm)."""
    pid = tl.program_id(0)
    offs_t = tl.arange(0, T_PAD)
    if GATED:
        r = tl.arange(0, BLOCK_N)
        chan = pid * (BLOCK_N // 2) + r // 2
        offs_n = chan + (r % 2) * HALF
        n_mask = chan < HALF
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    t_mask = offs_t < T
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    acc = tl.zeros([T_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    rstd = 0.0
    if EVEN_K:
        w = _load_rows(w_ptrs, n_mask, EVEN_N)
        pdl.wait(PDL)
        if NORM:
            rstd = _norm_rstd(X, Res, ResOut, K, eps, pid, K_PAD, NORM_RES)
            x = _normed_x(X, Res, NormW, offs_k, offs_k < K, rstd, NORM_RES)
        else:
            x = tl.load(x_ptrs, mask=t_mask[:, None], other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w = _load_rows(w_ptrs, n_mask, EVEN_N)
            if NORM:
                x = _normed_x(X, Res, NormW, k0 + offs_k, k0 + offs_k < K, rstd, NORM_RES)
            else:
                x = tl.load(x_ptrs, mask=t_mask[:, None], other=0.0)
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    else:
        pdl.wait(PDL)
        if NORM:
            rstd = _norm_rstd(X, Res, ResOut, K, eps, pid, K_PAD, NORM_RES)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            if NORM:
                x = _normed_x(X, Res, NormW, k0 + offs_k, k_mask, rstd, NORM_RES)
            else:
                x = tl.load(x_ptrs, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)                                   # [T_PAD, BLOCK_N]
    if HAS_SCALE:
        y = y * tl.load(Scale + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        s = tl.load(Slot)
        if s >= 0:
            part = (offs_n >= E0).to(tl.int32) + (offs_n >= E1).to(tl.int32)
            offs_r = tl.arange(0, BLOCK_R)
            rn_mask = n_mask[:, None] & (offs_r < R)[None, :]
            h = tl.load(H + (part[:, None] * R + offs_r[None, :]) * stride_h, mask=rn_mask,
                        other=0.0)
            b = tl.load(LB + s.to(tl.int64) * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn
                        + offs_r[None, :], mask=rn_mask, other=0.0)
            y = y + (tl.sum(h * b.to(tl.float32), axis=1) * tl.load(LScale + s))[None, :]
    dt: tl.constexpr = Y.dtype.element_ty
    if GATED:
        gate, up = tl.split(tl.reshape(y, [T_PAD, BLOCK_N // 2, 2]))
        gate = cast(gate, dt, RNE_BF16).to(tl.float32)
        up = cast(up, dt, RNE_BF16).to(tl.float32)
        act = cast(silu(gate), dt, RNE_BF16).to(tl.float32)
        offs_c = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        y_ptrs = Y + offs_t[:, None].to(tl.int64) * stride_yt + offs_c[None, :]
        tl.store(y_ptrs, cast(act * up, dt, RNE_BF16),
                 mask=t_mask[:, None] & (offs_c < HALF)[None, :])
    else:
        y_ptrs = Y + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
        tl.store(y_ptrs, cast(y, dt, RNE_BF16), mask=t_mask[:, None] & n_mask[None, :])


@triton.jit
def _load_rows(w_ptrs, n_mask, EVEN_N: tl.constexpr):
    if EVEN_N:
        return tl.load(w_ptrs)
    else:
        return tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)


def gemv_config(tokens: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). At one token on an H100 (tests/gpu/bench_gemv.py
    --sweep, bf16 and e4m3) 8 channels x 1024 columns with 4 warps came within ~5% of each
    Qwen3-8B shape's best of 32 tilings (~10% on the 0.6B's small layers); more tokens get
    fewer columns, which keeps the [T, BLOCK_N, BLOCK_K] accumulator in registers."""
    t_pad = triton.next_power_of_2(max(tokens, 1))
    return 8, max(1024 // t_pad, 128), 4


def linear_rows(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """x [..., K] as rows [M, K] (contiguous along K) and N, after the checks every linear
    kernel's wrapper makes of w [N, K] (rows contiguous), an e4m3 w's scale and bias [N]."""
    K = x.shape[-1]
    N = w.shape[0]
    assert w.shape == (N, K) and w.stride(1) == 1, (w.shape, K, w.stride())
    assert scale is not None or w.dtype != torch.float8_e4m3fn, "e4m3 weights need their scale"
    assert bias is None or bias.shape == (N,)
    x2 = x.reshape(-1, K)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), N


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, *, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None,
         lora: GemvLora | None = None, gated: bool = False,
         norm: GemvNorm | None = None) -> torch.Tensor:
    """gemv_ref's values in one launch: x [..., K] (bf16 / fp16 / fp32, rows contiguous),
    w [N, K] contiguous in any float dtype or e4m3 with scale [N, 1] float32, bias [N] or
    None -> [..., N] in x's dtype. Meant for a few tokens (GEMV_MAX_TOKENS). lora (one
    token only) adds that token's adapter delta before the output is rounded. gated (w is
    [gate; up], no bias or lora): silu_and_mul_ref of that output, [..., N // 2].
    norm (one token, no lora): the GEMV of rms_norm(x (+ residual)) (GemvNorm)."""
    shape = x.shape
    x2, N = linear_rows(x, w, scale, bias)
    K = shape[-1]
    T = x2.shape[0]
    assert not gated or (bias is None and lora is None and N % 2 == 0)
    assert norm is None or (T == 1 and lora is None)
    res, res_out, norm_w, eps = norm_args(norm, x2)
    out_n = N // 2 if gated else N
    y = torch.empty(T, out_n, dtype=x.dtype, device=x.device)
    if T and N:
        bn, bk, nw = gemv_config(T)
        bn, bk, nw = block_n or bn, block_k or bk, num_warps or nw
        sc = scale.reshape(-1).contiguous() if scale is not None else None
        if lora is not None:
            S, NB, R = lora.b.shape
            parts = lora.part_sizes
            assert T == 1 and NB == N and sum(parts) == N and 1 <= len(parts) <= 3, \
                (T, lora.b.shape, N, parts)
            assert lora.h.shape[-1] == len(parts) * R and lora.b.stride(2) == 1
            ends = [sum(parts[:i + 1]) for i in range(len(parts) - 1)] + [N, N]
            largs = (lora.h, lora.b, lora.scale, lora.slot, R, ends[0], ends[1],
                     lora.h.stride(-1), lora.b.stride(0), lora.b.stride(1))
        else:
            largs = (y, y, y, y, 1, N, N, 0, 0, 0)
        per_program = bn // 2 if gated else bn   # output columns a program stores
        _gemv_kernel[(triton.cdiv(out_n, per_program),)](
            x2, w, sc if sc is not None else y, bias if bias is not None else y, y,
            T, N, K, x2.stride(0), w.stride(0), y.stride(0), *largs, out_n,
            res, res_out, norm_w, eps,
            T_PAD=triton.next_power_of_2(T), HAS_SCALE=sc is not None,
            HAS_BIAS=bias is not None, HAS_LORA=lora is not None, GATED=gated,
            BLOCK_R=triton.next_power_of_2(max(largs[4], 16)), BLOCK_N=bn, BLOCK_K=bk,
            EVEN_N=out_n % per_program == 0, EVEN_K=K % bk == 0,
            RNE_BF16=INTERPRET_ENV and x.dtype == torch.bfloat16, NORM=norm is not None,
            NORM_RES=norm is not None and norm.residual is not None,
            K_PAD=triton.next_power_of_2(K) if norm is not None else 1,
            num_warps=nw, **pdl.launch(x.device, T))
    return y.reshape(*shape[:-1], out_n)
