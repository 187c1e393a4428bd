"""Triton paged attention over a [num_blocks, block_size, Hkv, D] KV cache, addressed by its
strides (the worker's is head-major: kernels.attention.new_kv_cache).

Reference: `kernels.attention.paged_attention_ref`. Two kernels:

* `paged_decode`: one query token per sequence. One program per (sequence, kv head,
  split) holds all `group = Hq // Hkv` query heads of that kv head, so each K/V tile is
  loaded once for the whole group (decode is memory-bound: K/V bytes are the cost).
  Keys are walked in tiles of BLOCK_N tokens, so the tile size is independent of the
  page size (16 or 256 both work): a tile inside one page looks it up once, else per key.
  With num_splits > 1 the context is cut into that many chunks (flash-decoding) and the
  last of a (sequence, kv head)'s split programs to finish merges their partial results
  by their log-sum-exp (a counter per pair; a second kernel where a program takes a run
  of rows); the chunk length is derived in-kernel from the real context length, so a
  fixed num_splits is correct for any context (CUDA-graph safe). Split, keys are walked
  32 at a time below 8 rows: at a 256-token context a batch-1 step has 8 programs a kv
  head at work, not 2 (one H200, Qwen3-0.6B graph replay 0.901 -> 0.854 ms at batch 1,
  1.305 -> 1.271 at 8); from 8 rows 64 at a time on 2 warps (_tile_and_warps); where a
  program takes one row, the merge's launch is gone too.
* `paged_prefill`: ragged query blocks (cu_seqlens_q); sequence i's queries sit at
  positions context_len - q_len .. context_len - 1 and attend causally to its whole paged
  context, so a prefix-cache hit only queries the uncached suffix. Rows of a program are
  (query token, group head) pairs so the group shares K/V tiles here too.

Both use an online softmax in base 2 (exp2, scale folded with log2(e)) and fp32
accumulators. Block ids are widened to int64 before scaling by the page stride. Both
read an fp8 cache too (kernels/kv_quant.py): e4m3 tiles are widened to fp16 (exact, and
one instruction per pair on sm_89+, where widening to bf16 takes three), q is rounded to
fp16 (more mantissa than bf16), each key's scale multiplies its score column, each
value's scale the probability column that weighs it. fp32 inputs (CPU tests) stay fp32.
Decode reads the fp8 cache as uint16 pairs (`_attend_tile_fp8`): Triton moves a
transposed fp8 key tile through shared memory byte by byte and holds it twice in
registers (200 registers a thread, 2 programs per SM); pairs keep every move 16-bit wide
(on an H100: decode attention 286 -> 234 us at batch 256, contexts U[100, 2048]).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.interpret import INTERPRET
from kernels.kv_quant import check_cache
from kernels.qk_norm_rotary import NormRotary, norm_rotate_rows

LOG2E = 1.4426950408889634


@triton.jit
def _tile_rows(table, start, offs_n, n_mask, kv_head, stride_cb, stride_cs, stride_ch,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cache row offsets (of this kv head) and slots (fp8 scales) of the tile's keys. Tiles
    start at multiples of BLOCK_N, so when pages hold whole tiles (page 256 on GPUs) a tile
    is one page: one scalar block-table load and contiguous rows, nothing the K/V loads
    must wait for per key. Smaller pages are looked up per key."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(table + start // PAGE_SIZE).to(tl.int64)
        in_page = start % PAGE_SIZE + tl.arange(0, BLOCK_N)
    else:
        page = tl.load(table + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
    return (page * stride_cb + in_page * stride_cs + kv_head * stride_ch,
            page * PAGE_SIZE + in_page)


@triton.jit
def _softmax_step(s, m_i, l_i, SAFE: tl.constexpr = False):
    """Fold one tile's base-2 scores s [rows, N] into the online softmax: (new running
    max, the factor rescaling what was accumulated, the tile's weights p, new running
    sum). Every tile a caller walks holds a key visible to every row (decode: all of
    them; prefill: key 0 in the first tile), so the max is finite from the first tile on.
    SAFE: not so (a decode run's earlier rows may see no key of a split): a row that has
    seen no key yet keeps m = -inf, weight 0, instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_tile(q, q_pos, m_i, l_i, acc, KCache, VCache, KScale, VScale, table, start, hi,
                 kv_head, stride_cb, stride_cs, stride_ch, offs_d, d_mask, qk_scale_log2,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 FP8: tl.constexpr, MASKED: tl.constexpr = True, SAFE: tl.constexpr = False):
    """One BLOCK_N tile of keys [start, start + BLOCK_N) ∩ [0, hi) gathered through the
    block table, folded into the online softmax of the query rows (row r sees keys up to
    q_pos[r]). Returns the new (m_i, l_i, acc). MASKED=False: the caller knows every key
    of the tile is below hi and visible to every row, and the head dim needs no padding
    (no masks on loads or scores)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    row, slot = _tile_rows(table, start, offs_n, n_mask, kv_head, stride_cb, stride_cs,
                           stride_ch, PAGE_SIZE, BLOCK_N)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    if MASKED:
        k = tl.load(KCache + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(KCache + row[:, None] + offs_d[None, :])
    if FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2   # [rows, N]
    if FP8:
        s = s * tl.load(KScale + slot, mask=n_mask, other=0.0)[None, :]
    if MASKED:
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i, SAFE)
    if MASKED:
        v = tl.load(VCache + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        v = tl.load(VCache + row[:, None] + offs_d[None, :])
    if FP8:
        p_v = p * tl.load(VScale + slot, mask=n_mask, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p_v.to(q.dtype), v.to(q.dtype),
                                            input_precision=PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _e4m3_pairs_to_f16(x):
    """uint16 holding two e4m3 values (dim 2j in the low byte, 2j + 1 in the high one) ->
    (even, odd) fp16 tensors, exact. On the GPU one cvt.rn.f16x2.e4m3x2 per pair; in the
    interpreter the bits are moved into place (e4m3 x 2^-8 is an fp16 with the same sign
    and mantissa, subnormals included) and scaled back by 256."""
    if INTERPRET:   # the CPU tests' interpreter runs no PTX
        even = (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.float16, bitcast=True)
        odd = ((x & 0x8000) | ((x & 0x7F00) >> 1)).to(tl.float16, bitcast=True)
        return even * 256.0, odd * 256.0
    else:
        even, odd = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        return even, odd


@triton.jit
def _attend_tile_fp8(q_e, q_o, q_pos, m_i, l_i, acc_e, acc_o, KCache, VCache, KScale, VScale,
                     table, start, hi, kv_head, stride_cb, stride_cs, stride_ch, offs_h, h_mask,
                     qk_scale_log2, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    """_attend_tile for decode queries over an fp8 cache viewed as uint16 pairs: even and
    odd head dims are separate [N, D/2] fp16 tiles (two dots each for QK and PV). Moving
    whole 16-bit pairs keeps every tile load and layout change 16-bit wide, where Triton
    moves a transposed fp8 tile byte by byte and holds twice the registers. CAUSAL: the
    rows are a run of one sequence's tokens, row r sees keys up to q_pos[r]; else every
    key below hi."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    row, slot = _tile_rows(table, start, offs_n, n_mask, kv_head, stride_cb, stride_cs,
                           stride_ch, PAGE_SIZE, BLOCK_N)
    kv_mask = n_mask[:, None] & h_mask[None, :]
    k_e, k_o = _e4m3_pairs_to_f16(tl.load(KCache + row[:, None] + offs_h[None, :],
                                          mask=kv_mask, other=0))
    s = tl.dot(q_e, tl.trans(k_e.to(q_e.dtype)), input_precision=PRECISION)
    s = tl.dot(q_o, tl.trans(k_o.to(q_e.dtype)), s, input_precision=PRECISION)
    s = s * (tl.load(KScale + slot, mask=n_mask, other=0.0) * qk_scale_log2)[None, :]
    if CAUSAL:
        s = tl.where(n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    else:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i, CAUSAL)
    v_e, v_o = _e4m3_pairs_to_f16(tl.load(VCache + row[:, None] + offs_h[None, :],
                                          mask=kv_mask, other=0))
    p_v = (p * tl.load(VScale + slot, mask=n_mask, other=0.0)[None, :]).to(q_e.dtype)
    acc_e = acc_e * alpha[:, None] + tl.dot(p_v, v_e.to(q_e.dtype), input_precision=PRECISION)
    acc_o = acc_o * alpha[:, None] + tl.dot(p_v, v_o.to(q_e.dtype), input_precision=PRECISION)
    return m_new, l_i, acc_e, acc_o


# The block table's row stride is the batch's longest table in pages, so it changes from
# batch to batch, and Triton compiles a variant for a stride of 1 and for multiples of 16
# the first time each appears: requests waited on the compiler while serving (on an H100,
# a fresh server's first online run had a TTFT p99 of 1.38 s, 0.16 s without). Not
# specialized, each kernel compiles once, at startup. Decode's split count changes with
# the batch too when decode runs eagerly (--enforce-eager; graphs fix it per bucket): a
# runtime int, so splitting or not is its only variant (as a constexpr it made up to 16,
# each compiled mid-serving).
_BY_BATCH = ["stride_bt"]


@triton.jit(do_not_specialize=_BY_BATCH + ["num_splits", "num_rows"])
def _decode_kernel(
    Q, KCache, VCache, KScale, VScale, Out, BlockTables, ContextLens, Runs, PartOut, PartLse,
    Counters, num_heads, num_rows, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,      # page, slot-in-page, kv-head strides of the caches
    stride_bt,
    qk_scale_log2, num_splits,
    KNew, VNew, QW, KW, CosSin, SlotMapping, eps,   # PROLOGUE's (NormRotary)
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,   # SPLIT: num_splits > 1
    Q_FP16: tl.constexpr, RUNS: tl.constexpr,   # RUNS > 1: rows per program (see paged_decode)
    MERGE: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
    PROLOGUE: tl.constexpr = False, HALF: tl.constexpr = 1, BLOCK_HALF: tl.constexpr = 1,
):
    """MERGE (SPLIT, one row a program): the split programs of a (row, kv head) count
    themselves in Counters, and the last to finish merges their parts (_merge_head, the
    merge kernel's arithmetic) and re-arms the counter: no merge kernel's launch.
    PROLOGUE (bf16 / fp16 cache): Q, KNew and VNew are the qkv projection's raw heads; the
    program normalizes and rotates its queries itself, and stores the new K/V of its rows
    whose positions fall in its own key range before reading that range (a barrier
    between): no other program reads those keys, so the q/k norm + rotary + KV store
    kernel's launch is gone."""
    pdl.wait(PDL)
    seq = tl.program_id(0)    # the program's (first) row
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    if RUNS > 1:   # rows seq .. seq + n - 1 are one sequence's consecutive tokens
        place = tl.load(Runs + seq)                        # the row's place in its run
        if place % RUNS != 0:
            return                                         # an earlier row's program has it
        n = tl.minimum(tl.load(Runs + num_rows + seq), RUNS)   # rows left in the run
        rows = seq + offs_g // GROUP
        g_mask = offs_g < n * GROUP
        row_ctx = tl.load(ContextLens + rows, mask=g_mask, other=0)
        ctx = tl.max(row_ctx, 0)
        q_pos = row_ctx - 1
    else:
        rows = seq + offs_g * 0
        g_mask = offs_g < GROUP
        ctx = tl.load(ContextLens + seq)
        q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (ctx - 1)   # the one query sees all keys
    # Chunk of the context this split owns, rounded up to whole tiles.
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(ctx, lo + chunk)

    heads = kv_head * GROUP + offs_g % GROUP
    q_row = Q + rows.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    if FP8:   # KCache/VCache are uint16 views (two e4m3 per element): even/odd dims apart
        offs_h = tl.arange(0, BLOCK_D // 2)
        h_mask = offs_h < HEAD_DIM // 2
        q_mask = g_mask[:, None] & h_mask[None, :]
        q_e = tl.load(q_row + 2 * offs_h[None, :], mask=q_mask, other=0.0)
        q_o = tl.load(q_row + 2 * offs_h[None, :] + 1, mask=q_mask, other=0.0)
        if Q_FP16:                       # fp8 K/V tiles are widened to fp16 (see above)
            q_e = q_e.to(tl.float16)
            q_o = q_o.to(tl.float16)
        acc_e = tl.zeros([GROUP_PAD, BLOCK_D // 2], dtype=tl.float32)
        acc_o = tl.zeros([GROUP_PAD, BLOCK_D // 2], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc_e, acc_o = _attend_tile_fp8(
                q_e, q_o, q_pos, m_i, l_i, acc_e, acc_o, KCache, VCache, KScale, VScale, table,
                start, hi, kv_head, stride_cb, stride_cs, stride_ch, offs_h, h_mask,
                qk_scale_log2, PAGE_SIZE, BLOCK_N, PRECISION, RUNS > 1)
        # An empty split (or a zero-length padding sequence) leaves l_i == 0: emit zeros.
        denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
        _emit(acc_e / denom, 2 * offs_h, q_mask, Out, PartOut, rows, heads, split, num_heads,
              stride_ot, stride_oh, num_splits, BLOCK_D, SPLIT)
        _emit(acc_o / denom, 2 * offs_h + 1, q_mask, Out, PartOut, rows, heads, split, num_heads,
              stride_ot, stride_oh, num_splits, BLOCK_D, SPLIT)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        if PROLOGUE:
            _store_new_kv(KNew, VNew, KW, CosSin, SlotMapping, ContextLens, KCache, VCache,
                          Runs, seq, kv_head, num_rows, lo, hi, eps, stride_kt, stride_kh,
                          stride_vt, stride_vh, stride_cos, stride_cb, stride_cs, stride_ch,
                          HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF, PAGE_SIZE, RUNS)
            at = tl.maximum(q_pos, 0).to(tl.int64)[:, None] * stride_cos   # (padding: ctx 0)
            q = norm_rotate_rows(q_row, g_mask, QW, CosSin + at, eps, HEAD_DIM, BLOCK_D, HALF,
                                 BLOCK_HALF).to(Q.dtype.element_ty)
        else:
            q = tl.load(q_row + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, q_pos, m_i, l_i, acc, KCache, VCache, KScale, VScale,
                                         table, start, hi, kv_head, stride_cb, stride_cs,
                                         stride_ch, offs_d, d_mask, qk_scale_log2, PAGE_SIZE,
                                         BLOCK_N, PRECISION, FP8, SAFE=RUNS > 1)
        denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
        _emit(acc / denom, offs_d, g_mask[:, None] & d_mask[None, :], Out, PartOut, rows, heads,
              split, num_heads, stride_ot, stride_oh, num_splits, BLOCK_D, SPLIT)
    if SPLIT:
        # PartLse [S, Hq, num_splits], contiguous.
        part = (rows * num_heads + heads).to(tl.int64) * num_splits + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(PartLse + part, lse, mask=g_mask)
    if MERGE:
        # Every thread's parts are stored before one thread's release (the barrier), and
        # the last program reads the others' parts from L2 (.cg), past its acquire.
        tl.debug_barrier()
        counter = Counters + seq * (num_heads // GROUP) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)
            for g in tl.static_range(GROUP):
                _merge_head(Out, PartOut, PartLse, seq, kv_head * GROUP + g, stride_ot,
                            stride_oh, num_heads, num_splits, HEAD_DIM, BLOCK_D, SPLITS_PAD)


@triton.jit
def _store_new_kv(KNew, VNew, KW, CosSin, SlotMapping, ContextLens, KCache, VCache, Runs, seq,
                  kv_head, num_rows, lo, hi, eps, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_cos, stride_cb, stride_cs, stride_ch, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, RUNS: tl.constexpr):
    """PROLOGUE: the new K (normalized, rotated) and V of kv_head for the program's rows
    (its run's, RUNS > 1) whose positions lie in [lo, hi), stored as
    kernels/qk_norm_rotary.py stores them; then a barrier, so the program's own tile loads
    see them."""
    offs_r = tl.arange(0, RUNS)
    if RUNS > 1:
        r_mask = offs_r < tl.minimum(tl.load(Runs + num_rows + seq), RUNS)
    else:
        r_mask = offs_r < 1
    rows = seq + offs_r
    ctx = tl.load(ContextLens + rows, mask=r_mask, other=0)
    slot = tl.load(SlotMapping + rows, mask=r_mask, other=-1).to(tl.int64)
    own = r_mask & (ctx > lo) & (ctx <= hi) & (slot >= 0)   # position ctx - 1 in [lo, hi)
    k = norm_rotate_rows(KNew + rows.to(tl.int64)[:, None] * stride_kt + kv_head * stride_kh, own,
                         KW, CosSin + (ctx - 1).to(tl.int64)[:, None] * stride_cos, eps,
                         HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF)
    offs_d = tl.arange(0, BLOCK_D)
    mask = own[:, None] & (offs_d < HEAD_DIM)[None, :]
    v = tl.load(VNew + rows.to(tl.int64)[:, None] * stride_vt + kv_head * stride_vh
                + offs_d[None, :], mask=mask, other=0.0)
    dst = ((slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
           + kv_head * stride_ch)[:, None] + offs_d[None, :]
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + dst, v, mask=mask)
    tl.debug_barrier()


@triton.jit
def _emit(out, cols, mask, Out, PartOut, rows, heads, split, num_heads, stride_ot, stride_oh,
          num_splits, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr):
    """Store a decode program's output columns `cols` of its (row, head) pairs: to Out, or
    with splits to PartOut [S, Hq, num_splits, BLOCK_D] (contiguous, fp32) for the merge."""
    if not SPLIT:
        dst = (Out + rows.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
               + cols[None, :])
        tl.store(dst, out.to(Out.dtype.element_ty), mask=mask)
    else:
        part = (rows * num_heads + heads).to(tl.int64) * num_splits + split
        tl.store(PartOut + part[:, None] * BLOCK_D + cols[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    Out, PartOut, PartLse, stride_ot, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """Combine the splits of one (sequence, query head) by their base-2 log-sum-exp."""
    pdl.wait(PDL)
    _merge_head(Out, PartOut, PartLse, tl.program_id(0), tl.program_id(1), stride_ot, stride_oh,
                num_heads, num_splits, HEAD_DIM, BLOCK_D, SPLITS_PAD)


@triton.jit
def _merge_head(Out, PartOut, PartLse, seq, head, stride_ot, stride_oh, num_heads, num_splits,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Out[seq, head] from its num_splits parts, weighted by their base-2 log-sum-exp."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = (seq * num_heads + head).to(tl.int64) * num_splits
    lse = tl.load(PartLse + base + offs_s, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - lse_max))
    parts = tl.load(PartOut + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                    mask=s_mask[:, None], other=0.0, cache_modifier=".cg")
    out = tl.sum(parts * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(Out + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _attend_keys(q, q_pos, lo, hi, full, KCache, VCache, KScale, VScale, table, kv_head,
                 stride_cb, stride_cs, stride_ch, offs_d, d_mask, qk_scale_log2,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 FP8: tl.constexpr, SAFE: tl.constexpr):
    """The online softmax of keys [lo, hi) (lo a multiple of BLOCK_N) from a fresh state:
    tiles wholly below `full` (every key visible to every row) unmasked, the rest masked.
    SAFE (the split paths: --deterministic): a row may see no key of the range (a split
    past its position), and every tile is masked: compiled, the two loops round a tile
    differently (on an H200 a prompt's second chunk differed from the whole prompt by
    2.4e-7 at layer 0's attention), and where `full` falls depends on the chunk."""
    if SAFE:
        full = lo
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, tl.minimum(full, hi), BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, q_pos, m_i, l_i, acc, KCache, VCache, KScale, VScale,
                                     table, start, hi, kv_head, stride_cb, stride_cs, stride_ch,
                                     offs_d, d_mask, qk_scale_log2, PAGE_SIZE, BLOCK_N,
                                     PRECISION, FP8, MASKED=HEAD_DIM != BLOCK_D, SAFE=SAFE)
    for start in range(tl.maximum(lo, full), hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, q_pos, m_i, l_i, acc, KCache, VCache, KScale, VScale,
                                     table, start, hi, kv_head, stride_cb, stride_cs, stride_ch,
                                     offs_d, d_mask, qk_scale_log2, PAGE_SIZE, BLOCK_N,
                                     PRECISION, FP8, SAFE=SAFE)
    return m_i, l_i, acc


@triton.jit
def _split_result(m_i, l_i, acc):
    """One split's (output, base-2 log-sum-exp); a row that saw no key: (0, -inf)."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def _merge_split(m, w, acc, o, lse):
    """Fold one split (o, lse) into the running (max, weight sum, weighted sum): the same
    arithmetic, splits in index order, in paged_prefill's programs and in
    _split_merge_kernel, so both give one row the same bits. An empty split is a no-op."""
    m_new = tl.maximum(m, lse)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m - m_use)
    b = tl.exp2(lse - m_use)
    return m_new, w * a + b, acc * a[:, None] + o * b[:, None]


@triton.jit(do_not_specialize=_BY_BATCH + ["num_kv_heads", "num_splits"])
def _prefill_kernel(
    Q, KCache, VCache, KScale, VScale, Out, BlockTables, ContextLens, CuSeqlensQ,
    PartOut, PartLse,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    qk_scale_log2, num_heads, num_kv_heads, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TOKENS: tl.constexpr, PRECISION: tl.constexpr,   # TOKENS = BLOCK_M // GROUP query tokens
    FP8: tl.constexpr, Q_FP16: tl.constexpr,
    SPLIT_LEN: tl.constexpr, PARTIAL: tl.constexpr,
):
    """SPLIT_LEN 0: one online softmax over every key. Else the keys are cut into splits of
    SPLIT_LEN from key 0, each reduced from a fresh state and merged in order
    (_merge_split): in turn inside the program, or, PARTIAL, one split per program (grid
    axis 2 = split * num_kv_heads + kv head) written to PartOut / PartLse for
    _split_merge_kernel. PARTIAL rows are one per sequence (a decode step): a split past the
    row's context writes nothing, as the merge stops at the row's last split."""
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    if PARTIAL:
        kv_head = tl.program_id(2) % num_kv_heads
        split = tl.program_id(2) // num_kv_heads
    else:
        kv_head = tl.program_id(2)
        split = 0
    q_start = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_start
    if q_block * TOKENS >= q_len:
        return
    ctx = tl.load(ContextLens + seq)

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * TOKENS + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < TOKENS * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if Q_FP16:                           # fp8 K/V tiles are widened to fp16 (see above)
        q = q.to(tl.float16)
    q_pos = ctx - q_len + tok                        # absolute position of each row's token
    # Keys past the last query position of this program are never visible.
    hi = tl.minimum(ctx, ctx - q_len + (q_block + 1) * TOKENS)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    # Tiles wholly below the diagonal (every key visible to every row: keys up to the
    # program's first query position) run unmasked, the rest masked.
    full = (ctx - q_len + q_block * TOKENS + 1) // BLOCK_N * BLOCK_N
    if SPLIT_LEN == 0:
        m_i, l_i, acc = _attend_keys(q, q_pos, 0, hi, full, KCache, VCache, KScale, VScale,
                                     table, kv_head, stride_cb, stride_cs, stride_ch, offs_d,
                                     d_mask, qk_scale_log2, HEAD_DIM, BLOCK_D, BLOCK_M,
                                     PAGE_SIZE, BLOCK_N, PRECISION, FP8, False)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]   # a padding row (context 0): zeros
    elif PARTIAL:
        lo = split * SPLIT_LEN
        if lo >= hi:   # past the context (a graph's grid covers max_model_len)
            return
        m_i, l_i, acc = _attend_keys(q, q_pos, lo, tl.minimum(hi, lo + SPLIT_LEN), full,
                                     KCache, VCache, KScale, VScale, table, kv_head, stride_cb,
                                     stride_cs, stride_ch, offs_d, d_mask, qk_scale_log2,
                                     HEAD_DIM, BLOCK_D, BLOCK_M, PAGE_SIZE, BLOCK_N, PRECISION,
                                     FP8, True)
        o, lse = _split_result(m_i, l_i, acc)
        part = (q_rows * num_heads + heads) * num_splits + split   # [T, Hq, splits]
        tl.store(PartOut + part[:, None] * BLOCK_D + offs_d[None, :], o,
                 mask=row_mask[:, None])
        tl.store(PartLse + part, lse, mask=row_mask)
    else:
        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        w_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_run = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for lo in range(0, hi, SPLIT_LEN):
            m_i, l_i, acc = _attend_keys(q, q_pos, lo, tl.minimum(hi, lo + SPLIT_LEN), full,
                                         KCache, VCache, KScale, VScale, table, kv_head,
                                         stride_cb, stride_cs, stride_ch, offs_d, d_mask,
                                         qk_scale_log2, HEAD_DIM, BLOCK_D, BLOCK_M, PAGE_SIZE,
                                         BLOCK_N, PRECISION, FP8, True)
            o, lse = _split_result(m_i, l_i, acc)
            m_run, w_run, acc_run = _merge_split(m_run, w_run, acc_run, o, lse)
        out = acc_run / tl.where(w_run > 0, w_run, 1.0)[:, None]
    if not PARTIAL:   # (a partial program's result went to PartOut; `out` is not defined
        #               there, which the compiler, unlike the interpreter, sees)
        dst = Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(Out.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _split_merge_kernel(Out, PartOut, PartLse, ContextLens, stride_ot, stride_oh, num_heads,
                        num_splits, SPLIT_LEN: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, HEADS_PAD: tl.constexpr):
    """One row's heads (row = sequence: a decode step): its splits merged in index order by
    _merge_split, up to the last that holds a key of its context. The splits past it are
    empty, and merging an empty split changes no bit, so stopping there (not at the
    grid's num_splits, sized for max_model_len under CUDA graphs) gives the same result."""
    row = tl.program_id(0)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_heads
    base = (row * num_heads + offs_h).to(tl.int64) * num_splits
    m_run = tl.full([HEADS_PAD], float("-inf"), dtype=tl.float32)
    w_run = tl.zeros([HEADS_PAD], dtype=tl.float32)
    acc_run = tl.zeros([HEADS_PAD, BLOCK_D], dtype=tl.float32)
    used = tl.minimum(tl.cdiv(tl.load(ContextLens + row), SPLIT_LEN), num_splits)
    for s in range(0, used):
        lse = tl.load(PartLse + base + s, mask=h_mask, other=float("-inf"))
        o = tl.load(PartOut + (base + s)[:, None] * BLOCK_D + offs_d[None, :],
                    mask=h_mask[:, None], other=0.0)
        m_run, w_run, acc_run = _merge_split(m_run, w_run, acc_run, o, lse)
    out = acc_run / tl.where(w_run > 0, w_run, 1.0)[:, None]
    dst = Out + row.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, out.to(Out.dtype.element_ty), mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


def _check_common(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor) -> tuple[int, int]:
    assert q.dim() == 3 and q.stride(-1) == 1, "q must be [T, Hq, D] with contiguous last dim"
    assert k_cache.stride() == v_cache.stride() and k_cache.shape == v_cache.shape
    assert k_cache.stride(-1) == 1 and k_cache.shape[3] == q.shape[2]
    assert block_tables.stride(-1) == 1, "block_tables rows must be contiguous"
    num_kv_heads = k_cache.shape[2]
    assert q.shape[1] % num_kv_heads == 0
    return num_kv_heads, q.shape[1] // num_kv_heads


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision dot (no TF32), so fp32 runs match the reference closely.
    return "ieee" if dtype == torch.float32 else "tf32"


MAX_SPLITS = 16       # default_num_splits' cap; the merge kernel is compiled for this many


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int,
                       device: torch.device) -> int:
    """Split the context only when (seqs x kv heads) cannot fill the GPU and contexts are long."""
    if device.type != "cuda" or max_seqlen_k <= 512:
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    programs = num_seqs * num_kv_heads
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(max_seqlen_k, 256), MAX_SPLITS))


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernel (tests/gpu/bench_decode_attention.py sweeps it);
    None picks by the launch (_tile_and_warps)."""
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int = 2


SPLIT_WIDE_ROWS = 8   # from this many rows a split launch takes 64-key tiles and 2 warps


def _tile_and_warps(cfg: DecodeConfig, head_dim: int, num_splits: int,
                    num_seqs: int) -> tuple[int, int]:
    """Keys a tile and warps a program where cfg leaves them open. Unsplit (batch 16+ of 8
    kv heads): 128 keys, 4 warps (best on an H100 for bf16 and fp8 caches at batch 131 and
    256). Split, up to 7 rows: 32 keys (at a 256-token context a batch-1 step has 8
    programs a kv head at work, not 2), 4 warps. Split, 8+ rows: 64 keys, 2 warps (an H200
    at batch 8, 512 / 1024-token contexts: bf16 group 2 19.1 -> 16.1 / 25.9 -> 22.5 us,
    fp8 group 4 18.8 -> 16.9 / 23.9 -> 20.6; the 0.6B's graph step 1.53 -> 1.35 ms. At
    batch 1 the same shape lost: 0.82 -> 0.90 ms). head_dim > 128: 32 keys."""
    wide = num_splits > 1 and num_seqs >= SPLIT_WIDE_ROWS and head_dim <= 128
    block_n = cfg.block_n or (64 if wide else 32 if head_dim > 128 or num_splits > 1 else 128)
    return block_n, cfg.num_warps or (2 if wide else 4)


# NANOSERVE_DECODE_BLOCK_N / _WARPS override the key-tile size and warps, to compare configs
# end to end.
DEFAULT_DECODE_CONFIG = DecodeConfig(
    block_n=int(os.environ.get("NANOSERVE_DECODE_BLOCK_N", "0")) or None,
    num_warps=int(os.environ.get("NANOSERVE_DECODE_WARPS", "0")) or None)


def rows_per_program(group: int) -> int:
    """Rows of a run one decode program takes: as many as fit beside the group's heads in
    the 16 rows a tile's dot has anyway (8 for Qwen3-0.6B's group of 2, 4 for 8B's 4)."""
    return max(16, triton.next_power_of_2(group)) // group


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 num_splits: int = 1, out: torch.Tensor | None = None,
                 config: DecodeConfig | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, runs: torch.Tensor | None = None,
                 norm_rotary: NormRotary | None = None) -> torch.Tensor:
    """Decode attention: q [num_seqs, Hq, D] (one token per row) -> [num_seqs, Hq, D].

    block_tables [num_seqs, max_blocks] and context_lens [num_seqs] are int32. A sequence
    with context_len 0 (batch padding) yields zeros. fp8 caches come with their
    per-slot scales k_scale/v_scale [num_blocks, block_size] float32.

    runs [2, num_seqs] int32 (optional): rows that are consecutive tokens of one sequence
    (fast-forward tokens, each a decode row) as (the row's place in its run, rows left in
    the run counting itself); a lone row is (0, 1). The rows of a run share a program,
    up to rows_per_program(group) of them, packed beside the group's heads in the rows of
    its tiles, so their K/V is read once instead of once per row (row r sees keys up to
    its own context_lens[r] - 1). The result is the same as without runs.

    norm_rotary (bf16 / fp16 caches): q and its k, v are the projection's raw heads, each
    row's token at position context_lens - 1; the kernel applies qk_norm_rotary's norm and
    rotation and stores K/V at norm_rotary.slot_mapping itself (no launch of its own).
    """
    cfg = config or DEFAULT_DECODE_CONFIG
    num_kv_heads, group = _check_common(q, k_cache, v_cache, block_tables)
    fp8 = check_cache(q.dtype, k_cache, v_cache, k_scale, v_scale)
    num_seqs, num_heads, head_dim = q.shape
    assert context_lens.shape == (num_seqs,) and block_tables.shape[0] == num_seqs
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    num_splits = max(1, int(num_splits))
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, block_d,
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)
    else:
        part_out = part_lse = out                     # unused
    if fp8:   # read as pairs of e4m3 (see _attend_tile_fp8)
        assert head_dim % 2 == 0
        k_cache, v_cache = k_cache.view(torch.uint16), v_cache.view(torch.uint16)
    group_pad = max(16, triton.next_power_of_2(group))
    per_program = 1 if runs is None else rows_per_program(group)
    if per_program > 1:
        assert runs.shape == (2, num_seqs) and runs.dtype == torch.int32 and runs.is_contiguous()
    counters = None
    if num_splits > 1 and per_program == 1:
        counters = _split_counters(q.device, num_seqs * num_kv_heads)
    splits_pad = max(MAX_SPLITS, triton.next_power_of_2(num_splits))   # one variant
    block_n, num_warps = _tile_and_warps(cfg, head_dim, num_splits, num_seqs)
    nr = norm_rotary
    if nr is not None:
        assert not fp8, "the decode prologue stores bf16 / fp16 K/V only"
        nr.check(q, k_cache)
        assert nr.slot_mapping.shape == (num_seqs,)
        prologue = (nr.k, nr.v, nr.q_weight, nr.k_weight, nr.cos_sin_cache, nr.slot_mapping,
                    nr.eps, nr.k.stride(0), nr.k.stride(1), nr.v.stride(0), nr.v.stride(1),
                    nr.cos_sin_cache.stride(0))
    else:
        prologue = (q, q, q, q, q, context_lens, 0.0, 0, 0, 0, 0, 0)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, out, block_tables,
        context_lens, runs if per_program > 1 else context_lens, part_out, part_lse,
        counters if counters is not None else context_lens,
        num_heads, num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, num_splits, *prologue,
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_N=block_n,
        SPLIT=num_splits > 1, PRECISION=_precision(q.dtype), FP8=fp8,
        Q_FP16=fp8 and q.dtype != torch.float32, RUNS=per_program,
        MERGE=counters is not None, SPLITS_PAD=splits_pad,
        PROLOGUE=nr is not None, HALF=head_dim // 2 if nr is not None else 1,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2) if nr is not None else 1,
        num_warps=num_warps, num_stages=cfg.num_stages, **pdl.launch(q.device, num_seqs),
    )
    if num_splits > 1 and counters is None:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, out.stride(0), out.stride(1), num_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=splits_pad,
            num_warps=4, **pdl.launch(q.device, num_seqs),
        )
    return out


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def _split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """Zeroed int32 counters, at least n, for the in-kernel merge (each is back to 0 when
    its kernel ends), or None (the merge kernel then runs): while a CUDA graph is being
    captured nothing new may be allocated, as a graph's memset runs only when it replays.
    The graph's eager warm-up call allocates them; outgrown ones stay alive, since a
    captured graph keeps their address."""
    have = _COUNTERS.get(device)
    if have is not None and have.numel() >= n:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if have is not None:
        _OUTGROWN.append(have)
    _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return _COUNTERS[device]


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, max_seqlen_q: int, scale: float,
                  out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, split_len: int = 0,
                  parallel_splits: int = 0) -> torch.Tensor:
    """Prefill (or any ragged batch): q [T, Hq, D] -> [T, Hq, D], causal over the paged context.

    cu_seqlens_q [num_seqs + 1], context_lens [num_seqs], block_tables: int32.
    max_seqlen_q is a host int (no device sync); it only sizes the grid. fp8 caches: as
    paged_decode.

    split_len (a multiple of 64; 0: none): the keys in splits of split_len from key 0, each
    reduced alone and merged in order, so a row's bits depend on its own position only
    (--deterministic). parallel_splits > 0 (a decode step: few rows, long contexts): that
    many programs per (sequence, kv head), one split each (>= the longest context's
    splits), merged by a second kernel; 0: each program walks its splits in turn. Both give
    a row the same bits.
    """
    num_kv_heads, group = _check_common(q, k_cache, v_cache, block_tables)
    fp8 = check_cache(q.dtype, k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    assert cu_seqlens_q.shape == (num_seqs + 1,)
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(64, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(head_dim)
    block_n = 64 if head_dim <= 128 else 32
    assert split_len % 64 == 0, "splits must hold whole key tiles"
    splits = parallel_splits if split_len else 0
    # the merge takes row i's context from context_lens[i]: one query row per sequence
    assert not splits or (max_seqlen_q == 1 and num_tokens == num_seqs), \
        "parallel_splits is for decode steps (one row per sequence)"
    part_out = part_lse = out                         # unused unless splits
    if splits:
        part_out = torch.empty(num_tokens, num_heads, splits, block_d, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32,
                               device=q.device)
    grid = (triton.cdiv(max_seqlen_q, block_m // group), num_seqs, num_kv_heads * max(splits, 1))
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, out, block_tables,
        context_lens, cu_seqlens_q, part_out, part_lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, num_heads, num_kv_heads, max(splits, 1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, TOKENS=block_m // group,
        PRECISION=_precision(q.dtype), FP8=fp8, Q_FP16=fp8 and q.dtype != torch.float32,
        SPLIT_LEN=split_len, PARTIAL=splits > 0,
        num_warps=4, num_stages=2,
    )
    if splits:
        _split_merge_kernel[(num_tokens,)](
            out, part_out, part_lse, context_lens, out.stride(0), out.stride(1), num_heads,
            splits, SPLIT_LEN=split_len, HEAD_DIM=head_dim, BLOCK_D=block_d,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            num_warps=4,
        )
    return out


__all__ = ["paged_decode", "paged_prefill", "default_num_splits", "rows_per_program"]
