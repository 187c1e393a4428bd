"""kernels/quant_linear.py: the W4A16 / W8A16 GEMV and GEMM (Triton interpreter) against
the torch reference (dequantize, then matmul), and the reference against a hand-made W."""
from __future__ import annotations

import pytest
import torch
import triton

import kernels.quant_linear
from kernels.quant_linear import consecutive_group, dequantize_ref, quant_linear, quant_linear_ref


def random_layout(K: int, N: int, bits: int, group: int, act_order: bool, dtype, seed: int = 0):
    """qweight / scales / zeros / g_idx of the kernel's layout and the ints they pack."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (K, N), generator=gen, dtype=torch.int32)
    per_word = 32 // bits
    words = torch.zeros(K // per_word, N, dtype=torch.int64)
    for i in range(per_word):
        words |= q[i::per_word].long() << (i * bits)
    qweight = (words - ((words >> 31) << 32)).to(torch.int32)     # two's complement
    groups = triton.cdiv(K, group)           # the last group may be partial
    scales = (torch.rand(groups, N, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 1 << bits, (groups, N), generator=gen).to(dtype)
    g_idx = torch.arange(K, dtype=torch.int32) // group
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=gen)]
    return q, qweight, scales, zeros, g_idx


@pytest.mark.parametrize("bits", [4, 8])
def test_reference_dequantizes_the_packed_ints(bits):
    q, qweight, scales, zeros, g_idx = random_layout(64, 24, bits, 16, True, torch.float32)
    w = dequantize_ref(qweight, scales, zeros, g_idx, bits)
    g = g_idx.long()
    torch.testing.assert_close(w, (q.float() - zeros[g]) * scales[g], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits,act_order,bias", [(4, False, False), (4, True, True),
                                                 (8, False, True), (8, True, False)])
@pytest.mark.parametrize("rows", [1, 3, 21], ids=["gemv1", "gemv3", "gemm21"])
@pytest.mark.parametrize("K,group", [(160, 32), (192, 64)], ids=["k160g32", "k192g64"])
def test_kernel_matches_reference(rows, bits, act_order, bias, dtype, K, group):
    """K past one BLOCK_K and N past one BLOCK_N (the masks); group 64 without act-order:
    tiles within one group (one row of scales) and, in the GEMV's 128-row tiles, across two."""
    N = 72
    _, qweight, scales, zeros, g_idx = random_layout(K, N, bits, group, act_order, dtype, seed=rows)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    ref = quant_linear_ref(x, qweight, scales, zeros, g_idx, bits, b)
    out = quant_linear(x, qweight, scales, zeros, g_idx, bits, b)
    assert out.dtype == dtype and out.shape == (rows, N)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits,act_order", [(4, True), (8, False)])
def test_fused_moe_with_packed_experts_matches_reference(bits, act_order, dtype):
    """kernels/fused_moe.py's int4 / int8 experts (interpreter) against moe_reference on
    the dequantized (x-dtype-rounded) stacks."""
    from kernels.fused_moe import PackedExperts, fused_moe
    from models.moe import moe_reference
    E, H, I, T, k = 3, 64, 48, 5, 2
    stacks = []
    for K, N in ((H, 2 * I), (I, H)):
        parts = [random_layout(K, N, bits, 16, act_order, dtype, seed=10 * e + K) for e in range(E)]
        stacks.append(PackedExperts(*(torch.stack([p[i] for p in parts]).contiguous()
                                      for i in range(1, 5)), bits))
    gate_up = torch.stack([dequantize_ref(*(t[e] for t in stacks[0][:4]), bits).T
                           for e in range(E)]).to(dtype)            # [E, 2I, H]
    down = torch.stack([dequantize_ref(*(t[e] for t in stacks[1][:4]), bits).T
                        for e in range(E)]).to(dtype)               # [E, H, I]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen).to(dtype)
    ref = moe_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    out = fused_moe(x, None, None, weights, ids, packed=tuple(stacks))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


# --- the split-K GEMV (up to GEMV_MAX_TOKENS rows) ------------------------------------------

def gemv_case(bits, act_order, group, rows, dtype, N=200, seed=0):
    """K of 5 chunks (80 words: int4 640 rows, int8 320), N over two 128-channel tiles."""
    K = 80 * (32 // bits)
    _, qweight, scales, zeros, g_idx = random_layout(K, N, bits, group, act_order, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype)
    return x, qweight, scales, zeros, g_idx, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 2, 3], ids=["split1", "split2", "split3"])
@pytest.mark.parametrize("bits,group,act_order", [(4, 32, False), (4, 128, False), (4, 64, True),
                                                  (8, 32, True), (8, 64, False)])
def test_gemv_split_k_matches_reference(bits, group, act_order, splits, dtype):
    """5 chunks in 1, 2 (3 + 2) or 3 (2 + 2 + 1: a split ending on its unrolled loop's first
    chunk) splits, every row count of the GEMV, with and without a bias: the constexpr group
    path (groups of one chunk or more: one row of scales a chunk; smaller: one a word) and
    act-order's gathers. (The splits the shapes choose: the bit-invariance test below.)"""
    x, qweight, scales, zeros, g_idx, b = gemv_case(bits, act_order, group, 4, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert kernels.quant_linear.GEMV_MAX_TOKENS == 4
    for rows, bias in ((1, None), (2, b), (3, None), (4, b)):   # every row count, bias or not
        ref = quant_linear_ref(x[:rows], qweight, scales, zeros, g_idx, bits, bias)
        out = quant_linear(x[:rows], qweight, scales, zeros, g_idx, bits, bias, splits=splits)
        assert out.dtype == dtype and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol,
                                   atol=tol * ref.float().abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_is_the_same_for_every_row_count_and_group_path(bits):
    """Bitwise: a row's result does not depend on the rows beside it (the splits come from
    the shapes only), and the constexpr group path sums exactly what the general path (the
    g_idx gathers) does: the path is a speed choice, never a numerical one."""
    x, qweight, scales, zeros, g_idx, b = gemv_case(bits, False, 32, 4, torch.bfloat16, seed=5)
    group = consecutive_group(g_idx)
    assert group == 32
    full = quant_linear(x, qweight, scales, zeros, g_idx, bits, b, group_size=group)
    general = quant_linear(x, qweight, scales, zeros, g_idx, bits, b, group_size=0)
    assert torch.equal(full, general)
    for m in range(4):
        one = quant_linear(x[m:m + 1], qweight, scales, zeros, g_idx, bits, b, group_size=group)
        assert torch.equal(one, full[m:m + 1])
    # group_size=None: decided from g_idx on the spot
    assert torch.equal(quant_linear(x, qweight, scales, zeros, g_idx, bits, b), full)


def test_consecutive_group_tells_trivial_g_idx_from_act_order():
    rows = torch.arange(256, dtype=torch.int32)
    assert consecutive_group(rows // 128) == 128
    assert consecutive_group(3 + rows // 64) == 64            # a row-parallel rank's slice
    assert consecutive_group(torch.full((256,), 2, dtype=torch.int32)) == 256   # one group
    assert consecutive_group((rows + 32) // 128) == 0         # the rank starts mid-group
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    assert consecutive_group((rows // 32)[perm]) == 0          # act-order


def test_gemv_splits_come_from_shapes():
    """Qwen3-8B's decode shapes get >= GEMV_PROGRAMS / 2 programs; each split whole chunks."""
    from kernels.quant_linear import GEMV_BLOCK_KW, GEMV_BLOCK_N, GEMV_PROGRAMS, gemv_splits
    for N, K in ((24576, 4096), (4096, 12288), (4096, 4096), (6144, 4096)):
        for bits in (4, 8):
            splits, k_split = gemv_splits(N, K, bits)
            chunk = GEMV_BLOCK_KW * 32 // bits
            assert k_split % (2 * chunk) == 0 and (splits - 1) * k_split < K <= splits * k_split
            assert splits * triton.cdiv(N, GEMV_BLOCK_N) >= GEMV_PROGRAMS // 2


# --- the GEMM (more than GEMV_MAX_TOKENS rows) ----------------------------------------------

@pytest.mark.parametrize("bits,group,act_order,offset", [
    (4, 128, False, 3),   # g128 at a row-parallel rank's slice: one row of scales a K step
    (4, 32, False, 0),    # groups smaller than BLOCK_K: each row's group computed
    (8, 64, False, 1),    # one group a K step exactly
    (8, 64, True, 0),     # act-order: the g_idx gathers
], ids=["int4g128rank", "int4g32", "int8g64rank", "int8act"])
def test_gemm_tiles_and_group_paths_match_reference(bits, group, act_order, offset):
    """The M buckets past 32 rows (40: 64 x 128 tiles; 130: 128 x 128, its second m tile 2
    rows), N over two 128-channel tiles, K of 3 steps (g128: two steps in group 0, one in
    1), bias or not; and the constexpr group path gives bitwise the general path's y."""
    K, N = 192, 136
    _, qweight, scales, zeros, g_idx = random_layout(K + offset * group, N, bits, group,
                                                     act_order, torch.bfloat16, seed=group)
    skip = offset * group                    # the rank's first row: g_idx starts at `offset`
    qweight, g_idx = qweight[skip // (32 // bits):].contiguous(), g_idx[skip:].contiguous()
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(130, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(N, generator=gen).to(torch.bfloat16)
    group_size = consecutive_group(g_idx)
    assert group_size == (0 if act_order else group)
    for rows, bias in ((40, b), (130, None)):
        ref = quant_linear_ref(x[:rows], qweight, scales, zeros, g_idx, bits, bias)
        out = quant_linear(x[:rows], qweight, scales, zeros, g_idx, bits, bias,
                           group_size=group_size)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, N)
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2,
                                   atol=1e-2 * ref.float().abs().max().item())
        if group_size:
            general = quant_linear(x[:rows], qweight, scales, zeros, g_idx, bits, bias,
                                   group_size=0)
            assert torch.equal(out, general)
