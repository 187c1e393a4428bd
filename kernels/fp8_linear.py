"""FP8 weights: e4m3 with one scale per output channel, activations quantized per token.

Why: a decode step at large-model sizes reads every weight once; e4m3 halves those bytes.
Scales are dynamic for activations (each token's amax / 448, computed on the fly, so no
calibration) and per output channel for weights, the scheme vLLM's `--quantization fp8`
uses: y = (x_q @ w_q.T) * sx[token] * sw[channel], the product accumulated in float32.
On sm_89+ GPUs `torch._scaled_mm` does exactly that in one GEMM; elsewhere
`fp8_linear_ref` computes the same values from dequantized operands (the tests' and CPU's
path). For a handful of tokens a Triton kernel with the weight as the dot's left operand
(`fp8_small_m_linear`) is faster still; `fp8_linear` routes by token count. (One decode token
takes kernels/gemv.py instead, weight-only: `fp8_weight_only_ref` gives its values.) Checkpoints published in FP8 (Qwen's: 128 x 128 blocks, `weight_scale_inv`) are
dequantized at load with `dequantize_blocks` and requantized per channel.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.interpret import INTERPRET
from kernels.small_m import small_m_launch

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
@triton.jit
def _to_e4m3(q):
    if INTERPRET:
        a = tl.abs(q)
        quantum = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0) - 3.0)
        n = a / quantum
        f = tl.floor(n)
        odd = f - 2.0 * tl.floor(f * 0.5)   # ties go to the even neighbour (RNE)
        r = tl.where(n - f > 0.5, f + 1.0, tl.where(n - f < 0.5, f, f + odd))
        q = tl.where(q < 0, -1.0, 1.0) * r * quantum
    return q.to(tl.float8e4nv)


@triton.jit
def _row_scale(amax):
    """A row's e4m3 scale from its largest magnitude. div_rn: IEEE division, as torch's
    quantize_rows divides on CPU (a plain `/` compiles to an approximate one on CUDA, which
    rounds a few elements onto the other e4m3 neighbour)."""
    return tl.div_rn(tl.maximum(amax, 1e-12), 448.0)


@triton.jit
def _store_e4m3(y, scale, Q, offs, mask):
    """y / scale, clamped to e4m3's range, stored at Q + offs."""
    q = tl.minimum(tl.maximum(tl.div_rn(y, scale), -448.0), 448.0)
    tl.store(Q + offs, _to_e4m3(q), mask=mask)


@triton.jit
def quantize_store(y, Q, Scale, row, offs, mask):
    """One row y (float32 [BLOCK], zeros where ~mask) -> e4m3 at Q + offs and its scale at
    Scale + row: quantize_rows' values. Shared by the kernels that hand an FP8 GEMM its
    input already quantized (kernels/rmsnorm.py, kernels/activation.py)."""
    scale = _row_scale(tl.max(tl.abs(y), axis=0))
    tl.store(Scale + row, scale)
    _store_e4m3(y, scale, Q, offs, mask)


@triton.jit
def _quantize_rows_kernel(X, Q, Scale, R, K, stride_x, stride_q, BLOCK: tl.constexpr,
                          ONE_BLOCK: tl.constexpr):
    """One row: its amax, then every element / (amax / 448) as e4m3. A row of up to BLOCK
    elements (ONE_BLOCK) is loaded once and kept in registers; a longer one is read twice,
    BLOCK at a time. Rows from R on are padding: they come out zero."""
    row = tl.program_id(0).to(tl.int64)
    real = row < R
    offs = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        x = tl.load(X + row * stride_x + offs, mask=(offs < K) & real, other=0.0).to(tl.float32)
        quantize_store(x, Q + row * stride_q, Scale, row, offs, offs < K)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(X + row * stride_x + k0 + offs, mask=(k0 + offs < K) & real,
                        other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        scale = _row_scale(tl.max(acc, axis=0))
        tl.store(Scale + row, scale)
        for k0 in range(0, K, BLOCK):
            x = tl.load(X + row * stride_x + k0 + offs, mask=(k0 + offs < K) & real,
                        other=0.0).to(tl.float32)
            _store_e4m3(x, scale, Q + row * stride_q + k0, offs, k0 + offs < K)


# A row of up to this many elements is quantized from one load held in registers; the
# two-pass loop of 1,024-wide blocks (longer rows) is latency-bound at decode sizes: Qwen3-8B's
# down projection at 131 tokens, quantization + GEMM, 50.0 -> 43.0 us on an H100
# (tests/gpu/RESULTS.md).
ONE_BLOCK_MAX = 16384


def quantize_rows_(x: torch.Tensor, pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in one kernel launch (the decode path quantizes every linear layer's
    input: five torch ops each cost more than the GEMM saves), the row count rounded up to
    a multiple of pad_rows_to with zero rows."""
    rows, k = x.shape
    assert x.stride(1) == 1
    padded = -(-rows // pad_rows_to) * pad_rows_to
    q = torch.empty(padded, k, dtype=FP8, device=x.device)
    scale = torch.empty(padded, 1, dtype=torch.float32, device=x.device)
    if padded:
        one = k <= ONE_BLOCK_MAX
        block = triton.next_power_of_2(max(k, 1)) if one else 1024
        _quantize_rows_kernel[(padded,)](x, q, scale, rows, k, x.stride(0), q.stride(0),
                                         BLOCK=block, ONE_BLOCK=one,
                                         num_warps=min(16, max(4, block // 1024)))
    return q, scale


@dataclass
class QuantizedRows:
    """An activation x [T, K] with its per-token e4m3 copy (quantize_rows' values), made by
    the kernel that produced x (the RMSNorm or SiLU-and-mul before an FP8 GEMM) so the GEMM
    needs no quantize launch of its own. q and scale have fp8_rows(T) rows, zero past T."""
    x: torch.Tensor
    q: torch.Tensor
    scale: torch.Tensor


def fp8_rows(tokens: int) -> int:
    """How many rows fp8_linear quantizes x into: _scaled_mm's padding past 128 tokens."""
    if tokens > 128:
        return -(-tokens // SCALED_MM_ROW_MULTIPLE) * SCALED_MM_ROW_MULTIPLE
    return tokens


def quantized_rows_ref(x: torch.Tensor) -> QuantizedRows:
    """QuantizedRows of x [T, K] in torch (the CPU path; the kernels' reference)."""
    q, scale = quantize_rows(x)
    pad = fp8_rows(x.shape[0]) - x.shape[0]
    return QuantizedRows(x, torch.cat([q, torch.zeros(pad, x.shape[1], dtype=FP8, device=x.device)]),
                         torch.cat([scale, torch.full((pad, 1), 1e-12 / FP8_MAX, device=x.device)]))


def fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (any float dtype), w_q [N, K] e4m3, w_scale [N, 1] float32 -> [T, N] in x's
    dtype: the per-token-quantized x times the weight, from dequantized operands."""
    x_q, x_scale = quantize_rows(x)
    y = (x_q.float() * x_scale) @ (w_q.float() * w_scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# --- Weight-only FP8 (W8A16, kernels/gemv.py's one token): activations left in their dtype

def fp8_weight_only_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype), w_q [N, K] e4m3, w_scale [N, 1] float32 -> [..., N] in
    x's dtype: x times the dequantized weight, in float32; x itself is not quantized."""
    y = x.float() @ (w_q.float() * w_scale.float().reshape(-1, 1)).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# --- A few tokens (2-16 in the model): kernels/small_m.py's kernel, scaled ---

# Tiles measured on an H100 at Qwen3-8B's four projection shapes, 1 and 8 tokens
# (tests/gpu/bench_fp8_gemv.py, 108 tilings; tests/gpu/RESULTS.md): 64 channels x 256
# columns, 5 stages came within ~4% of each shape's best; 16 token columns is tl.dot's least.
SMALL_M_TILES = dict(block_n=64, block_k=256, block_t=16, num_warps=4, num_stages=5)


def fp8_small_m_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, *, block_n: int = 64,
                       block_k: int = 256, block_t: int = 16, num_warps: int = 4,
                       num_stages: int = 5, xq: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> torch.Tensor:
    """fp8_linear_ref's values for a few tokens in two launches (x quantized per token,
    then kernels/small_m.py's kernel; one where xq = (e4m3 x, scales) comes with x): x [..., K] (any
    float dtype), w_q [N, K] e4m3, w_scale [N, 1] float32, bias [N] or None -> [..., N] in
    x's dtype. No host sync and a grid from shapes only (CUDA-graph capturable)."""
    assert w_q.dtype == FP8 and w_scale.numel() == w_q.shape[0] and w_scale.dtype == torch.float32
    return small_m_launch(x, w_q, bias,
                          lambda x2: xq if xq is not None else quantize_rows_(x2),
                          w_scale.reshape(-1).contiguous(), block_n, block_k, block_t,
                          num_warps, num_stages)


@functools.lru_cache(maxsize=None)
def scaled_mm_supported(device: torch.device) -> bool:
    """Asked by every FP8 linear layer of every eager step: answered once per device."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# Routing measured on an H100 at Qwen3-8B shapes (tests/gpu/bench_fp8_gemv.py --sweep,
# tests/gpu/RESULTS.md): at 8 tokens the small-M kernel (activation quantization
# included) takes 0.60-0.82x the time of quantization + _scaled_mm; at 32 and 64 tokens,
# with 32-token tiles walked fastest (a weight tile read from HBM once), 0.77-0.91x; at
# 131 tokens it is 0.95-1.14x, so _scaled_mm takes over past MID_M_MAX_TOKENS. Its kernel
# for 129-256 rows is 1.3-1.6x slower than for 256: more than 128 rows are padded to 128s.
SMALL_M_MAX_TOKENS = 16
MID_M_MAX_TOKENS = 64
MID_M_TILES = dict(block_n=64, block_k=256, block_t=32, num_warps=8, num_stages=4)
SCALED_MM_ROW_MULTIPLE = 128


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, quantized: QuantizedRows | None = None
               ) -> torch.Tensor:
    """x [..., K] @ the e4m3 weight: fp8_linear_ref's values, from fp8_small_m_linear up to
    MID_M_MAX_TOKENS tokens, else one `torch._scaled_mm` with rowwise scales (sm_89+).
    `quantized` (x's QuantizedRows, x 2-D) saves quantizing x here."""
    if not scaled_mm_supported(x.device):
        return fp8_linear_ref(x, w_q, w_scale, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    xq = (quantized.q, quantized.scale) if quantized is not None else None
    if rows <= MID_M_MAX_TOKENS:
        tiles = SMALL_M_TILES if rows <= SMALL_M_MAX_TOKENS else MID_M_TILES
        return fp8_small_m_linear(x, w_q, w_scale, bias, xq=xq, **tiles)
    x_q, x_scale = xq or quantize_rows_(x2, SCALED_MM_ROW_MULTIPLE if rows > 128 else 1)
    y = torch._scaled_mm(x_q, w_q.T, scale_a=x_scale, scale_b=w_scale.reshape(1, -1),
                         out_dtype=x.dtype, bias=bias)
    return y[:rows].reshape(*shape[:-1], w_q.shape[0])


def dequantize_blocks(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """A block-scaled FP8 checkpoint tensor (Qwen's `weight` + `weight_scale_inv`: one
    scale per block[0] x block[1] tile, edge tiles partial) back to `dtype`."""
    n, k = w_q.shape
    bn, bk = block
    scales = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w_q.float() * scales).to(dtype)
