"""FP8 KV cache: the quantization, the Triton store and attention kernels reading e4m3
pages, against the torch reference of the same quantization (CPU via the interpreter;
on CUDA with NANOSERVE_GPU_TESTS=1)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.attention import TorchBackend, TritonBackend, paged_attention_ref, store_kvcache_ref
from kernels.kv_quant import FP8_DTYPE, FP8_MAX, dequantize_ref, quantize_ref
from kernels.paged_attention import DecodeConfig, _e4m3_pairs_to_f16, paged_decode, paged_prefill
from kernels.store_kvcache import store_kvcache
from tests.test_kernels_attention import (DEVICE, INTERPRET, boundary_contexts, make_batch,
                                         run_rows, runs_of)
from triton_device import needs_triton

pytestmark = needs_triton


@triton.jit
def _widen_pairs_kernel(X, Even, Odd, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    even, odd = _e4m3_pairs_to_f16(tl.load(X + offs))
    tl.store(Even + offs, even)
    tl.store(Odd + offs, odd)


def test_e4m3_pairs_widen_exactly() -> None:
    """Every pair of e4m3 bytes (NaN aside) -> the two fp16 values torch's cast gives: the
    decode kernel's widening (PTX cvt on CUDA, moved bits in the interpreter)."""
    pairs = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).to(DEVICE)
    even, odd = torch.empty(1 << 16, dtype=torch.float16, device=DEVICE), torch.empty(
        1 << 16, dtype=torch.float16, device=DEVICE)
    _widen_pairs_kernel[((1 << 16) // 1024,)](pairs, even, odd, N=1024)
    ref = pairs.view(FP8_DTYPE).view(-1, 2).to(torch.float16)   # little-endian: low byte first
    finite = ~ref.isnan().any(dim=1)
    assert finite.sum() == 254 * 254
    torch.testing.assert_close(even[finite], ref[finite, 0], rtol=0, atol=0)
    torch.testing.assert_close(odd[finite], ref[finite, 1], rtol=0, atol=0)


def fp8_caches(b: dict) -> dict:
    """Replace the batch's caches by their fp8 quantization (every slot: cached prefixes)."""
    kc, vc = b["k_cache"], b["v_cache"]
    nb, bs = kc.shape[:2]
    for name, cache in (("k", kc), ("v", vc)):
        q, s = quantize_ref(cache.reshape(nb * bs, *cache.shape[2:]))
        b[f"{name}_cache"] = q.reshape(cache.shape)
        b[f"{name}_scale"] = s.reshape(nb, bs)
    return b


def test_quantize_ref_scale_and_error() -> None:
    g = torch.Generator().manual_seed(0)
    # rows with very different magnitudes, one all-zero row
    x = torch.randn(6, 4, 32, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1.0, 0.0])[:, None, None]
    q, s = quantize_ref(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (6,)
    assert torch.all(s > 0) and torch.isfinite(q.float()).all()
    amax = x.abs().amax(dim=(1, 2))
    assert torch.equal(q.float().abs().amax(dim=(1, 2))[:5], torch.full((5,), FP8_MAX))
    torch.testing.assert_close(s[:5], amax[:5] / FP8_MAX)
    back = dequantize_ref(q, s, torch.float32)
    assert torch.equal(back[5], torch.zeros(4, 32))
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step
    err = (back - x).abs()
    assert torch.all(err <= x.abs() * 2 ** -4 + s[:, None, None] * 2 ** -10)


@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (2, 64), (4, 128)])
def test_store_fp8_matches_ref(num_kv_heads: int, head_dim: int) -> None:
    bs = 4
    b = make_batch([(9, 9), (5, 2), (bs, 1)], bs, num_kv_heads, 1, head_dim)
    b["k"] = b["k"] * 50          # a row far from 1: scales matter
    b = fp8_caches(b)
    slots = b["meta"].slot_mapping.clone()
    slots[3] = -1                                           # skipped: stays untouched
    caches = {n: b[n].clone() for n in ("k_cache", "v_cache", "k_scale", "v_scale")}
    store_kvcache_ref(b["k"], b["v"], caches["k_cache"], caches["v_cache"], slots,
                      caches["k_scale"], caches["v_scale"])
    before = b["k_cache"].clone()
    store_kvcache(b["k"], b["v"], b["k_cache"], b["v_cache"], slots, b["k_scale"], b["v_scale"])
    for n in ("k_cache", "v_cache"):   # equal values (±0 may differ in sign, as bits)
        assert torch.equal(b[n].float(), caches[n].float()), n
    for n in ("k_scale", "v_scale"):
        assert torch.equal(b[n], caches[n]), n
    flat = b["k_cache"].view(-1, num_kv_heads, head_dim)
    skipped = b["meta"].slot_mapping[3].long()
    assert torch.equal(flat[skipped].float(), before.view(-1, num_kv_heads, head_dim)[skipped].float())
    written = slots[slots >= 0].long()
    assert not torch.equal(flat[written].float(), before.view(-1, num_kv_heads, head_dim)[written].float())


@pytest.mark.parametrize("block_size,head_dim,group", [(4, 32, 1), (16, 64, 2), (4, 128, 4)])
def test_decode_fp8_matches_ref(block_size: int, head_dim: int, group: int) -> None:
    ctxs = boundary_contexts(block_size)
    b = fp8_caches(make_batch([(c, 1) for c in ctxs], block_size, 2, group, head_dim))
    m = b["meta"]
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m, b["scale"],
                              b["k_scale"], b["v_scale"])
    for splits, cfg in ((1, None), (3, None), (1, DecodeConfig(block_n=16, num_warps=2)),
                        (3, DecodeConfig(block_n=16, num_warps=2))):   # block 16: one page a tile
        out = paged_decode(b["q"], b["k_cache"], b["v_cache"], m.block_tables, m.context_lens,
                           b["scale"], num_splits=splits, k_scale=b["k_scale"],
                           v_scale=b["v_scale"], config=cfg)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("group,num_splits", [(2, 1), (2, 3), (4, 3)])
def test_decode_runs_fp8_matches_ref(group: int, num_splits: int) -> None:
    """Runs of one sequence's decode rows (paged_decode's runs) over an fp8 cache."""
    seqs = runs_of(group)
    b = fp8_caches(make_batch(seqs, 4, 2, group, 32, seed=group))
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], b["meta"], b["scale"],
                              b["k_scale"], b["v_scale"])
    r = run_rows(b, seqs)
    out = paged_decode(b["q"], b["k_cache"], b["v_cache"], r["block_tables"], r["context_lens"],
                       b["scale"], num_splits=num_splits, k_scale=b["k_scale"],
                       v_scale=b["v_scale"], config=DecodeConfig(block_n=16, num_warps=2),
                       runs=r["runs"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size,head_dim,group", [(4, 32, 2), (16, 64, 1)])
def test_prefill_fp8_matches_ref(block_size: int, head_dim: int, group: int) -> None:
    seqs = [(3 * block_size + 1, 3 * block_size + 1), (2 * block_size, 1),
            (2 * block_size + 3, block_size)]                 # new, one token, cached prefix
    b = fp8_caches(make_batch(seqs, block_size, 2, group, head_dim))
    m = b["meta"]
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m, b["scale"],
                              b["k_scale"], b["v_scale"])
    out = paged_prefill(b["q"], b["k_cache"], b["v_cache"], m.block_tables, m.context_lens,
                        m.cu_seqlens_q, m.max_seqlen_q, b["scale"],
                        k_scale=b["k_scale"], v_scale=b["v_scale"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("decode", [True, False])
def test_backends_fp8_agree_and_stay_close_to_full_precision(decode: bool) -> None:
    """Store + attend through both backends on fp8 caches: same caches, close outputs; and
    the fp8 answer stays near the one over unquantized caches (the quantization is sane)."""
    seqs = [(17, 1), (33, 1), (5, 1)] if decode else [(17, 17), (20, 4)]
    # bf16 on the GPU; fp32 under the interpreter (its bf16 dot is not faithful)
    exact = make_batch(seqs, 16, 2, 2, 64, dtype=torch.float32 if INTERPRET else torch.bfloat16)
    b = fp8_caches({k: (v.clone() if torch.is_tensor(v) else v) for k, v in exact.items()})
    m = b["meta"]
    ref_caches = [b[n].clone() for n in ("k_cache", "v_cache", "k_scale", "v_scale")]
    ref = TorchBackend().forward(b["q"], b["k"], b["v"], *ref_caches[:2], m, b["scale"],
                                 *ref_caches[2:])
    out = TritonBackend().forward(b["q"], b["k"], b["v"], b["k_cache"], b["v_cache"], m,
                                  b["scale"], b["k_scale"], b["v_scale"])
    assert torch.equal(b["k_cache"].float(), ref_caches[0].float())
    assert torch.equal(b["v_scale"], ref_caches[3])
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    full = TorchBackend().forward(exact["q"], exact["k"], exact["v"], exact["k_cache"],
                                  exact["v_cache"], m, exact["scale"])
    rel = (out.float() - full.float()).norm() / full.float().norm()
    assert rel < 0.05, f"fp8 KV attention {rel:.3f} away from bf16 KV attention"


def test_fp8_rules() -> None:
    b = fp8_caches(make_batch([(5, 1)], 4, 1, 1, 16))
    m = b["meta"]
    with pytest.raises(AssertionError, match="scales"):
        paged_decode(b["q"], b["k_cache"], b["v_cache"], m.block_tables, m.context_lens, 1.0)
    from kernels.attention import FlashAttnBackend, select_backend
    with pytest.raises(ValueError, match="fp8"):
        FlashAttnBackend().forward(b["q"], b["k"], b["v"], b["k_cache"], b["v_cache"], m,
                                 1.0, b["k_scale"], b["v_scale"])
    assert select_backend("auto", DEVICE, kv_fp8=True).name == ("torch" if DEVICE == "cpu"
                                                                else "triton")
