"""Triton store_kvcache / paged attention vs the torch references, on CPU via the interpreter.

Sizes are tiny but ragged: several sequences per batch, context lengths at and around
block boundaries (k*bs, k*bs +- 1), q_len 1 inside prefill batches, prefix-cache hits
(context longer than the queried suffix), shuffled block ids, padded block tables.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.attention import (AttentionMetadata, TorchBackend, TritonBackend, decode_runs,
                               paged_attention_ref, select_backend, store_kvcache_ref)
from kernels.paged_attention import DecodeConfig, paged_decode, paged_prefill, rows_per_program
from kernels.store_kvcache import store_kvcache
from paged_kv import head_major

from triton_device import DEVICE, INTERPRET, needs_triton

pytestmark = needs_triton


def make_batch(seqs: list[tuple[int, int]], block_size: int, num_kv_heads: int, group: int,
               head_dim: int, dtype: torch.dtype = torch.float32, device: str = DEVICE,
               seed: int = 0) -> dict:
    """Build a step: seqs = [(context_len, q_len)]. The cache holds random values for every
    slot (the cached prefixes); k/v are the new tokens' keys/values; pages are shuffled."""
    g = torch.Generator().manual_seed(seed)
    pages = [(ctx + block_size - 1) // block_size for ctx, _ in seqs]
    num_blocks = sum(pages) + 3                                     # a few never-used blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[order.pop() for _ in range(n)] for n in pages]
    max_blocks = max(pages) + 1                                     # padding column of zeros
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables],
                                dtype=torch.int32)
    slots = []
    for (ctx, q_len), table in zip(seqs, tables):
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx - q_len, ctx)]
    q_lens = [q for _, q in seqs]
    ctxs = [c for c, _ in seqs]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)   # noqa: E731
    t = sum(q_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int32),
        block_tables=block_tables,
        context_lens=torch.tensor(ctxs, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0] + torch.tensor(ctxs).cumsum(0).tolist(), dtype=torch.int32),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(ctxs),
        is_decode=all(q == 1 for q in q_lens),
    )
    for name in ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q", "cu_seqlens_k"):
        setattr(meta, name, getattr(meta, name).to(device))
    return dict(q=rand(t, num_kv_heads * group, head_dim).to(device),
                k=rand(t, num_kv_heads, head_dim).to(device),
                v=rand(t, num_kv_heads, head_dim).to(device),
                k_cache=rand(*cache_shape).to(device), v_cache=rand(*cache_shape).to(device),
                meta=meta, scale=head_dim ** -0.5)


def boundary_contexts(bs: int) -> list[int]:
    return [1, bs - 1, bs, bs + 1, 3 * bs, 3 * bs - 1, 3 * bs + 1]


# (block_size, head_dim, group): the full product, and a covering subset for split-K.
ALL_CONFIGS = [(bs, hd, g) for bs in (4, 16) for hd in (16, 32, 64, 128) for g in (1, 2, 4)] + [
    (16, 80, 2)]   # a head dim the kernels pad to a power of two
CONFIGS = [(4, 16, 1), (4, 32, 4), (16, 64, 2), (16, 128, 1), (4, 128, 2), (16, 16, 4)]


@pytest.mark.parametrize("block_size,head_dim,group", ALL_CONFIGS)
def test_prefill_matches_ref(block_size: int, head_dim: int, group: int) -> None:
    bs = block_size
    seqs = [(bs + 1, bs + 1),            # full prompt, crosses a block boundary
            (3 * bs, 1),                 # q_len 1 inside a prefill batch, ctx at boundary
            (3 * bs + 1, 2 * bs - 1),    # prefix-cache hit: only the suffix is queried
            (bs - 1, bs - 1) if bs > 1 else (1, 1),
            (70, 37)]                    # several query tiles and key tiles
    b = make_batch(seqs, bs, num_kv_heads=2, group=group, head_dim=head_dim, seed=bs + head_dim)
    m = b["meta"]
    out = paged_prefill(b["q"], b["k_cache"], b["v_cache"], m.block_tables, m.context_lens,
                        m.cu_seqlens_q, m.max_seqlen_q, b["scale"])
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m, b["scale"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size,head_dim,group,num_splits",
                         [c + (1,) for c in ALL_CONFIGS] + [c + (3,) for c in CONFIGS])
def test_decode_matches_ref(block_size: int, head_dim: int, group: int, num_splits: int) -> None:
    seqs = [(c, 1) for c in boundary_contexts(block_size)] + [(130, 1)]
    b = make_batch(seqs, block_size, num_kv_heads=2, group=group, head_dim=head_dim, seed=group)
    m = b["meta"]
    out = paged_decode(b["q"], b["k_cache"], b["v_cache"], m.block_tables, m.context_lens,
                       b["scale"], num_splits=num_splits)
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m, b["scale"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_split_merge_in_kernel_is_the_merge_kernel(monkeypatch, fp8: bool) -> None:
    """The last split program's merge gives the merge kernel's bits (here, where both run
    the same arithmetic in the same order; on a GPU two compiled kernels may differ in a
    last bit: tests/gpu/test_kernels_gpu.py), re-arms its counters (a second call gives
    the same again), and zero-context padding rows stay zeros."""
    import kernels.paged_attention as pa
    seqs = [(c, 1) for c in (1, 15, 16, 17, 70)] + [(130, 1)]
    b = make_batch(seqs, 16, num_kv_heads=2, group=2, head_dim=32, seed=5)
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], b["meta"], b["scale"])
    if fp8:
        from tests.test_kernels_kv_fp8 import fp8_caches
        b = fp8_caches(b)
    m = b["meta"]
    ctx = m.context_lens.clone()
    ctx[1] = 0
    k, v, ks, vs = b["k_cache"], b["v_cache"], b.get("k_scale"), b.get("v_scale")
    call = lambda: paged_decode(b["q"], k, v, m.block_tables, ctx, b["scale"],  # noqa: E731
                                num_splits=4, k_scale=ks, v_scale=vs)
    fused = call()
    counters = pa._COUNTERS[fused.device]
    assert not counters.any()
    assert torch.equal(call(), fused)
    monkeypatch.setattr(pa, "_split_counters", lambda device, n: None)
    assert torch.equal(call(), fused)
    assert not fused[1].any()
    keep = torch.arange(len(seqs)) != 1
    tol = dict(atol=0.1, rtol=0.1) if fp8 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fused[keep], ref[keep], **tol)


def test_decode_split_at_eight_rows_takes_whole_page_tiles_and_matches_ref() -> None:
    """From SPLIT_WIDE_ROWS rows a split launch walks 64-key tiles: with 64-slot pages each
    tile is one page (one block-table load), contexts ending inside, at and past a page,
    and splits whose chunk rounds up to whole tiles (some splits left empty)."""
    from kernels.paged_attention import SPLIT_WIDE_ROWS, _tile_and_warps
    seqs = [(c, 1) for c in (1, 63, 64, 65, 130, 200, 257, 40)]
    assert len(seqs) == SPLIT_WIDE_ROWS
    assert _tile_and_warps(DecodeConfig(), 32, 3, len(seqs)) == (64, 2)
    assert _tile_and_warps(DecodeConfig(), 32, 3, len(seqs) - 1) == (32, 4)
    b = make_batch(seqs, 64, num_kv_heads=2, group=2, head_dim=32, seed=11)
    m = b["meta"]
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m, b["scale"])
    for splits in (3, 5):
        out = paged_decode(b["q"], b["k_cache"], b["v_cache"], m.block_tables, m.context_lens,
                           b["scale"], num_splits=splits)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size,block_n,num_splits", [(16, 16, 1), (32, 16, 1), (32, 16, 3)])
def test_decode_tiles_within_pages_match_ref(block_size: int, block_n: int,
                                              num_splits: int) -> None:
    """Pages holding whole key tiles (page 256 on GPUs): one block-table load per tile."""
    seqs = [(c, 1) for c in boundary_contexts(block_size)] + [(130, 1)]
    b = make_batch(seqs, block_size, num_kv_heads=2, group=2, head_dim=32, seed=block_size)
    m = b["meta"]
    out = paged_decode(b["q"], b["k_cache"], b["v_cache"], m.block_tables, m.context_lens,
                       b["scale"], num_splits=num_splits,
                       config=DecodeConfig(block_n=block_n, num_warps=2))
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m, b["scale"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def run_rows(b: dict, seqs: list[tuple[int, int]]) -> dict:
    """The queries of a make_batch prefill batch as decode rows, one per token (fast-forward
    tokens): each row its sequence's table and its own context length, plus their runs."""
    m = b["meta"]
    rows = np.repeat(np.arange(len(seqs)), [q for _, q in seqs])
    ctx = np.concatenate([np.arange(c - q + 1, c + 1) for c, q in seqs]).astype(np.int32)
    return dict(block_tables=m.block_tables[torch.from_numpy(rows).to(DEVICE)].contiguous(),
                context_lens=torch.from_numpy(ctx).to(DEVICE),
                runs=torch.from_numpy(decode_runs(rows)).to(DEVICE))


def runs_of(group: int) -> list[tuple[int, int]]:
    """(context, run length): a lone row, runs across page and split-tile boundaries, one
    longer than a program's rows (it is cut), one whose early rows see no key of the last
    split (16-key tiles, 3 splits: keys 64.. of context 70)."""
    per = rows_per_program(group)
    return [(9, 1), (13, 3), (3 * 4 + per + 2, per + 3), (70, 7), (33, 2)]


@pytest.mark.parametrize("group,num_splits", [(1, 1), (2, 1), (2, 3), (4, 3), (8, 3)])
def test_decode_runs_match_ref(group: int, num_splits: int) -> None:
    """Decode rows that are consecutive tokens of one sequence, attended by one program per
    run (paged_decode's runs), give what a causal prefill of those tokens gives, and what
    the same rows give one program each."""
    seqs = runs_of(group)
    b = make_batch(seqs, 4, num_kv_heads=2, group=group, head_dim=32, seed=group)
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], b["meta"], b["scale"])
    r = run_rows(b, seqs)
    cfg = DecodeConfig(block_n=16, num_warps=2)
    for runs in (r["runs"], None):
        out = paged_decode(b["q"], b["k_cache"], b["v_cache"], r["block_tables"],
                           r["context_lens"], b["scale"], num_splits=num_splits, config=cfg,
                           runs=runs)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("runs,num_splits", [(False, 1), (False, 3), (True, 1), (True, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_prologue_is_norm_rotary_then_store_then_decode(runs: bool, num_splits: int,
                                                               dtype: torch.dtype) -> None:
    """paged_decode's norm_rotary: from the projection's raw q, k, v the decode kernel
    gives what qk_norm_rotary (norm, rotation, K/V stored) then the plain decode give, bit
    for bit in the interpreter (compiled, the two kernels may contract the rotation's
    products into FMAs differently: within an ulp of fp32 there), and leaves the same cache: lone rows with a padding row (context 0, slot -1,
    stores nothing, zeros out), or fast-forward runs crossing page and split boundaries
    (each new key stored by the program whose split reads it; in head-major caches, the
    worker's). The raw heads stay as they were (nothing in place). A prologue that skipped
    the rotation fails the comparison."""
    from kernels.qk_norm_rotary import NormRotary, qk_norm_rotary
    group, d = 2, 32
    seqs = runs_of(group) if runs else [(9, 1), (13, 1), (70, 1), (33, 1), (1, 1)]
    b = make_batch(seqs, 4, num_kv_heads=2, group=group, head_dim=d, dtype=dtype, seed=7)
    m = b["meta"]
    if runs:
        r = run_rows(b, seqs)
        tables, ctx, row_runs = r["block_tables"], r["context_lens"], r["runs"]
        slots = m.slot_mapping
    else:   # a padding row last, as a CUDA graph's batch
        tables = torch.cat([m.block_tables, m.block_tables[:1]])
        ctx = torch.cat([m.context_lens, torch.zeros(1, dtype=torch.int32, device=DEVICE)])
        slots = torch.cat([m.slot_mapping, torch.full((1,), -1, dtype=torch.int32, device=DEVICE)])
        b["q"], b["k"], b["v"] = (torch.cat([t, t[:1]]) for t in (b["q"], b["k"], b["v"]))
        row_runs = None
    g = torch.Generator().manual_seed(8)
    qw, kw = ((1 + torch.randn(d, generator=g) / 4).to(dtype).to(DEVICE) for _ in range(2))
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.arange(80, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(DEVICE)
    raw = [b[n].clone() for n in ("q", "k", "v")]
    cfg = DecodeConfig(block_n=16, num_warps=2)
    if runs:
        b["k_cache"], b["v_cache"] = head_major(b["k_cache"]), head_major(b["v_cache"])

    caches = [b["k_cache"].clone(), b["v_cache"].clone()]
    q, k = qk_norm_rotary(raw[0].clone(), raw[1].clone(), qw, kw, 1e-6,
                          (ctx.long() - 1).clamp(min=0), cos_sin, v=raw[2], k_cache=caches[0],
                          v_cache=caches[1], slot_mapping=slots)
    want = paged_decode(q, *caches, tables, ctx, b["scale"], num_splits=num_splits, config=cfg,
                        runs=row_runs)

    def fused(cos_sin: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = [b["k_cache"].clone(), b["v_cache"].clone()]
        out = paged_decode(b["q"], *caches, tables, ctx, b["scale"], num_splits=num_splits,
                           config=cfg, runs=row_runs,
                           norm_rotary=NormRotary(b["k"], b["v"], qw, kw, 1e-6, cos_sin, slots))
        return out, caches
    out, ours = fused(cos_sin)
    same = (torch.equal if INTERPRET else
            lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6))
    assert same(out, want)
    assert same(ours[0], caches[0]) and same(ours[1], caches[1])
    assert all(torch.equal(b[n], t) for n, t in zip(("q", "k", "v"), raw))
    if not runs:
        assert (out[-1] == 0).all()
    unrotated = torch.cat([torch.ones_like(cos_sin[:, :d // 2]), torch.zeros_like(cos_sin[:, :d // 2])], -1)
    assert not torch.equal(fused(unrotated)[0], want)


def test_decode_runs_helper() -> None:
    assert decode_runs(np.array([3, 1, 2])) is None
    assert decode_runs(np.array([5, 5, 5, 2, 7, 7])).tolist() == [[0, 1, 2, 0, 0, 1],
                                                                  [3, 2, 1, 1, 2, 1]]


def test_prefill_tiles_within_pages_match_ref() -> None:
    """Prefill's 64-key tiles inside 64-token pages: the scalar page lookup, prefill side."""
    seqs = [(65, 65), (192, 1), (193, 70), (130, 130)]
    b = make_batch(seqs, 64, num_kv_heads=2, group=2, head_dim=16, seed=3)
    m = b["meta"]
    out = paged_prefill(b["q"], b["k_cache"], b["v_cache"], m.block_tables, m.context_lens,
                        m.cu_seqlens_q, m.max_seqlen_q, b["scale"])
    ref = paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m, b["scale"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_decode_zero_context_padding_gives_zeros() -> None:
    """CUDA-graph batches are padded with context_len 0 sequences: no NaN, zeros out."""
    b = make_batch([(5, 1), (9, 1)], 4, num_kv_heads=1, group=2, head_dim=16)
    m = b["meta"]
    ctx = torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out = paged_decode(b["q"], b["k_cache"], b["v_cache"], m.block_tables, ctx,
                           b["scale"], num_splits=splits)
        assert torch.isfinite(out).all() and (out[1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kvcache_matches_ref(dtype: torch.dtype) -> None:
    b = make_batch([(5, 5), (9, 2), (1, 1)], 4, num_kv_heads=3, group=1, head_dim=32, dtype=dtype)
    slots = b["meta"].slot_mapping.clone()
    slots[1] = -1                                                   # skipped token
    # k/v as strided views of a fused tensor, as a qkv projection would produce.
    kv = torch.randn(slots.shape[0], 2, 3, 32).to(dtype).to(DEVICE)
    k, v = kv[:, 0], kv[:, 1]
    kc_ref, vc_ref = b["k_cache"].clone(), b["v_cache"].clone()
    store_kvcache_ref(k, v, kc_ref, vc_ref, slots)
    store_kvcache(k, v, b["k_cache"], b["v_cache"], slots)
    assert torch.equal(b["k_cache"], kc_ref) and torch.equal(b["v_cache"], vc_ref)


@pytest.mark.parametrize("fp8", [False, True])
def test_head_major_cache_gives_what_token_major_gives(fp8: bool) -> None:
    """The kernels address the cache through its strides: storing, then prefill and decode
    over a head-major cache give exactly the token-major results."""
    from tests.test_kernels_kv_fp8 import fp8_caches
    b = make_batch([(9, 9), (13, 4), (8, 1)], 4, num_kv_heads=2, group=2, head_dim=32)
    b = fp8_caches(b) if fp8 else b
    m = b["meta"]
    names = ("k_cache", "v_cache", "k_scale", "v_scale") if fp8 else ("k_cache", "v_cache")
    hm = {n: head_major(b[n]) if n.endswith("cache") else b[n].clone() for n in names}
    assert hm["k_cache"].stride() != b["k_cache"].stride()
    results = []
    for c in (b, hm):
        scales = {n: c[n] for n in ("k_scale", "v_scale") if fp8}
        store_kvcache(b["k"], b["v"], c["k_cache"], c["v_cache"], m.slot_mapping, **scales)
        prefill = paged_prefill(b["q"], c["k_cache"], c["v_cache"], m.block_tables,
                                m.context_lens, m.cu_seqlens_q, m.max_seqlen_q, b["scale"],
                                **scales)
        last = b["q"][m.cu_seqlens_q[1:].long() - 1]           # each sequence's newest query
        decode = [paged_decode(last, c["k_cache"], c["v_cache"], m.block_tables, m.context_lens,
                               b["scale"], num_splits=n, **scales) for n in (1, 2)]
        results.append([c[n].float() for n in names] + [prefill] + decode)
    for ours, want in zip(*results):
        assert torch.equal(ours, want)
    ref = paged_attention_ref(b["q"], hm["k_cache"], hm["v_cache"], m, b["scale"],
                              *(hm[n] for n in ("k_scale", "v_scale") if fp8))
    torch.testing.assert_close(results[1][len(names)], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("seqs", [[(5, 5), (17, 17), (33, 9)], [(5, 1), (16, 1), (17, 1)]],
                         ids=["prefill", "decode"])
def test_triton_backend_matches_torch_backend(seqs: list[tuple[int, int]]) -> None:
    """End to end through forward(): store this step's k/v, then attend over the cache."""
    b = make_batch(seqs, 16, num_kv_heads=2, group=2, head_dim=32)
    caches = (b["k_cache"].clone(), b["v_cache"].clone())
    ref = TorchBackend().forward(b["q"], b["k"], b["v"], *caches, b["meta"], b["scale"])
    out = TritonBackend().forward(b["q"], b["k"], b["v"], b["k_cache"], b["v_cache"],
                                  b["meta"], b["scale"])
    assert torch.equal(b["k_cache"], caches[0]) and torch.equal(b["v_cache"], caches[1])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_triton_backend_decode_runs_store_then_attend() -> None:
    """Fast-forward rows through forward(): every row's k/v is stored before any row
    attends, so a run's later rows see its earlier rows' keys, as the torch backend does
    with a row each."""
    seqs = runs_of(2)
    b = make_batch(seqs, 4, num_kv_heads=2, group=2, head_dim=32, seed=5)
    r = run_rows(b, seqs)
    m = b["meta"]
    n = len(b["q"])
    meta = AttentionMetadata(
        slot_mapping=m.slot_mapping, block_tables=r["block_tables"],
        context_lens=r["context_lens"],
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        cu_seqlens_k=torch.zeros(n + 1, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=1, max_seqlen_k=m.max_seqlen_k, is_decode=True, decode_runs=r["runs"])
    caches = (b["k_cache"].clone(), b["v_cache"].clone())
    ref = TorchBackend().forward(b["q"], b["k"], b["v"], *caches, meta, b["scale"])
    out = TritonBackend(decode_splits=2).forward(b["q"], b["k"], b["v"], b["k_cache"],
                                                 b["v_cache"], meta, b["scale"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_select_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_backend("auto", "cpu").name == "torch"
    assert select_backend("torch", "cpu").name == "torch"
    if INTERPRET:
        assert select_backend("triton", "cpu").name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton"):
        select_backend("triton", "cpu")
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="unknown"):
        select_backend("xformers", "cpu")
    from kernels.flash_attn_backend import flash_attn_available
    if not flash_attn_available():
        with pytest.raises(ValueError, match="flash_attn"):
            select_backend("flash_attn", "cuda")
        assert select_backend("auto", "cuda").name == "triton"
