"""Fused MoE (align_tokens + the two grouped-GEMM Triton kernels) vs models.moe.moe_reference,
on CPU via the interpreter.

Sizes are tiny but ragged: H = 48 and I = 40 are not multiples of the 32-wide tiles (partial
column and reduction tiles in both GEMMs), odd expert counts, top-k 1..4, T in {1, 5, 17}
(groups shorter than, equal to, longer than block_m), experts that get no token.
Interpreter runs stay short (a few tenths of a second per case at these sizes), so float32
takes the full product of experts x top-k x T x norm_topk_prob; bf16 a few cases.
"""
from __future__ import annotations

import itertools
import pytest
import torch

from kernels.fp8_linear import FP8, quantize_rows
from kernels.fused_moe import align_tokens, align_tokens_ref, default_config, fused_moe
from models.moe import moe_reference, route

from triton_device import DEVICE, needs_triton

pytestmark = needs_triton
H, I = 48, 40
TILES = dict(block_m=16, block_n=32, block_k=32)


def make_moe(num_experts: int, top_k: int, tokens: int, norm: bool, seed: int = 0,
             dtype: torch.dtype = torch.float32, dead_expert: int | None = None) -> dict:
    """Random x and experts (scaled so the outputs are O(1)), routed by models.moe.route on
    random logits; dead_expert's logit is -inf, so it gets no token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    if dead_expert is not None:
        logits[:, dead_expert] = float("-inf")
    weights, ids = route(logits.to(dtype), top_k, norm)
    x = torch.randn(tokens, H, generator=g)
    gate_up = torch.randn(num_experts, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(num_experts, H, I, generator=g) / I ** 0.5
    return dict(x=x.to(dtype).to(DEVICE), gate_up=gate_up.to(dtype).to(DEVICE),
                down=down.to(dtype).to(DEVICE), weights=weights.to(DEVICE), ids=ids.to(DEVICE))


def check_align(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """Every real slot exactly once, grouped by ascending expert, each group padded to a
    multiple of block_m with the sentinel T * k, unused blocks -1 at the end; sizes from
    shapes only. The kernel's output must equal the torch reference's, which must pass the
    same checks (so neither can agree with the other on a wrong answer)."""
    for align in (align_tokens_ref, align_tokens):
        check_align_with(align, ids, num_experts, block_m)
    out, ref = align_tokens(ids, num_experts, block_m), align_tokens_ref(ids, num_experts, block_m)
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


def check_align_with(align, ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    n = ids.numel()
    sorted_slots, block_expert, num_padded = align(ids, num_experts, block_m)
    num_blocks = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    assert sorted_slots.shape == (num_blocks * block_m,) and block_expert.shape == (num_blocks,)
    slots, blocks, used = sorted_slots.cpu(), block_expert.cpu(), int(num_padded)
    flat = ids.reshape(-1).cpu()
    real = slots[slots < n]
    assert torch.equal(real.sort().values, torch.arange(n, dtype=real.dtype))   # once each
    assert (slots[slots >= n] == n).all()                                       # sentinel
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert used == int(padded.sum()) and used % block_m == 0
    assert (slots[used:] == n).all() and (blocks[used // block_m:] == -1).all()
    expected_blocks = torch.repeat_interleave(torch.arange(num_experts), padded // block_m)
    assert torch.equal(blocks[:used // block_m].long(), expected_blocks)       # grouped
    for b, e in enumerate(expected_blocks.tolist()):
        tile = slots[b * block_m:(b + 1) * block_m].long()
        mine = tile[tile < n]
        assert (flat[mine] == e).all()                            # the block's expert only
        assert torch.equal(tile[:len(mine)], mine)                # real slots, then padding
        assert torch.equal(mine, mine.sort().values)              # stable: slot order kept


@pytest.mark.parametrize("num_experts,top_k,tokens,block_m", [
    (3, 1, 1, 16), (3, 3, 17, 16), (5, 2, 5, 4), (5, 4, 17, 8), (7, 2, 17, 16), (7, 4, 1, 1),
    (64, 8, 3, 16),                     # more experts than slots: most groups empty
    (128, 8, 131, 16),                  # Qwen3-30B-A3B's routing at a decode batch
    (6, 2, 700, 4),                     # more slots than one 1,024-slot chunk of the kernel
])
def test_align_tokens(num_experts: int, top_k: int, tokens: int, block_m: int) -> None:
    g = torch.Generator().manual_seed(num_experts * 100 + tokens)
    logits = torch.randn(tokens, num_experts, generator=g)
    ids = torch.topk(logits, top_k, dim=-1).indices.to(DEVICE)
    check_align(ids, num_experts, block_m)


def test_align_tokens_skewed_and_empty() -> None:
    ids = torch.zeros(17, 1, dtype=torch.int64, device=DEVICE)     # every token on expert 0
    check_align(ids, 5, 16)
    sorted_slots, block_expert, _ = align_tokens(ids, 5, 16)
    assert block_expert.tolist()[:2] == [0, 0] and (block_expert[2:] == -1).all()
    ids[::2] = 4                                                     # same shape, other data
    assert [t.shape for t in align_tokens(ids, 5, 16)[:2]] == [sorted_slots.shape,
                                                                block_expert.shape]
    check_align(ids, 5, 16)
    crowd = torch.ones(2100, 1, dtype=torch.int64, device=DEVICE)   # > 1,024 blocks, one expert
    check_align(crowd, 3, 1)
    empty = align_tokens(torch.empty(0, 2, dtype=torch.int64, device=DEVICE), 3, 16)
    assert empty[0].numel() == 0 and empty[1].numel() == 0 and int(empty[2]) == 0


@pytest.mark.parametrize("num_experts,top_k,tokens,norm", [
    case for case in itertools.product([3, 5, 7], [1, 2, 3, 4], [1, 5, 17], [True, False])
    if case[1] <= case[0]])
def test_fused_moe_matches_reference(num_experts: int, top_k: int, tokens: int,
                                     norm: bool) -> None:
    m = make_moe(num_experts, top_k, tokens, norm, seed=tokens * 10 + top_k)
    out = fused_moe(**m, **TILES)
    assert out.shape == (tokens, H) and out.dtype == torch.float32
    torch.testing.assert_close(out, moe_reference(**m), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiles", [dict(block_m=32, block_n=16, block_k=16),   # many k steps
                                   dict(block_m=64, block_n=64, block_k=64)])  # one tile each
def test_fused_moe_other_tiles(tiles: dict) -> None:
    m = make_moe(7, 3, 17, True, seed=11)
    torch.testing.assert_close(fused_moe(**m, **tiles), moe_reference(**m), atol=1e-5, rtol=1e-5)


def test_expert_without_tokens_default_config_and_strided_x() -> None:
    """Expert 2 never routed to (no block runs for it); default tiles (one partial tile per
    GEMM dimension); x a strided view of a wider buffer."""
    m = make_moe(5, 2, 17, True, seed=3, dead_expert=2)
    assert not (m["ids"] == 2).any()
    wide = torch.zeros(17, H + 16, device=DEVICE)
    wide[:, :H] = m["x"]
    m["x"] = wide[:, :H]
    ref = moe_reference(**m)
    torch.testing.assert_close(fused_moe(**m, **TILES), ref, atol=1e-5, rtol=1e-5)
    assert default_config(17 * 2)["block_m"] == 16
    torch.testing.assert_close(fused_moe(**m), ref, atol=1e-5, rtol=1e-5)


def test_every_token_on_one_expert_and_no_tokens() -> None:
    """Group longer than block_m (two blocks, the second partial); and T = 0."""
    m = make_moe(3, 1, 17, False, seed=4)
    m["ids"] = torch.ones_like(m["ids"])
    torch.testing.assert_close(fused_moe(**m, **TILES), moe_reference(**m), atol=1e-5, rtol=1e-5)
    e = make_moe(3, 2, 0, True)
    assert fused_moe(**e, **TILES).shape == (0, H)


@pytest.mark.parametrize("num_experts,top_k,tokens,norm", [(5, 2, 17, True), (7, 3, 5, False),
                                                           (3, 3, 1, True)])
def test_fused_moe_bfloat16(num_experts: int, top_k: int, tokens: int, norm: bool) -> None:
    """bf16 in and out, float32 accumulation; the kernel rounds where the reference does
    (gate, up, silu, product) but sums in another order: a few bf16 ulps of O(1) outputs.
    (Under the interpreter the dot widens bf16 tiles to float32, see kernels/fused_moe.py.)"""
    m = make_moe(num_experts, top_k, tokens, norm, seed=7, dtype=torch.bfloat16)
    out = fused_moe(**m, **TILES)
    assert out.dtype == torch.bfloat16
    ref = moe_reference(**m)
    exact = moe_reference(**{k: v.double() if v.is_floating_point() else v for k, v in m.items()})
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=2e-2)
    # no worse than the bf16 reference itself, against float64 math on the same inputs
    err, ref_err = (out.double() - exact).abs().max(), (ref.double() - exact).abs().max()
    assert err <= 2 * ref_err + 1e-2, (err, ref_err)


def fp8_experts(gate_up: torch.Tensor, down: torch.Tensor):
    """(e4m3 gate_up, e4m3 down, (scales [E, 2I], [E, H]), the dequantized stacks in float64)
    with a scale per output row (models/moe.py MoEExperts.quantize_fp8's layout)."""
    out, scales, dense = [], [], []
    for w in (gate_up, down):
        q, s = quantize_rows(w.float().reshape(-1, w.shape[2]))
        out.append(q.view(w.shape))
        scales.append(s.view(w.shape[:2]).contiguous())
        dense.append(q.view(w.shape).double() * s.view(w.shape[:2]).double()[..., None])
    return out[0], out[1], tuple(scales), dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_fp8_experts(dtype: torch.dtype) -> None:
    """e4m3 experts, widened in the kernel and scaled per output column, against float64
    math on the dequantized experts; bf16 no worse than the bf16 reference on them."""
    m = make_moe(5, 2, 17, True, seed=9, dtype=dtype)
    gu, dn, scales, (gu64, dn64) = fp8_experts(m["gate_up"], m["down"])
    out = fused_moe(m["x"], gu, dn, m["weights"], m["ids"], scales, **TILES)
    assert out.dtype == dtype
    exact = moe_reference(m["x"].double(), gu64, dn64, m["weights"].double(), m["ids"])
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    else:
        ref = moe_reference(m["x"], gu64.to(dtype), dn64.to(dtype), m["weights"], m["ids"])
        err, ref_err = (out.double() - exact).abs().max(), (ref.double() - exact).abs().max()
        assert err <= 2 * ref_err + 1e-2, (err, ref_err)
    plain = fused_moe(**m, **TILES)   # the quantization did something
    assert (out.double() - plain.double()).abs().max() > 1e-3


@pytest.mark.parametrize("top_k, norm, fp8", [(1, False, False), (3, True, False),
                                              (2, True, True)])
def test_sparse_moe_block_fused_path_matches_reference_path(top_k: int, norm: bool,
                                                            fp8: bool) -> None:
    """The model's MoE block as a GPU runs it (fused kernels; on CPU under the interpreter)
    against the reference path (torch router, moe_reference), same weights; fp8: after
    MoEExperts.quantize_fp8 (the CPU path dequantizes)."""
    from types import SimpleNamespace

    from models.moe import Qwen3MoeSparseMoeBlock
    from models.parallel import TPGroup
    cfg = SimpleNamespace(hidden_size=64, num_experts=7, num_experts_per_tok=top_k,
                          norm_topk_prob=norm, moe_intermediate_size=48, hidden_act="silu")
    block = Qwen3MoeSparseMoeBlock(cfg, TPGroup()).to(DEVICE)
    g = torch.Generator().manual_seed(top_k)
    with torch.no_grad():
        for p in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        x = torch.randn(19, 64, generator=g).to(DEVICE)
        if fp8:
            block.experts.quantize_fp8()
            assert block.experts.gate_up_proj.dtype == FP8
        weights, ids = route(block.gate(x), top_k, norm)
        ref = moe_reference(x, *block.experts.dense(x.dtype), weights, ids)
        if not x.is_cuda:                       # the CPU path is that reference
            torch.testing.assert_close(block(x), ref, rtol=1e-6, atol=1e-6)
        block.fused = True
        out = block(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
