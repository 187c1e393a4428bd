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
The reference dequantizes, rounds W to x's dtype, then multiplies; both kernels compute
exactly that W (same float32 ops, then the same rounding) and differ only in summation order.

The GEMV (up to GEMV_MAX_TOKENS = 4 rows: decode) is built to stream the packed weights
once at HBM speed (issue 64; the first form, one program per 64 channels per row, reached
2-11% of HBM on an H200):
- Split K: the grid is (N / GEMV_BLOCK_N tiles, K splits), and one program multiplies all
  the rows by its [K_SPLIT, BLOCK_N] slice of W, so each weight byte is read once whatever
  the row count. gemv_splits picks the splits from N, K and bits only (never M, so a row's
  result does not depend on the rows beside it): enough for GEMV_PROGRAMS = 512 programs,
  ~4 per SM on a 132-SM H200 (Qwen3-8B int4: gate_up 192 tiles x 3 splits, down and o_proj 32 x
  16, qkv 48 x 8), each split a whole, even number of chunks. Each program writes its fp32
  partial sums to [splits, M, N] and counts itself on its tile's counter; the tile's last
  split adds the partials in split order (+ bias) and rounds: the sums take no atomics,
  the same bits on every run (--deterministic holds), and one launch (a second kernel for
  the sums cost ~2-3 us a layer, reasoned: with it 0.6B int8 ran 1.78 ms a token against
  bf16's 1.42 in one H200 lease; in one lease without it, 1.68 against 1.76). One split
  writes y directly. No host sync, grid from shapes only: graph safe.
- Chunks: a loop iteration loads two chunks of GEMV_BLOCK_KW = 16 words x BLOCK_N = 128
  channels (2 x 8 KiB of int32, each warp row 512 contiguous bytes, 16-byte loads) before
  using either. A chunk stays in the words' own [16, 128] register layout: value j of every
  word is unpacked at once (a shift and a mask), x's rows k0 + 16w + j are loaded to match,
  and each row m keeps a [16, 128] float32 accumulator (8 registers a thread at 8 warps),
  so nothing crosses threads until the one tl.sum at the program's end. float(q) is taken
  as the bits of 2^23 + q minus 2^23 (exact; an OR and an add instead of a quarter-rate
  int -> float conversion).
- Groups: with GROUP (constexpr, consecutive_group(g_idx): g_idx[k] == g_idx[0] + k //
  GROUP) the kernel loads no g_idx and reduces nothing: a chunk inside one group (GROUP a
  multiple of its rows: g128 for int4 and int8) reads one row of scales and zeros, smaller
  groups one per word. GROUP = 0 (act-order, or a rank starting mid-group) gathers each
  row's scales through g_idx; both paths give bitwise the same sums. quant_linear takes
  group_size from its caller (the model's layer decides it once, models/linear.py) or, when
  None, reads g_idx on the host to decide it (tests, benchmarks: a sync a call).
Measured on an H200 (tests/gpu/RESULTS.md, "int4 / int8 weights"): 8B gate_up int4 at 1 token
40.1 us (28% of HBM; bf16 52.8), down 23.7 (24%); int8 takes the same time for twice the bytes,
so the int4 kernel is bound by the values it handles, not by HBM; the sizes (--sweep of
BLOCK_N, BLOCK_KW, warps, programs) move it by < 10%. At 4 rows it is 2.5x its 1-row time
(254 registers, one program an SM): slower than bf16 there.

The GEMM (prefill, more rows) dequantizes one [BLOCK_K, BLOCK_N] tile of W a K step into
the activation dtype (_dequant_tile_group; kernels/fused_moe.py's experts take its general
path through _dequant_tile) and feeds tl.dot. Measured before this form: 0.14-0.16x bf16
at 256 tokens on an H200 (int4 gate_up 546 us vs cuBLAS 75; down 281 vs 44). Per K step now:
- Groups as the GEMV's: GROUP (constexpr, the same consecutive_group as the GEMV, passed
  for both) > 0 loads no g_idx and reduces nothing across threads (the general path's
  tl.min / tl.max over the tile's g_idx); a tile inside one group (GROUP a multiple of
  BLOCK_K = 64: g64, g128) reads one row of scales and zeros, at g0 + k0 // GROUP (g0 read
  once a program), smaller groups each row's by its computed group. GROUP = 0 (act-order,
  a rank starting mid-group) keeps the g_idx path. Both give bitwise the same W and y.
- float(q) by the 2^23 bit trick (as the GEMV) instead of an int -> float conversion.
- Tiles by M bucket only (gemm_config): up to 16 and 32 rows as before (BLOCK_N 64, 4 warps);
  33-128 rows 64 x 128, above 128 x 128, both 8 warps; BLOCK_K 64 and 3 stages everywhere.
  BLOCK_K 128 spilled (352 B) on sm_90. Measured on an H200 (8B, bf16 cuBLAS against this):
  16 tokens gate_up 58.2 vs 76.7 us, down 30.7 vs 138.7 (N 4096: 64 programs for 132 SMs);
  256 tokens 74.8 vs 199.4 and 46.4 vs 260.4. The gap to bf16 at prefill and large batches
  is open (split-K for narrow N, a Marlin-style dequantization feeding the MMA).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpret import INTERPRET_ENV, cast, dot

BITS = (4, 8)
GEMV_MAX_TOKENS = 4   # up to this many rows the GEMV, above the GEMM (untuned; the GEMV
                      # kernel has one accumulator per row, written out up to 4)
GEMV_BLOCK_N = 128    # output channels a GEMV program (512 B of int32 words a row of a chunk)
GEMV_BLOCK_KW = 16    # packed words along K a chunk: 16 x 128 int32 = 8 KiB, two a loop
GEMV_WARPS = 8
GEMV_PROGRAMS = 512   # K splits aim at this many programs: ~4 a SM on a 132-SM H200
GEMV_FACTOR = True    # one group a chunk: scale a chunk's sums, not each value (see _gemv_chunk)
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
    """[BLOCK_K, BLOCK_N] float32 W of rows k0.. through g_idx (kernels/fused_moe.py's
    experts): _dequant_tile_group's general path."""
    return _dequant_tile_group(QW, S, Z, G, k0, 0, offs_n, n_mask, K, N, BITS, 0, BLOCK_K,
                               BLOCK_N)


@triton.jit
def _dequant_tile_group(QW, S, Z, G, k0, g0, offs_n, n_mask, K, N, BITS: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_K, BLOCK_N] float32 W of rows k0.. (k0 a multiple of BLOCK_K, itself of the
    values a word holds), zero past K. Each packed word is read once and split in registers.
    GROUP > 0 (g_idx[k] == g0 + k // GROUP): nothing of g_idx loaded, nothing reduced; a
    tile inside one group (GROUP a multiple of BLOCK_K) reads one row of scales and zeros,
    smaller groups each row's by its computed group. GROUP = 0 (act-order): g_idx loaded;
    a tile whose rows share one group (found by a min / max) reads one row, others each
    row's. Both paths give the same W bit for bit."""
    PER_WORD: tl.constexpr = 32 // BITS
    offs_w = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    words = tl.load(QW + offs_w[:, None] * N + offs_n[None, :],
                    mask=(offs_w < K // PER_WORD)[:, None] & n_mask[None, :], other=0)
    shifts = tl.arange(0, PER_WORD) * BITS
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)   # row = word * P + j
    # float(q) as the bits of 2^23 + q minus 2^23: exact, an OR and an add where an
    # int -> float conversion runs at a quarter rate (as the GEMV)
    q = tl.reshape(q | 0x4B000000, [BLOCK_K, BLOCK_N]).to(tl.float32, bitcast=True) - 8388608.0
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    if GROUP > 0:
        if GROUP % BLOCK_K == 0:   # the tile lies in group g0 + k0 // GROUP
            g = g0 + k0 // GROUP
            s = tl.load(S + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(Z + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        else:                      # smaller (or uneven) groups: each row's, computed
            rows = (g0 + offs_k // GROUP)[:, None] * N + offs_n[None, :]
            mask = k_mask[:, None] & n_mask[None, :]
            s2 = tl.load(S + rows, mask=mask, other=0.0).to(tl.float32)
            z2 = tl.load(Z + rows, mask=mask, other=0.0).to(tl.float32)
            w = (q - z2) * s2
    else:
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
def _gemv_words(QW, k0, k_end, offs_n, n_mask, N, PER_WORD: tl.constexpr,
                BLOCK_KW: tl.constexpr):
    """The [BLOCK_KW, BLOCK_N] packed words of rows k0.. (zero from k_end on)."""
    offs_w = k0 // PER_WORD + tl.arange(0, BLOCK_KW)
    return tl.load(QW + offs_w[:, None] * N + offs_n[None, :],
                   mask=(offs_w < k_end // PER_WORD)[:, None] & n_mask[None, :], other=0)


@triton.jit
def _gemv_chunk(X, S, Z, G, words, k0, k_end, g0, offs_n, n_mask, N, stride_xm,
                a0, a1, a2, a3, dt: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                ROWS: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK_KW: tl.constexpr,
                FACTOR: tl.constexpr):
    """a_m[w, n] += sum over the P rows k of word w of x[m, k] * W[k, n], W dequantized from
    `words` (rows k0 + w * P + j, j < P) and rounded to dt: every tile stays in the words'
    [BLOCK_KW, BLOCK_N] layout (value j of every word at once, no reshape), and the
    accumulators keep the K axis, so nothing crosses threads until the program's end."""
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KW * PER_WORD
    rows0 = k0 + tl.arange(0, BLOCK_KW) * PER_WORD          # each word's first row
    w_mask = rows0 < k_end
    if GROUP > 0:   # no act-order: row k is in group g0 + k // GROUP, nothing loaded for it
        if GROUP % BLOCK_K == 0:   # the chunk lies in one group: one row of scales, zeros
            g = g0 + k0 // GROUP
            sz_mask = n_mask & (k0 < k_end)
            s = tl.load(S + g * N + offs_n, mask=sz_mask, other=0.0).to(tl.float32)[None, :]
            z = tl.load(Z + g * N + offs_n, mask=sz_mask, other=0.0).to(tl.float32)[None, :]
        else:                      # smaller groups: a word's P rows share one (P | GROUP)
            gw = (g0 + rows0 // GROUP)[:, None] * N + offs_n[None, :]
            sz_mask = w_mask[:, None] & n_mask[None, :]
            s = tl.load(S + gw, mask=sz_mask, other=0.0).to(tl.float32)
            z = tl.load(Z + gw, mask=sz_mask, other=0.0).to(tl.float32)
    if FACTOR and GROUP > 0 and GROUP % BLOCK_K == 0:
        # One group a chunk: sum x * (q - z) over the chunk's rows, then times the group's
        # scale once. Value j of a word is never shifted down: its bits masked in place
        # under float 2^23's exponent are 2^23 + q * 2^(j * BITS) (exact while below 2^23:
        # the word's low half; the high half is shifted by 16 once a word), minus
        # 2^23 + z * 2^(j * BITS) is (q - z) * 2^(j * BITS) exactly, and x's row comes
        # pre-scaled by 2^-(j * BITS). A value costs a mask-or (one LOP3), a subtract and
        # its FMA, against ~9 ALU ops dequantizing it (where a batch-1 int4 GEMV is bound).
        HALF: tl.constexpr = PER_WORD // 2
        c0 = tl.zeros([BLOCK_KW, words.shape[1]], dtype=tl.float32)
        c1 = tl.zeros([BLOCK_KW, words.shape[1]], dtype=tl.float32)
        c2 = tl.zeros([BLOCK_KW, words.shape[1]], dtype=tl.float32)
        c3 = tl.zeros([BLOCK_KW, words.shape[1]], dtype=tl.float32)
        for h in tl.static_range(2):
            wh = words if h == 0 else words >> 16
            for j in tl.static_range(HALF):
                pos = 1 << (j * BITS)   # (a constexpr: j is static)
                f = ((wh & (((1 << BITS) - 1) * pos)) | 0x4B000000).to(
                    tl.float32, bitcast=True) - (z * pos + 8388608.0)
                xk = X + rows0 + h * HALF + j
                c0 += (tl.load(xk, mask=w_mask, other=0.0).to(tl.float32) / pos)[:, None] * f
                if ROWS > 1:
                    c1 += (tl.load(xk + stride_xm, mask=w_mask, other=0.0).to(tl.float32)
                           / pos)[:, None] * f
                if ROWS > 2:
                    c2 += (tl.load(xk + 2 * stride_xm, mask=w_mask, other=0.0).to(tl.float32)
                           / pos)[:, None] * f
                if ROWS > 3:
                    c3 += (tl.load(xk + 3 * stride_xm, mask=w_mask, other=0.0).to(tl.float32)
                           / pos)[:, None] * f
        a0 += c0 * s
        if ROWS > 1:
            a1 += c1 * s
        if ROWS > 2:
            a2 += c2 * s
        if ROWS > 3:
            a3 += c3 * s
        return a0, a1, a2, a3
    for j in tl.static_range(PER_WORD):
        q = (words >> (j * BITS)) & ((1 << BITS) - 1)
        # float(q) as 2^23 + q (q's bits under float 2^23's exponent) minus 2^23: exact,
        # an OR and an add where an int -> float conversion runs at a quarter rate
        f = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        if GROUP == 0:   # act-order: each row's group from g_idx, its scales gathered
            g = tl.load(G + rows0 + j, mask=w_mask, other=0)
            gr = g[:, None] * N + offs_n[None, :]
            sz_mask = w_mask[:, None] & n_mask[None, :]
            s = tl.load(S + gr, mask=sz_mask, other=0.0).to(tl.float32)
            z = tl.load(Z + gr, mask=sz_mask, other=0.0).to(tl.float32)
        w = cast((f - z) * s, dt, RNE_BF16).to(tl.float32)   # the reference's rounding of W
        xk = X + rows0 + j
        a0 += tl.load(xk, mask=w_mask, other=0.0).to(tl.float32)[:, None] * w
        if ROWS > 1:
            a1 += tl.load(xk + stride_xm, mask=w_mask, other=0.0).to(tl.float32)[:, None] * w
        if ROWS > 2:
            a2 += tl.load(xk + 2 * stride_xm, mask=w_mask, other=0.0).to(tl.float32)[:, None] * w
        if ROWS > 3:
            a3 += tl.load(xk + 3 * stride_xm, mask=w_mask, other=0.0).to(tl.float32)[:, None] * w
    return a0, a1, a2, a3


@triton.jit
def _gemv_emit(acc, m, split, Bias, Part, Y, N, stride_ym, offs_n, n_mask,
               ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr,
               DIRECT: tl.constexpr):
    """Row m's [BLOCK_N] sums: y (+ bias) where K is one split, else its fp32 partial."""
    r = tl.sum(acc, axis=0)
    if DIRECT:
        if HAS_BIAS:
            r += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(Y + m * stride_ym + offs_n, cast(r, Y.dtype.element_ty, RNE_BF16), mask=n_mask)
    else:
        tl.store(Part + (split * ROWS + m) * N + offs_n, r, mask=n_mask)


@triton.jit
def _quant_gemv_kernel(X, QW, S, Z, G, Bias, Part, Count, Y, N, K, K_SPLIT, stride_xm, stride_ym,
                       BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr, DIRECT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, FACTOR: tl.constexpr):
    """Program (n tile, split): all ROWS rows of x times rows [split * K_SPLIT, + K_SPLIT)
    of W for BLOCK_N channels; two chunks of BLOCK_KW words loaded per iteration."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KW * PER_WORD
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dt = Y.dtype.element_ty
    k_begin = split * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    g0 = 0
    if GROUP > 0:
        g0 = tl.load(G)            # the rank's first group (row-parallel slices start later)
    a0 = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, 2 * BLOCK_K):
        wa = _gemv_words(QW, k0, k_end, offs_n, n_mask, N, PER_WORD, BLOCK_KW)
        wb = _gemv_words(QW, k0 + BLOCK_K, k_end, offs_n, n_mask, N, PER_WORD, BLOCK_KW)
        a0, a1, a2, a3 = _gemv_chunk(X, S, Z, G, wa, k0, k_end, g0, offs_n, n_mask, N,
                                     stride_xm, a0, a1, a2, a3, dt, BITS, GROUP, ROWS,
                                     RNE_BF16, BLOCK_KW, FACTOR)
        a0, a1, a2, a3 = _gemv_chunk(X, S, Z, G, wb, k0 + BLOCK_K, k_end, g0, offs_n, n_mask,
                                     N, stride_xm, a0, a1, a2, a3, dt, BITS, GROUP, ROWS,
                                     RNE_BF16, BLOCK_KW, FACTOR)
    _gemv_emit(a0, 0, split, Bias, Part, Y, N, stride_ym, offs_n, n_mask, ROWS, HAS_BIAS,
               RNE_BF16, DIRECT)
    if ROWS > 1:
        _gemv_emit(a1, 1, split, Bias, Part, Y, N, stride_ym, offs_n, n_mask, ROWS, HAS_BIAS,
                   RNE_BF16, DIRECT)
    if ROWS > 2:
        _gemv_emit(a2, 2, split, Bias, Part, Y, N, stride_ym, offs_n, n_mask, ROWS, HAS_BIAS,
                   RNE_BF16, DIRECT)
    if ROWS > 3:
        _gemv_emit(a3, 3, split, Bias, Part, Y, N, stride_ym, offs_n, n_mask, ROWS, HAS_BIAS,
                   RNE_BF16, DIRECT)
    if not DIRECT:
        # The tile's last split to finish sums every split's partial in split order (+ bias)
        # and resets the tile's counter: one launch, no atomics on the sums, the same bits
        # whichever split ends last (counted after every thread's stores: release; read
        # past L1: acquire, as kernels/persistent_decode.py's merges)
        tl.debug_barrier()
        splits = tl.num_programs(1)
        if tl.atomic_add(Count + pid_n, 1, sem="acq_rel") == splits - 1:
            for m in tl.static_range(ROWS):
                r = tl.load(Part + m * N + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
                for sp in range(1, splits):
                    r += tl.load(Part + (sp * ROWS + m) * N + offs_n, mask=n_mask, other=0.0,
                                 cache_modifier=".cg")
                if HAS_BIAS:
                    r += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                tl.store(Y + m * stride_ym + offs_n, cast(r, Y.dtype.element_ty, RNE_BF16),
                         mask=n_mask)
            tl.atomic_xchg(Count + pid_n, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, shared by every GEMV call on the device
    (each call's last split resets its tiles' counters; calls run in stream order).
    Allocated at the first (eager) call: a CUDA graph capture must find it made."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < tiles:
        c = _COUNTERS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return c


@triton.jit
def _quant_gemm_kernel(X, QW, S, Z, G, Bias, Y, M, N, K, stride_xm, stride_ym,
                       BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       RNE_BF16: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (m tile, n tile): x[BLOCK_M rows] @ W[:, BLOCK_N channels], one dequantized
    [BLOCK_K, BLOCK_N] tile of W a K step (GROUP: as _dequant_tile_group)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    dt = Y.dtype.element_ty
    g0 = 0
    if GROUP > 0:
        g0 = tl.load(G)            # the rank's first group (row-parallel slices start later)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = cast(_dequant_tile_group(QW, S, Z, G, k0, g0, offs_n, n_mask, K, N, BITS, GROUP,
                                     BLOCK_K, BLOCK_N), dt, RNE_BF16)
        acc = dot(x, w, acc, PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], cast(acc, dt, RNE_BF16),
             mask=m_mask[:, None] & n_mask[None, :])


def gemm_config(M: int) -> dict:
    """The GEMM's tiles from M's bucket only (a row's sums never depend on its neighbours
    within a bucket). Measured: see the module docstring."""
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    if M <= 32:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    if M <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def consecutive_group(g_idx: torch.Tensor) -> int:
    """GS > 0 where g_idx[k] == g_idx[0] + k // GS for every k (no act-order, and the rank's
    rows start a group: the GEMV's constexpr path), else 0 (act-order: the general path).
    One group over all rows gives GS = len(g_idx). Reads g_idx on the host (a sync): decide
    once, at load, not per call."""
    g = g_idx.detach().to("cpu", torch.int64)
    if g.numel() == 0:
        return 0
    other = (g != g[0]).nonzero()
    group = int(other[0, 0]) if other.numel() else g.numel()
    trivial = torch.equal(g, g[0] + torch.arange(g.numel()) // group)
    return group if trivial else 0


def gemv_splits(N: int, K: int, bits: int, splits: int | None = None) -> tuple[int, int]:
    """(K splits, rows a split) of the GEMV: from the shapes only (so a row's result does not
    depend on how many rows share the call), enough programs for GEMV_PROGRAMS, each split a
    whole number of chunks (even, unless `splits` is forced: tests)."""
    rows = GEMV_BLOCK_KW * (32 // bits)
    chunks = max(1, triton.cdiv(K, rows))
    if splits is None:
        splits = max(1, min(triton.cdiv(GEMV_PROGRAMS, triton.cdiv(N, GEMV_BLOCK_N)), chunks // 2))
        per = triton.cdiv(triton.cdiv(chunks, splits), 2) * 2
    else:
        per = triton.cdiv(chunks, max(1, splits))
    return triton.cdiv(chunks, per), per * rows


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None, group_size: int | None = None,
                 splits: int | None = None) -> torch.Tensor:
    """x [..., K] @ W + bias in x's dtype: the GEMV up to GEMV_MAX_TOKENS rows, else the GEMM.
    group_size: consecutive_group(g_idx) as the caller decided it at load (0: act-order, the
    general path); None: decided here at g_idx's first call and kept on the tensor.
    splits: force the GEMV's K splits (tests); None: gemv_splits' choice."""
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
        rne = INTERPRET_ENV and x.dtype == torch.bfloat16
        common = dict(BITS=bits, HAS_BIAS=bias is not None, RNE_BF16=rne)
        b = bias if bias is not None else scales
        group = consecutive_group(g_idx) if group_size is None else group_size
        group = max(group, 0)     # 0: the general path (bitwise the same sums, slower)
        if M <= min(GEMV_MAX_TOKENS, 4):   # the GEMV kernel's 4 row accumulators
            if group % (32 // bits):
                group = 0
            n_splits, k_split = gemv_splits(N, K, bits, splits)
            direct = n_splits == 1
            part = y if direct else torch.empty(n_splits, M, N, dtype=torch.float32,
                                                device=x.device)
            tiles = triton.cdiv(N, GEMV_BLOCK_N)
            _quant_gemv_kernel[(tiles, n_splits)](
                x2, qweight, scales, zeros, g_idx, b, part, _tile_counters(x.device, tiles), y,
                N, K, k_split,
                x2.stride(0), y.stride(0), GROUP=group, ROWS=M, DIRECT=direct,
                BLOCK_N=GEMV_BLOCK_N, BLOCK_KW=GEMV_BLOCK_KW, FACTOR=GEMV_FACTOR,
                num_warps=GEMV_WARPS, **common)
        else:
            cfg = gemm_config(M)
            _quant_gemm_kernel[(triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))](
                x2, qweight, scales, zeros, g_idx, b, y, M, N, K, x2.stride(0), y.stride(0),
                GROUP=group, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                **cfg, **common)
    return y.reshape(*x.shape[:-1], N)
