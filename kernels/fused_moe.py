"""Fused MoE experts (issue 31, item 2): align tokens to experts, then two grouped GEMMs.

Reference: `models.moe.moe_reference(x, gate_up, down, weights, ids)` (every expert over
every token, dense routing). Not imported here: models/ will import this module, and
kernels/ does not depend on models/. Only the selected experts' FLOPs are spent here:

1. `align_tokens` (one Triton launch, no host sync, data-independent output sizes, so it
   can run inside a CUDA graph): the T * k flat (token, k) slots sorted by expert, each
   expert's group padded to a multiple of block_m with the sentinel slot T * k, and each
   block's expert. (`align_tokens_ref`, its torch reference, takes ~25 small kernels.)
2. `_gate_up_silu_kernel`: per (block of block_m sorted slots, block_n intermediate
   columns), gather x[slot // k], multiply by the block's expert's gate and up tiles (two
   float32 accumulators), write silu(g) * u to act[slot] ([T * k, I], x's dtype).
3. `_down_weighted_kernel`: out_slots[slot] = weights.flatten()[slot] * (act[slot] @
   down[e].T) ([T * k, H], x's dtype); then a torch sum over the [T, k, H] view.

The k reduction is a torch sum, not a fused float32 atomic add into [T, H]: the sum is
deterministic (atomics add in whatever order the blocks finish, so the same request would
not give bit-identical logits from run to run or batch to batch), needs no zeroed float32
buffer nor a cast pass after it, and costs one read of T * k * H elements (k <= 8), small
next to reading the experts' weights at decode sizes. On a GPU it is one extra kernel;
whether an atomic epilogue wins at prefill sizes is a question for the benchmark.

Numerics follow the reference's roundings in x's dtype: gate and up are rounded to x's
dtype, silu rounded, the product rounded (as kernels/activation.py); the down product is
accumulated in float32, scaled by the routing weight, rounded once. float32 inputs use
full-precision dots (no TF32), so they match the reference closely.

Int4 / int8 experts (GPTQ, AWQ checkpoints): `packed` gives each stack in
kernels/quant_linear.py's layout with a leading expert dimension (PackedExperts); each
weight tile is dequantized in registers (quant_linear's `_dequant_tile`), rounded to x's
dtype, then multiplied as above: a quarter of bf16's bytes per expert read at int4.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from typing import NamedTuple

from kernels.fp8_linear import FP8
from kernels.interpret import INTERPRET_ENV, cast, dot
from kernels.quant_linear import BITS, _dequant_tile


class PackedExperts(NamedTuple):
    """One stack of int4 / int8 experts, W[e] = (q[e] - zeros[e][g]) * scales[e][g] with
    g = g_idx[e][k] (kernels/quant_linear.py's layout per expert)."""
    qweight: torch.Tensor     # [E, K / (32 / bits), N] int32, packed along K
    scales: torch.Tensor      # [E, G, N] x's dtype
    zeros: torch.Tensor       # [E, G, N] x's dtype
    g_idx: torch.Tensor       # [E, K] int32
    bits: int

# Tiles by the number of (token, k) slots, from a sweep at Qwen3-30B-A3B's shapes on an H200
# (tests/gpu/moe_check.py kernels; tests/gpu/RESULTS.md): decode batches keep block_m at
# tl.dot's minimum (16) so that experts with a handful of tokens waste few padded rows;
# bigger batches take taller tiles. Within 0-9% of the sweep's best at every measured size.
TILE_TIERS = (   # (most slots, tiles)
    (1280, dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (4096, dict(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (None, dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)),
)


def default_config(num_slots: int) -> dict:
    """The default tiles for T * k = num_slots slots (a copy; callers may edit it)."""
    return dict(next(tiles for most, tiles in TILE_TIERS if most is None or num_slots <= most))


def num_align_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Blocks of sorted_slots: a group wastes at most block_m - 1 slots, and at most
    min(E, slots) groups are non-empty. From shapes only (CUDA graphs)."""
    return triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m)


@triton.jit
def _align_kernel(Ids, SortedSlots, BlockExpert, NumPadded, N, NUM_BLOCKS,
                  E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Program e writes expert e's group of sorted_slots (its slots in ascending order,
    then sentinels up to a multiple of BLOCK_M) and its blocks' entries of block_expert;
    the last program also the tail past the last group and num_padded. Every program
    counts all experts itself (a histogram of the N ids, which sit in L2): the programs
    need no grid-wide sync and write disjoint ranges."""
    e = tl.program_id(0)
    bins = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, N, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(Ids + offs, mask=offs < N, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_P2, mask=offs < N)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(bins < e, padded, 0), axis=0)
    count = tl.sum(tl.where(bins == e, counts, 0), axis=0)
    end = start + tl.sum(tl.where(bins == e, padded, 0), axis=0)
    cursor = start
    for c0 in range(0, N, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        hit = (tl.load(Ids + offs, mask=offs < N, other=-1) == e).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit          # earlier slots of this chunk, same expert
        tl.store(SortedSlots + cursor + before, offs, mask=hit != 0)
        cursor += tl.sum(hit, axis=0)
    pad = start + count + tl.arange(0, BLOCK_M)        # fewer than BLOCK_M sentinels
    tl.store(SortedSlots + pad, N, mask=pad < end)
    for b0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        tl.store(BlockExpert + blocks, e, mask=blocks < end // BLOCK_M)
    if e == tl.num_programs(0) - 1:
        total = tl.sum(padded, axis=0)
        tl.store(NumPadded, total.to(tl.int64))
        for p0 in range(total, NUM_BLOCKS * BLOCK_M, CHUNK):
            tail = p0 + tl.arange(0, CHUNK)
            tl.store(SortedSlots + tail, N, mask=tail < NUM_BLOCKS * BLOCK_M)
        for b0 in range(total // BLOCK_M, NUM_BLOCKS, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            tl.store(BlockExpert + blocks, -1, mask=blocks < NUM_BLOCKS)


def align_tokens(ids: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] expert ids -> (sorted_slots, block_expert, num_padded).

    sorted_slots (int32, num_blocks * block_m): the flat slots t * k + j grouped by expert
    (ascending expert, ascending slot within an expert), each group padded to a multiple of
    block_m with the sentinel T * k; past the last group, sentinels only. block_expert
    (int32, num_blocks): block b's expert, -1 for the unused blocks at the end.
    num_padded (int64, 0-d, on ids' device): the used length of sorted_slots.

    One launch of E programs (`_align_kernel`); sizes depend on shapes only
    (`num_align_blocks`) and nothing syncs with the host, so it runs inside CUDA graphs.
    `align_tokens_ref` computes the same in torch ops."""
    assert ids.dim() == 2 and block_m > 0 and num_experts > 0
    n = ids.numel()
    num_blocks = num_align_blocks(n, num_experts, block_m)
    sorted_slots = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty((), dtype=torch.int64, device=ids.device)
    _align_kernel[(num_experts,)](ids.reshape(-1), sorted_slots, block_expert, num_padded, n,
                                  num_blocks, E_P2=triton.next_power_of_2(num_experts),
                                  BLOCK_M=block_m, CHUNK=1024, num_warps=4)
    return sorted_slots, block_expert, num_padded


def align_tokens_ref(ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_tokens in torch ops (its test's reference): ids [T, k] expert ids ->
    (sorted_slots, block_expert, num_padded).

    sorted_slots (int32, num_blocks * block_m): the flat slots t * k + j grouped by expert
    (ascending expert, ascending slot within an expert), each group padded to a multiple of
    block_m with the sentinel T * k; past the last group, sentinels only. block_expert
    (int32, num_blocks): block b's expert, -1 for the unused blocks at the end.
    num_padded (int64, 0-d, on ids' device): the used length of sorted_slots.

    Sizes depend on shapes only: an expert's group wastes at most block_m - 1 slots and at
    most min(E, T * k) experts are non-empty, so num_blocks = cdiv(T * k + min(E, T * k) *
    (block_m - 1), block_m). No host sync (no .item(), no bincount, no nonzero); but some
    25 small kernels, ~60 us a layer at decode sizes on an H100."""
    assert ids.dim() == 2 and block_m > 0 and num_experts > 0
    n = ids.numel()
    device = ids.device
    num_blocks = num_align_blocks(n, num_experts, block_m)
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    sorted_experts, order = torch.sort(flat, stable=True)          # slots grouped by expert
    group_start = counts.cumsum(0) - counts                         # in the unpadded order
    rank = torch.arange(n, device=device) - group_start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_slots = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_slots[dest] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)   # E past the end
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots, block_expert, padded_end[-1]


@triton.jit
def _gate_up_silu_kernel(X, W, WScale, Act, SortedSlots, BlockExpert, N, H, I,
                         stride_xt, stride_xh, stride_we, stride_wn, stride_wh,
                         stride_as, stride_ai, QW, QS, QZ, QG, stride_qe, stride_se, stride_ge,
                         TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_W: tl.constexpr,
                         PRECISION: tl.constexpr, RNE_BF16: tl.constexpr, Q_BITS: tl.constexpr):
    """act[slot, n] = silu(gate[e] @ x[slot // k]) * (up[e] @ x[slot // k]) for the block's
    slots and block_n columns n; gate rows are W[e, :I], up rows W[e, I:]. FP8_W: W is e4m3
    and row r of expert e is W[e, r] * WScale[e, r] (WScale [E, 2I] contiguous). Q_BITS > 0:
    W is packed instead (QW / QS / QZ / QG: PackedExperts, gate columns then up columns)."""
    block = tl.program_id(0)
    expert = tl.load(BlockExpert + block).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(SortedSlots + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = slots < N                                      # the sentinel N pads groups
    tokens = slots // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh
    g_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = offs_k < H - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if Q_BITS > 0:
            qw, qs = QW + expert * stride_qe, QS + expert * stride_se
            qz, qg = QZ + expert * stride_se, QG + expert * stride_ge
            wg = cast(_dequant_tile(qw, qs, qz, qg, k0, offs_n, n_mask, H, 2 * I, Q_BITS,
                                    BLOCK_K, BLOCK_N), x.dtype, RNE_BF16)
            wu = cast(_dequant_tile(qw, qs, qz, qg, k0, offs_n + I, n_mask, H, 2 * I, Q_BITS,
                                    BLOCK_K, BLOCK_N), x.dtype, RNE_BF16)
        else:
            w_mask = k_mask[:, None] & n_mask[None, :]
            wg = tl.load(g_ptrs, mask=w_mask, other=0.0).to(x.dtype)   # e4m3 -> x's: exact
            wu = tl.load(u_ptrs, mask=w_mask, other=0.0).to(x.dtype)
        acc_g = dot(x, wg, acc_g, PRECISION)
        acc_u = dot(x, wu, acc_u, PRECISION)
        x_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    if FP8_W:
        scales = WScale + expert * 2 * I + offs_n
        acc_g *= tl.load(scales, mask=n_mask, other=0.0)[None, :]
        acc_u *= tl.load(scales + I, mask=n_mask, other=0.0)[None, :]
    # The reference's roundings: gate, up, silu and the product each in the output dtype.
    dt: tl.constexpr = Act.dtype.element_ty
    g = cast(acc_g, dt, RNE_BF16).to(tl.float32)
    u = cast(acc_u, dt, RNE_BF16).to(tl.float32)
    silu = cast(g / (1.0 + tl.exp(-g)), dt, RNE_BF16).to(tl.float32)
    dst = Act + slots[:, None] * stride_as + offs_n[None, :] * stride_ai
    tl.store(dst, cast(silu * u, dt, RNE_BF16), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_weighted_kernel(Act, D, DScale, Weights, Out, SortedSlots, BlockExpert, N, H, I,
                          stride_as, stride_ai, stride_de, stride_dh, stride_di,
                          stride_os, stride_oh, QW, QS, QZ, QG, stride_qe, stride_se, stride_ge,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, FP8_W: tl.constexpr,
                          PRECISION: tl.constexpr, RNE_BF16: tl.constexpr, Q_BITS: tl.constexpr):
    """out[slot, n] = weights[slot] * (act[slot] @ down[e, n]) for the block's slots and
    block_n hidden columns n. FP8_W: down is e4m3 times DScale [E, H] (contiguous). Q_BITS > 0:
    down is packed instead (QW / QS / QZ / QG: PackedExperts, [I, H] per expert)."""
    block = tl.program_id(0)
    expert = tl.load(BlockExpert + block).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(SortedSlots + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = slots < N
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = Act + slots[:, None] * stride_as + offs_k[None, :] * stride_ai
    d_ptrs = D + expert * stride_de + offs_n[None, :] * stride_dh + offs_k[:, None] * stride_di
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_mask = offs_k < I - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if Q_BITS > 0:
            d = cast(_dequant_tile(QW + expert * stride_qe, QS + expert * stride_se,
                                   QZ + expert * stride_se, QG + expert * stride_ge, k0, offs_n,
                                   n_mask, I, H, Q_BITS, BLOCK_K, BLOCK_N), a.dtype, RNE_BF16)
        else:
            d = tl.load(d_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(a.dtype)
        acc = dot(a, d, acc, PRECISION)
        a_ptrs += BLOCK_K * stride_ai
        d_ptrs += BLOCK_K * stride_di
    if FP8_W:
        acc *= tl.load(DScale + expert * H + offs_n, mask=n_mask, other=0.0)[None, :]
    w = tl.load(Weights + slots, mask=row_mask, other=0.0).to(tl.float32)
    out = cast(acc * w[:, None], Out.dtype.element_ty, RNE_BF16)
    dst = Out + slots[:, None] * stride_os + offs_n[None, :] * stride_oh
    tl.store(dst, out, mask=row_mask[:, None] & n_mask[None, :])


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision dot (no TF32), as torch's default fp32 matmul.
    return "ieee" if dtype == torch.float32 else "tf32"


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor | None,
              weights: torch.Tensor, ids: torch.Tensor,
              scales: tuple[torch.Tensor, torch.Tensor] | None = None, *,
              packed: tuple[PackedExperts, PackedExperts] | None = None,
              block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> torch.Tensor:
    """moe_reference's result, [T, H] in x's dtype, spending only the selected experts'
    FLOPs: x [T, H], gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I], weights
    [T, k] routing weights, ids [T, k] expert ids (models.moe.route's outputs).

    FP8 experts (weight-only: half the bytes a decode step streams): gate_up and down in
    e4m3 with scales = (gate_up's [E, 2I], down's [E, H]) float32, one per output row
    (models/moe.py quantize_fp8); each tile is widened to x's dtype (exact) before the dot
    and each output column scaled after it. Without scales both are in x's dtype.

    Int4 / int8 experts: gate_up and down None, packed = (gate_up's [H, 2I] per expert,
    down's [I, H] per expert) as PackedExperts.

    Tiles default to `default_config(T * k)` (TILE_TIERS); any keyword given overrides its
    entry.
    block_m, block_n, block_k must be powers of two >= 16 (tl.dot's minimum). Both GEMMs
    share the tiles; block_n tiles I in the first, H in the second. No host sync, and the
    launch grids depend on shapes only, so it can be captured in a CUDA graph."""
    T, H = x.shape
    if packed is not None:
        gu, dn = packed
        assert gu.bits == dn.bits and gu.bits in BITS and scales is None
        E, two_i = gu.qweight.shape[0], gu.qweight.shape[2]
        inter = two_i // 2
        assert gu.g_idx.shape == (E, H) and dn.g_idx.shape == (E, inter)
        assert dn.qweight.shape == (E, inter * gu.bits // 32, H)
        for p in packed:
            assert p.qweight.is_contiguous() and p.scales.is_contiguous()
            assert p.zeros.is_contiguous() and p.g_idx.is_contiguous() and p.scales.shape == p.zeros.shape
        gate_up, down = gu.qweight, dn.qweight        # unread dense operands (Q_BITS > 0)
    else:
        assert gate_up.dim() == 3 and down.dim() == 3
        E, two_i, _ = gate_up.shape
        inter = two_i // 2
        assert gate_up.shape == (E, 2 * inter, H) and down.shape == (E, H, inter)
    assert x.dim() == 2 and weights.shape == ids.shape and ids.shape[0] == T
    fp8 = scales is not None
    assert packed is not None or gate_up.dtype == down.dtype == (FP8 if fp8 else x.dtype)
    if fp8:
        assert scales[0].shape == (E, 2 * inter) and scales[1].shape == (E, H)
        assert all(s.dtype == torch.float32 and s.is_contiguous() for s in scales)
    top_k = ids.shape[1]
    n = T * top_k
    cfg = default_config(n)
    for key, value in dict(block_m=block_m, block_n=block_n, block_k=block_k,
                           num_warps=num_warps, num_stages=num_stages).items():
        if value is not None:
            cfg[key] = value
    if n == 0:
        return torch.zeros(T, H, dtype=x.dtype, device=x.device)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    sorted_slots, block_expert, _ = align_tokens(ids, E, bm)
    num_blocks = block_expert.numel()
    # Every real slot sits in exactly one block with an expert, so every row gets written.
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    out_slots = torch.empty(n, H, dtype=x.dtype, device=x.device)
    w_flat = weights.reshape(-1).contiguous()
    gu_scale, d_scale = scales if fp8 else (gate_up, down)   # (unread without FP8_W)
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  FP8_W=fp8, PRECISION=_precision(x.dtype),
                  RNE_BF16=INTERPRET_ENV and x.dtype == torch.bfloat16,
                  Q_BITS=packed[0].bits if packed is not None else 0)

    def quant_args(i: int) -> tuple:
        if packed is None:
            return (x, x, x, ids, 0, 0, 0)
        p = packed[i]
        return (p.qweight, p.scales, p.zeros, p.g_idx, p.qweight.stride(0), p.scales.stride(0),
                p.g_idx.stride(0))

    _gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, bn))](
        x, gate_up, gu_scale, act, sorted_slots, block_expert, n, H, inter,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        act.stride(0), act.stride(1), *quant_args(0), TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk,
        **launch)
    _down_weighted_kernel[(num_blocks, triton.cdiv(H, bn))](
        act, down, d_scale, w_flat, out_slots, sorted_slots, block_expert, n, H, inter,
        act.stride(0), act.stride(1), down.stride(0), down.stride(1), down.stride(2),
        out_slots.stride(0), out_slots.stride(1), *quant_args(1), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk,
        **launch)
    # The k reduction: deterministic torch sum (reduces in float32 for half types).
    return out_slots.view(T, top_k, H).sum(dim=1)
