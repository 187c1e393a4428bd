"""Every Triton kernel vs its torch reference at Qwen3-0.6B sizes, on a CUDA GPU.

Qwen3-0.6B: 16 query heads, 8 kv heads, head_dim 128, hidden 1024; KV block size 256
(flash-attn's minimum page), bf16. Decode: batch 64, contexts up to ~4k (block-boundary
lengths included); prefill: a few ~1k prompts, some with cached prefixes. Plus a few
off-model shapes (block 16, GQA 1/4, head_dim 64, fp16) so the kernels are not only right
at one shape. Error is reported as max |out - ref| and ||out - ref|| / ||ref||.

    NANOSERVE_GPU_TESTS=1 pytest -m gpu tests/gpu/test_kernels_gpu.py -s   # checks
    python tests/gpu/test_kernels_gpu.py                # table: rel err + median time
"""
from __future__ import annotations

import itertools
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))   # standalone runs

import pytest
import torch

from kernels.attention import (AttentionMetadata, paged_attention_ref, select_backend,
                               store_kvcache_ref)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              # tests/conftest.py turns the interpreter on unless NANOSERVE_GPU_TESTS is set;
              # interpreted kernels would be slow and, for bf16 dots, wrong.
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="TRITON_INTERPRET=1: run with NANOSERVE_GPU_TESTS=1")]

HQ, HKV, D, BS, HIDDEN = 16, 8, 128, 256, 1024
REL_TOL = 1e-2          # bf16: ~3 significant digits per element, errors average out in the norm


@dataclass
class Case:
    kernel: str
    shape: str
    run: Callable[[], torch.Tensor | tuple]   # the kernel call (benchmarked as is)
    ref: Callable[[], torch.Tensor | tuple]
    bytes_moved: int = 0                       # for GB/s in the table; 0 = not shown


def make_batch(seqs: list[tuple[int, int]], block_size: int = BS, num_kv_heads: int = HKV,
               group: int = HQ // HKV, head_dim: int = D, dtype: torch.dtype = torch.bfloat16,
               seed: int = 0) -> dict:
    """seqs = [(context_len, q_len)] -> q/k/v, random caches with shuffled pages, metadata."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = [(ctx + block_size - 1) // block_size for ctx, _ in seqs]
    num_blocks = sum(pages) + 8
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [[order.pop() for _ in range(n)] for n in pages]
    max_blocks = max(pages)
    slots = []
    for (ctx, q_len), table in zip(seqs, tables):
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx - q_len, ctx)]
    q_lens, ctxs = [q for _, q in seqs], [c for c, _ in seqs]
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, **i32),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], **i32),
        context_lens=torch.tensor(ctxs, **i32),
        cu_seqlens_q=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), **i32),
        cu_seqlens_k=torch.tensor([0] + torch.tensor(ctxs).cumsum(0).tolist(), **i32),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(ctxs),
        is_decode=all(q == 1 for q in q_lens))
    rand = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)   # noqa: E731
    t, cache = sum(q_lens), (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(q=rand(t, num_kv_heads * group, head_dim), k=rand(t, num_kv_heads, head_dim),
                v=rand(t, num_kv_heads, head_dim), k_cache=rand(*cache), v_cache=rand(*cache),
                meta=meta, scale=head_dim ** -0.5, kv_tokens=sum(ctxs))


def decode_seqs(batch: int, max_ctx: int, seed: int = 0) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    edges = [1, BS - 1, BS, BS + 1, 4 * BS, max_ctx]
    ctx = edges + torch.randint(1, max_ctx + 1, (batch - len(edges),), generator=g).tolist()
    return [(c, 1) for c in ctx[:batch]]


PREFILL_SEQS = [(1024, 1024), (1024 + 300, 300), (2048, 1), (777, 777), (513, 257)]
PREFIX_FREE_SEQS = [(1024, 1024), (777, 777), (300, 300), (1, 1), (2000, 2000)]


def attention_cases() -> list[Case]:
    from kernels.paged_attention import default_num_splits, paged_decode, paged_prefill
    cases = []

    def decode_case(name: str, seqs, splits: int | None, **kw) -> Case:
        b = make_batch(seqs, **kw)
        m = b["meta"]
        n = splits or default_num_splits(m.num_seqs, b["k_cache"].shape[2], m.max_seqlen_k,
                                         b["q"].device)
        kv_bytes = 2 * b["kv_tokens"] * b["k_cache"][0, 0].numel() * b["k_cache"].element_size()
        return Case(f"{name} splits={n}",
                    f"B={m.num_seqs} ctx<={m.max_seqlen_k} " + _shape_tag(b),
                    lambda: paged_decode(b["q"], b["k_cache"], b["v_cache"], m.block_tables,
                                         m.context_lens, b["scale"], num_splits=n),
                    lambda: paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m, b["scale"]),
                    kv_bytes)

    def prefill_case(name: str, seqs, **kw) -> Case:
        b = make_batch(seqs, **kw)
        m = b["meta"]
        return Case(name, f"T={b['q'].shape[0]} seqs={m.num_seqs} " + _shape_tag(b),
                    lambda: paged_prefill(b["q"], b["k_cache"], b["v_cache"], m.block_tables,
                                          m.context_lens, m.cu_seqlens_q, m.max_seqlen_q,
                                          b["scale"]),
                    lambda: paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m, b["scale"]))

    cases.append(decode_case("paged_decode", decode_seqs(64, 4096), None))     # heuristic
    cases.append(decode_case("paged_decode", decode_seqs(64, 4096), 4))        # forced split-K
    cases.append(decode_case("paged_decode", decode_seqs(256, 1024), None))
    cases.append(decode_case("paged_decode", decode_seqs(8, 4096), None))      # split-K path
    cases.append(decode_case("paged_decode", decode_seqs(8, 4096), 1))
    cases.append(prefill_case("paged_prefill", PREFILL_SEQS))
    cases.append(prefill_case("paged_prefill", PREFIX_FREE_SEQS))
    from kernels import torch_varlen
    b = make_batch(PREFIX_FREE_SEQS, group=1)
    if torch_varlen.usable(b["q"], b["k"], b["scale"]):   # where the Triton backend uses it
        m = b["meta"]
        store_kvcache_ref(b["k"], b["v"], b["k_cache"], b["v_cache"], m.slot_mapping)
        cases.append(Case("torch varlen_attn prefill", f"T={b['q'].shape[0]} seqs={m.num_seqs} "
                          + _shape_tag(b),
                          lambda: torch_varlen.varlen_prefill(b["q"], b["k"], b["v"], m.cu_seqlens_q,
                                                              m.max_seqlen_q, b["scale"]),
                          lambda: paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], m,
                                                      b["scale"])))
    # Off-model shapes: small pages, other GQA ratios and head dims, fp16.
    for bs, hd, group, dtype in [(16, 128, 2, torch.bfloat16), (16, 64, 4, torch.float16),
                                 (256, 64, 1, torch.float16), (32, 128, 4, torch.bfloat16)]:
        kw = dict(block_size=bs, head_dim=hd, group=group, num_kv_heads=4, dtype=dtype)
        cases.append(decode_case("paged_decode", decode_seqs(16, 1500), 4, **kw))
        cases.append(prefill_case("paged_prefill", [(600, 600), (bs * 5, 1), (bs * 9 + 1, 70)],
                                  **kw))
    return cases


def _shape_tag(b: dict) -> str:
    _, hq, hd = b["q"].shape
    return (f"Hq={hq} Hkv={b['k_cache'].shape[2]} D={hd} bs={b['k_cache'].shape[1]} "
            f"{str(b['q'].dtype).removeprefix('torch.')}")


def store_case() -> Case:
    from kernels.store_kvcache import store_kvcache
    b = make_batch(PREFILL_SEQS + [(300, 1)] * 64)
    slots = b["meta"].slot_mapping.clone()
    slots[::7] = -1
    caches = (b["k_cache"].clone(), b["v_cache"].clone())

    def ref():
        store_kvcache_ref(b["k"], b["v"], *caches, slots)
        return caches

    def run():
        store_kvcache(b["k"], b["v"], b["k_cache"], b["v_cache"], slots)
        return b["k_cache"], b["v_cache"]

    moved = 4 * b["k"].numel() * b["k"].element_size()
    return Case("store_kvcache", f"T={slots.numel()} Hkv={HKV} D={D} bs={BS} bf16", run, ref, moved)


def norm_rotary_cases() -> list[Case]:
    from kernels.rmsnorm import rms_norm, rms_norm_ref
    from kernels.rotary import apply_rotary, apply_rotary_ref
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for t in (64, 4096):
        x = torch.randn(t, HIDDEN, generator=g, device="cuda").bfloat16()
        res = torch.randn(t, HIDDEN, generator=g, device="cuda").bfloat16()
        w = (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16()
        res_ref = res.clone()
        cases.append(Case("rms_norm", f"T={t} N={HIDDEN} bf16",
                          lambda x=x, w=w: rms_norm(x, w, 1e-6),
                          lambda x=x, w=w: rms_norm_ref(x, w, 1e-6), 2 * x.numel() * 2))
        # Residual run mutates `res`; the reference sees the first-call value (checked first).
        cases.append(Case("rms_norm+residual", f"T={t} N={HIDDEN} bf16",
                          lambda x=x, w=w, r=res: rms_norm(x, w, 1e-6, r),
                          lambda x=x, w=w, r=res_ref: rms_norm_ref(x, w, 1e-6, r),
                          4 * x.numel() * 2))
    qkv = torch.randn(4096, (HQ + 2 * HKV) * D, generator=g, device="cuda").bfloat16()
    qh = qkv[:, :HQ * D].view(-1, HQ, D)
    wq = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).bfloat16()
    cases.append(Case("rms_norm per-head (strided)", f"T=4096 H={HQ} D={D} bf16",
                      lambda: rms_norm(qh, wq, 1e-6), lambda: rms_norm_ref(qh, wq, 1e-6),
                      2 * qh.numel() * 2))

    inv_freq = 1.0 / 1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D)   # Qwen3 theta
    freqs = torch.arange(4096, device="cuda").float()[:, None] * inv_freq
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    positions = torch.randint(0, 4096, (4096,), generator=g, device="cuda")
    q = qkv[:, :HQ * D].view(-1, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(-1, HKV, D)
    q0, k0 = q.clone(), k.clone()

    def run_rotary():
        q.copy_(q0), k.copy_(k0)          # in place: restart from the same input every call
        return apply_rotary(q, k, positions, cache)

    cases.append(Case("apply_rotary (in place)", f"T=4096 Hq={HQ} Hkv={HKV} D={D} bf16",
                      run_rotary, lambda: apply_rotary_ref(q0, k0, positions, cache),
                      2 * (q.numel() + k.numel()) * 2))
    return cases


def flash_cases() -> list[Case]:
    """flash-attn backend (its own store + attention) vs the reference; [] if not importable."""
    from kernels.flash_attn_backend import flash_attn_available
    if not flash_attn_available():
        return []
    from tests.paged_kv import head_major
    cases = []
    for (name, seqs), layout in itertools.product(
            [("flash_attn decode", decode_seqs(64, 4096)), ("flash_attn prefill", PREFILL_SEQS)],
            ["", " (head-major cache, the worker's)"]):
        b = make_batch(seqs)
        if layout:
            b["k_cache"], b["v_cache"] = head_major(b["k_cache"]), head_major(b["v_cache"])
        backend = select_backend("flash_attn", "cuda")
        m = b["meta"]
        cases.append(Case(name + layout, f"T={b['q'].shape[0]} " + _shape_tag(b),
                          lambda b=b, m=m: backend.forward(b["q"], b["k"], b["v"], b["k_cache"],
                                                           b["v_cache"], m, b["scale"]),
                          lambda b=b, m=m: _ref_forward(b, m)))
    return cases


def _ref_forward(b: dict, m: AttentionMetadata) -> torch.Tensor:
    k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
    store_kvcache_ref(b["k"], b["v"], k_cache, v_cache, m.slot_mapping)
    return paged_attention_ref(b["q"], k_cache, v_cache, m, b["scale"])


def errors(out, ref) -> tuple[float, float]:
    """(max abs error, relative Frobenius error), worst over tuple outputs."""
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    worst = (0.0, 0.0)
    for o, r in zip(outs, refs):
        diff = (o.float() - r.float())
        rel = (diff.norm() / r.float().norm().clamp_min(1e-30)).item()
        worst = (max(worst[0], diff.abs().max().item()), max(worst[1], rel))
    return worst


def all_cases() -> list[Case]:
    return attention_cases() + [store_case()] + norm_rotary_cases() + flash_cases()


def _check(case: Case) -> tuple[float, float]:
    ref = case.ref()           # reference first: in-place kernels then start from the same input
    out = case.run()
    torch.cuda.synchronize()
    max_err, rel = errors(out, ref)
    print(f"{case.kernel:28s} {case.shape:48s} max_err={max_err:.3e} rel={rel:.3e}")
    return max_err, rel


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    return all_cases()


def test_attention_kernels(cases: list[Case]) -> None:
    failed = []
    for case in cases:
        key = f"{case.kernel} {case.shape}"
        if case.kernel.startswith(("paged_", "flash_attn")):
            max_err, rel = _check(case)
            assert max_err == max_err, key                                  # not NaN
            if rel > REL_TOL:
                failed.append((key, rel))
    assert not failed, failed


def test_store_norm_rotary_kernels(cases: list[Case]) -> None:
    for case in cases:
        key = f"{case.kernel} {case.shape}"
        if case.kernel.startswith("store"):
            assert _check(case)[0] == 0.0, key                              # a copy: exact
        elif case.kernel.startswith(("rms_norm", "apply_rotary")):
            assert _check(case)[1] < REL_TOL, key


def _variants(kernel) -> int:
    """How many compiled variants of a Triton kernel this GPU's cache holds."""
    dev = torch.cuda.current_device()
    return len(kernel.device_caches[dev][0]) if dev in kernel.device_caches else 0


def test_attention_compiles_once_across_block_table_widths() -> None:
    """A batch's block-table width (its longest context in pages) must not pick a new
    kernel variant: widths 1, 16 and 17 (Triton specializes ints equal to 1 and multiples
    of 16) run one compiled decode and one prefill kernel, so no request waits on a
    compile after startup."""
    from kernels.paged_attention import _decode_kernel, _prefill_kernel, paged_decode, paged_prefill
    before = {k: _variants(k) for k in (_decode_kernel, _prefill_kernel)}
    for pages in (1, 16, 17):
        ctx = pages * BS - 5
        b = make_batch([(ctx, 1), (40, 40)])
        m = b["meta"]
        assert m.block_tables.stride(0) == pages
        paged_prefill(b["q"], b["k_cache"], b["v_cache"], m.block_tables, m.context_lens,
                      m.cu_seqlens_q, m.max_seqlen_q, b["scale"])
        d = make_batch([(ctx, 1), (40, 1)])
        paged_decode(d["q"], d["k_cache"], d["v_cache"], d["meta"].block_tables,
                     d["meta"].context_lens, d["scale"], num_splits=1)
    torch.cuda.synchronize()
    new = {k.fn.__name__: _variants(k) - before[k] for k in before}
    assert all(n <= 1 for n in new.values()), new   # at most the first call compiles


def test_decode_split_counts_compile_once() -> None:
    """Eager decode picks its split count per batch (default_num_splits: 1 to 16). Split
    counts 2, 3, 5 and 16 must share one compiled decode kernel and one merge kernel (one
    split, no merge, is the only other decode variant), so no eager step waits on a
    compile after the first."""
    from kernels.paged_attention import _decode_kernel, _decode_merge_kernel, paged_decode
    before = {k: _variants(k) for k in (_decode_kernel, _decode_merge_kernel)}
    d = make_batch([(3000, 1), (700, 1), (40, 1)])
    m = d["meta"]
    ref = paged_attention_ref(d["q"], d["k_cache"], d["v_cache"], m, d["scale"])
    for splits in (1, 2, 3, 5, 16):
        out = paged_decode(d["q"], d["k_cache"], d["v_cache"], m.block_tables, m.context_lens,
                           d["scale"], num_splits=splits)
        assert errors(out, ref)[1] < REL_TOL, splits
    torch.cuda.synchronize()
    new = {k.fn.__name__: _variants(k) - before[k] for k in before}
    assert new["_decode_kernel"] <= 2 and new["_decode_merge_kernel"] <= 1, new


@pytest.mark.parametrize("batch", [1, 8])
def test_split_merge_in_kernel_under_graph_replays(monkeypatch, batch: int) -> None:
    """The last split program's merge (a counter per (row, kv head), re-armed by that
    program) gives the same bits on every one of 300 replays of a CUDA graph, within
    rounding of the merge kernel's (another compiled kernel: on an H200 2 of 16,384 values
    differ, by 2e-6): a missed release / acquire, a stale L1 line or a counter left armed
    would show as a row that differs, or is never written (NaN), on some replay."""
    import kernels.paged_attention as pa
    d = make_batch(decode_seqs(batch, 3000, seed=batch) if batch > 1 else [(2900, 1)])
    m = d["meta"]
    call = lambda out: pa.paged_decode(d["q"], d["k_cache"], d["v_cache"], m.block_tables,  # noqa: E731
                                       m.context_lens, d["scale"], num_splits=16, out=out)
    with monkeypatch.context() as p:
        p.setattr(pa, "_split_counters", lambda device, n: None)
        want = call(None)
    out = torch.zeros_like(want)
    call(out)                                    # eager: compiles, allocates the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    first, bad = None, 0
    for _ in range(300):
        out.fill_(float("nan"))
        graph.replay()
        if first is None:
            first = out.clone()
        bad += not torch.equal(out, first)
    torch.cuda.synchronize()
    diff = (first.float() - want.float()).abs()
    print(f"batch {batch}: {int((diff > 0).sum())} of {diff.numel()} values differ from the "
          f"merge kernel's, by at most {diff.max().item():.3g}")
    assert bad == 0, f"{bad} of 300 replays differ from the first"
    assert errors(first, want)[1] < 1e-3
    assert not pa._COUNTERS[out.device].any()


def test_flash_attn_backend_selected_by_auto() -> None:
    from kernels.flash_attn_backend import flash_attn_available
    if not flash_attn_available():
        pytest.skip("flash_attn not importable")
    assert select_backend("auto", "cuda").name == "flash_attn"


def test_auto_times_both_backends_at_qwen3_shapes(caplog: pytest.LogCaptureFixture) -> None:
    """What the worker's `auto` does at startup: time flash_attn and triton, keep the faster."""
    import logging
    from kernels.backend_choice import AttentionShapes, time_backends
    from kernels.flash_attn_backend import flash_attn_available
    if not flash_attn_available():
        pytest.skip("flash_attn not importable")
    shapes = AttentionShapes(HQ, HKV, D, torch.bfloat16, BS)
    times = time_backends({n: select_backend(n, "cuda") for n in ("flash_attn", "triton")},
                          shapes, torch.device("cuda"))
    print(f"decode + prefill step: {times}")
    assert all(0 < t < 0.1 for t in times.values()), times
    with caplog.at_level(logging.INFO, logger="nanoserve.attention"):
        chosen = select_backend("auto", "cuda", shapes=shapes).name
    assert chosen in times and f"auto -> {chosen}" in caplog.text


def main() -> None:
    import triton
    import triton.testing
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    print(f"{'kernel':28s} | {'shape':48s} | {'max err':>9s} | {'rel err':>9s} | "
          f"{'median us':>9s} | {'GB/s':>6s}")
    print("-" * 125)
    worst = 0.0
    for case in all_cases():
        ref = case.ref()
        out = case.run()
        torch.cuda.synchronize()
        max_err, rel = errors(out, ref)
        tol = 0.0 if case.kernel.startswith("store") else REL_TOL
        worst = max(worst, rel)
        ms = triton.testing.do_bench(case.run, warmup=25, rep=100, return_mode="median")
        gbs = f"{case.bytes_moved / ms / 1e6:6.0f}" if case.bytes_moved else "-"
        flag = "" if rel <= tol and max_err == max_err else "  FAIL"
        print(f"{case.kernel:28s} | {case.shape:48s} | {max_err:9.2e} | {rel:9.2e} | "
              f"{ms * 1e3:9.1f} | {gbs:>6s}{flag}")
    from kernels.flash_attn_backend import flash_attn_available
    print(f"# flash_attn importable: {flash_attn_available()}; worst rel err {worst:.2e} "
          f"(tolerance {REL_TOL:g})")


if __name__ == "__main__":
    main()
