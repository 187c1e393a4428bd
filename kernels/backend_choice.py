"""`auto` attention backend on a GPU: time the candidates on the model's shapes, keep the fastest.

flash_attn and triton are both exact enough everywhere they run (tests/gpu/test_kernels_gpu.py);
which one is faster depends on the shapes and the GPU. On an H100 at Qwen3-0.6B shapes Triton's
paged decode took 213 us vs flash-attn's 234 us (batch 64, contexts <= 4k) while flash-attn's
prefill took 92 us vs 98 us (tests/gpu/RESULTS.md), so auto measures one decode step plus one
prefill step of each, at startup (well under a second after Triton's first compile), instead
of guessing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionShapes:
    """One rank's attention layer: what the backends are timed on."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 256


# A mid-size serving step: 64 sequences decoding at 1k context, and a 4 x 512-token prefill.
DECODE_SEQS = [(1024, 1)] * 64
PREFILL_SEQS = [(512, 512)] * 4


def make_step(shapes: AttentionShapes, seqs: list[tuple[int, int]], device: torch.device,
              seed: int = 0) -> dict:
    """Random q/k/v and paged caches for seqs = [(context_len, q_len)], pages laid out in order."""
    g = torch.Generator(device=device).manual_seed(seed)
    bs = shapes.block_size
    pages = [-(-ctx // bs) for ctx, _ in seqs]
    starts = [sum(pages[:i]) for i in range(len(pages))]
    i32 = dict(dtype=torch.int32, device=device)
    slots = [(start + p // bs) * bs + p % bs
             for (ctx, q_len), start in zip(seqs, starts) for p in range(ctx - q_len, ctx)]
    q_lens, ctxs = [q for _, q in seqs], [c for c, _ in seqs]
    cumsum = lambda xs: torch.tensor([sum(xs[:i]) for i in range(len(xs) + 1)], **i32)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, **i32),
        block_tables=torch.tensor([[s + j for j in range(max(pages))] for s in starts], **i32),
        context_lens=torch.tensor(ctxs, **i32), cu_seqlens_q=cumsum(q_lens),
        cu_seqlens_k=cumsum(ctxs), max_seqlen_q=max(q_lens), max_seqlen_k=max(ctxs),
        is_decode=all(q == 1 for q in q_lens), prefix_free=all(q == c for c, q in seqs))
    rand = lambda *s: torch.randn(*s, generator=g, device=device).to(shapes.dtype)  # noqa: E731
    t, hkv, d = sum(q_lens), shapes.num_kv_heads, shapes.head_dim
    cache = (sum(pages) + max(pages), bs, hkv, d)   # spare pages: the padded table entries
    return dict(q=rand(t, shapes.num_heads, d), k=rand(t, hkv, d), v=rand(t, hkv, d),
                k_cache=rand(*cache), v_cache=rand(*cache), meta=meta, scale=d ** -0.5)


def step_seconds(backend, step: dict, device: torch.device, iters: int = 5) -> float:
    """Mean wall time of backend.forward on `step`, after one warm-up call (Triton compiles)."""
    def run():
        backend.forward(step["q"], step["k"], step["v"], step["k_cache"], step["v_cache"],
                        step["meta"], step["scale"])

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    run()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    sync(device)
    return (time.perf_counter() - t0) / iters


def time_backends(backends: dict, shapes: AttentionShapes, device: torch.device,
                  decode_seqs=DECODE_SEQS, prefill_seqs=PREFILL_SEQS) -> dict[str, float]:
    """{name: seconds for one decode step + one prefill step} at `shapes`."""
    steps = [make_step(shapes, decode_seqs, device), make_step(shapes, prefill_seqs, device, seed=1)]
    times = {name: sum(step_seconds(b, s, device) for s in steps) for name, b in backends.items()}
    del steps
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times
