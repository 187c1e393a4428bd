"""Prototype: decode attention with HEADS kv heads per program as one block-diagonal tile.

A program owns (sequence, HEADS consecutive kv heads). Each tile holds KEYS = BLOCK_N // HEADS
keys of each of its kv heads (rows grouped by head), and the q rows of all HEADS*GROUP query
heads; a score is kept only where the query head's kv head is the key row's. Fewer programs:
fewer dependent-load chains (context length -> table -> first tile) per SM.
"""
import torch
import triton
import triton.language as tl

LAST = None

from kernels.paged_attention import (LOG2E, _e4m3_pairs_to_f16, _softmax_step, _precision)


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_heads_kernel(
    Q, KCache, VCache, KScale, VScale, Out, BlockTables, ContextLens,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    qk_scale_log2,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, Q_FP16: tl.constexpr,
):
    KEYS: tl.constexpr = BLOCK_N // HEADS
    seq = tl.program_id(0)
    kv0 = tl.program_id(1) * HEADS
    ctx = tl.load(ContextLens + seq)
    offs_r = tl.arange(0, ROWS)
    r_mask = offs_r < HEADS * GROUP
    heads = kv0 * GROUP + offs_r
    offs_t = tl.arange(0, BLOCK_N)
    hloc = offs_t // KEYS
    # keep a score where the row's kv head is the key row's; padding rows see all (q = 0)
    same = (hloc[None, :] == (offs_r // GROUP)[:, None]) | (offs_r >= HEADS * GROUP)[:, None]
    head_off = (kv0 + hloc).to(tl.int64) * stride_ch
    q_row = Q + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    if FP8:
        offs_h = tl.arange(0, HEAD_DIM // 2)
        q_e = tl.load(q_row + 2 * offs_h[None, :], mask=r_mask[:, None], other=0.0)
        q_o = tl.load(q_row + 2 * offs_h[None, :] + 1, mask=r_mask[:, None], other=0.0)
        if Q_FP16:
            q_e = q_e.to(tl.float16)
            q_o = q_o.to(tl.float16)
        acc_e = tl.zeros([ROWS, HEAD_DIM // 2], dtype=tl.float32)
        acc_o = tl.zeros([ROWS, HEAD_DIM // 2], dtype=tl.float32)
        for start in range(0, ctx, KEYS):
            key = start + offs_t % KEYS
            n_mask = key < ctx
            page = tl.load(table + start // PAGE_SIZE).to(tl.int64)
            in_page = start % PAGE_SIZE + offs_t % KEYS
            row = page * stride_cb + in_page * stride_cs + head_off
            slot = page * PAGE_SIZE + in_page
            k_e, k_o = _e4m3_pairs_to_f16(tl.load(KCache + row[:, None] + offs_h[None, :],
                                                  mask=n_mask[:, None], other=0))
            s = tl.dot(q_e, tl.trans(k_e.to(q_e.dtype)), input_precision=PRECISION)
            s = tl.dot(q_o, tl.trans(k_o.to(q_e.dtype)), s, input_precision=PRECISION)
            s = s * (tl.load(KScale + slot, mask=n_mask, other=0.0) * qk_scale_log2)[None, :]
            s = tl.where(n_mask[None, :] & same, s, float("-inf"))
            m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i)
            v_e, v_o = _e4m3_pairs_to_f16(tl.load(VCache + row[:, None] + offs_h[None, :],
                                                  mask=n_mask[:, None], other=0))
            p_v = (p * tl.load(VScale + slot, mask=n_mask, other=0.0)[None, :]).to(q_e.dtype)
            acc_e = acc_e * alpha[:, None] + tl.dot(p_v, v_e.to(q_e.dtype), input_precision=PRECISION)
            acc_o = acc_o * alpha[:, None] + tl.dot(p_v, v_o.to(q_e.dtype), input_precision=PRECISION)
            m_i = m_new
        denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = Out + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        tl.store(dst + 2 * offs_h[None, :], (acc_e / denom).to(Out.dtype.element_ty),
                 mask=r_mask[:, None])
        tl.store(dst + 2 * offs_h[None, :] + 1, (acc_o / denom).to(Out.dtype.element_ty),
                 mask=r_mask[:, None])
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_row + offs_d[None, :], mask=r_mask[:, None], other=0.0)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for start in range(0, ctx, KEYS):
            key = start + offs_t % KEYS
            n_mask = key < ctx
            page = tl.load(table + start // PAGE_SIZE).to(tl.int64)
            in_page = start % PAGE_SIZE + offs_t % KEYS
            row = page * stride_cb + in_page * stride_cs + head_off
            k = tl.load(KCache + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
            s = tl.where(n_mask[None, :] & same, s, float("-inf"))
            m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i)
            v = tl.load(VCache + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = Out + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        tl.store(dst + offs_d[None, :], (acc / denom).to(Out.dtype.element_ty), mask=r_mask[:, None])


def decode_heads(q, k_cache, v_cache, block_tables, context_lens, scale, heads=2, block_n=128,
                 num_warps=4, num_stages=2, k_scale=None, v_scale=None, out=None):
    num_seqs, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    fp8 = k_scale is not None
    out = torch.empty_like(q) if out is None else out
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint16), v_cache.view(torch.uint16)
    global LAST
    LAST = _decode_heads_kernel[(num_seqs, hkv // heads)](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, out, block_tables,
        context_lens, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, GROUP=group, ROWS=max(16, triton.next_power_of_2(heads * group)),
        HEADS=heads, HEAD_DIM=d, PAGE_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        PRECISION=_precision(q.dtype), FP8=fp8, Q_FP16=fp8 and q.dtype != torch.float32,
        num_warps=num_warps, num_stages=num_stages)
    return out
