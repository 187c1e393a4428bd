"""Experiment (not measured on a GPU yet; NANOSERVE_DECODE_TMA=1 routes paged_decode here): decode attention whose K/V tiles come in through
tensor descriptors (TMA on Hopper): one bulk copy per 16 KB tile instead of per-thread
address math and loads. Full tiles run unmasked; the last, partial tile is masked."""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.paged_attention import LOG2E, _e4m3_pairs_to_f16, _softmax_step, _precision


@triton.jit
def _tile_bf16(q, m_i, l_i, acc, KDesc, VDesc, table, start, hi, kv_head, qk_scale_log2,
               NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr, MASKED: tl.constexpr):
    page = tl.load(table + start // PAGE_SIZE)
    row0 = (page * NUM_KV_HEADS + kv_head) * PAGE_SIZE + start % PAGE_SIZE
    k = KDesc.load([row0, 0])
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
    if MASKED:
        n_mask = start + tl.arange(0, BLOCK_N) < hi
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i)
    v = VDesc.load([row0, 0])
    if MASKED:
        v = tl.where(n_mask[:, None], v, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tile(q_e, q_o, m_i, l_i, acc_e, acc_o, KDesc, VDesc, KScale, VScale, table, start, hi,
          kv_head, qk_scale_log2, NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr,
          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    page = tl.load(table + start // PAGE_SIZE)
    row0 = (page * NUM_KV_HEADS + kv_head) * PAGE_SIZE + start % PAGE_SIZE
    slot = page.to(tl.int64) * PAGE_SIZE + start % PAGE_SIZE + tl.arange(0, BLOCK_N)
    k_e, k_o = _e4m3_pairs_to_f16(KDesc.load([row0, 0]))
    s = tl.dot(q_e, tl.trans(k_e), input_precision=PRECISION)
    s = tl.dot(q_o, tl.trans(k_o), s, input_precision=PRECISION)
    s = s * (tl.load(KScale + slot) * qk_scale_log2)[None, :]
    if MASKED:
        n_mask = start + tl.arange(0, BLOCK_N) < hi
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i)
    v_e, v_o = _e4m3_pairs_to_f16(VDesc.load([row0, 0]))
    vs = tl.load(VScale + slot)
    if MASKED:   # slots past the context may hold NaN bytes: 0 * NaN would poison the dot
        vs = tl.where(n_mask, vs, 0.0)
        v_e = tl.where(n_mask[:, None], v_e, 0.0)
        v_o = tl.where(n_mask[:, None], v_o, 0.0)
    p_v = (p * vs[None, :]).to(q_e.dtype)
    acc_e = acc_e * alpha[:, None] + tl.dot(p_v, v_e, input_precision=PRECISION)
    acc_o = acc_o * alpha[:, None] + tl.dot(p_v, v_o, input_precision=PRECISION)
    return m_new, l_i, acc_e, acc_o


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_tma_kernel(Q, KDesc, VDesc, KScale, VScale, Out, BlockTables, ContextLens,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, qk_scale_log2,
                       NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                       HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr, FP8: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(ContextLens + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q_row = Q + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    full = (ctx // BLOCK_N) * BLOCK_N
    dst = Out + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    if FP8:
        offs_h = tl.arange(0, HEAD_DIM // 2)
        q_e = tl.load(q_row + 2 * offs_h[None, :], mask=g_mask[:, None], other=0.0).to(tl.float16)
        q_o = tl.load(q_row + 2 * offs_h[None, :] + 1, mask=g_mask[:, None], other=0.0).to(tl.float16)
        acc_e = tl.zeros([GROUP_PAD, HEAD_DIM // 2], dtype=tl.float32)
        acc_o = tl.zeros([GROUP_PAD, HEAD_DIM // 2], dtype=tl.float32)
        for start in range(0, full, BLOCK_N):
            m_i, l_i, acc_e, acc_o = _tile(q_e, q_o, m_i, l_i, acc_e, acc_o, KDesc, VDesc, KScale,
                                           VScale, table, start, ctx, kv_head, qk_scale_log2,
                                           NUM_KV_HEADS, PAGE_SIZE, BLOCK_N, PRECISION, False)
        if full < ctx:
            m_i, l_i, acc_e, acc_o = _tile(q_e, q_o, m_i, l_i, acc_e, acc_o, KDesc, VDesc, KScale,
                                           VScale, table, full, ctx, kv_head, qk_scale_log2,
                                           NUM_KV_HEADS, PAGE_SIZE, BLOCK_N, PRECISION, True)
        denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(dst + 2 * offs_h[None, :], (acc_e / denom).to(Out.dtype.element_ty), mask=g_mask[:, None])
        tl.store(dst + 2 * offs_h[None, :] + 1, (acc_o / denom).to(Out.dtype.element_ty), mask=g_mask[:, None])
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_row + offs_d[None, :], mask=g_mask[:, None], other=0.0)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        for start in range(0, full, BLOCK_N):
            m_i, l_i, acc = _tile_bf16(q, m_i, l_i, acc, KDesc, VDesc, table, start, ctx, kv_head,
                                       qk_scale_log2, NUM_KV_HEADS, PAGE_SIZE, BLOCK_N, PRECISION,
                                       False)
        if full < ctx:
            m_i, l_i, acc = _tile_bf16(q, m_i, l_i, acc, KDesc, VDesc, table, full, ctx, kv_head,
                                       qk_scale_log2, NUM_KV_HEADS, PAGE_SIZE, BLOCK_N, PRECISION,
                                       True)
        denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(dst + offs_d[None, :], (acc / denom).to(Out.dtype.element_ty), mask=g_mask[:, None])


def rows_view(cache: torch.Tensor) -> torch.Tensor:
    """A head-major [blocks, page, Hkv, D] cache (kernels.attention.new_kv_cache) as the 2-D
    [blocks * Hkv * page, row] rows it is stored as (fp8: uint16 pairs)."""
    if cache.element_size() == 1:
        cache = cache.view(torch.uint16)
    blocks, page, hkv, d = cache.shape
    rows = cache.permute(0, 2, 1, 3)
    assert rows.is_contiguous(), "needs head-major pages"
    return rows.reshape(blocks * hkv * page, d)


def descriptors(k_cache, v_cache, block_n=128):
    rk, rv = rows_view(k_cache), rows_view(v_cache)
    return (TensorDescriptor.from_tensor(rk, [block_n, rk.shape[1]]),
            TensorDescriptor.from_tensor(rv, [block_n, rv.shape[1]]))


def usable(q: torch.Tensor, k_cache: torch.Tensor, num_splits: int, block_n: int = 128) -> bool:
    """What the TMA kernel needs: CUDA sm_90+, no splits, head-major pages of whole tiles."""
    return (q.is_cuda and num_splits == 1 and torch.cuda.get_device_capability(q.device)[0] >= 9
            and k_cache.shape[1] % block_n == 0 and k_cache.permute(0, 2, 1, 3).is_contiguous())


def decode_tma(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None,
               v_scale=None, block_n=128, num_warps=4, num_stages=2, descs=None, out=None):
    num_seqs, hq, d = q.shape
    hkv = k_cache.shape[2]
    fp8 = k_scale is not None
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    kd, vd = descs or descriptors(k_cache, v_cache, block_n)
    _decode_tma_kernel[(num_seqs, hkv)](
        q, kd, vd, k_scale if fp8 else q, v_scale if fp8 else q, out, block_tables, context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        scale * LOG2E, NUM_KV_HEADS=hkv, GROUP=hq // hkv,
        GROUP_PAD=max(16, triton.next_power_of_2(hq // hkv)), HEAD_DIM=d,
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=block_n, PRECISION=_precision(q.dtype), FP8=fp8,
        num_warps=num_warps, num_stages=num_stages)
    return out
