"""A decoder's whole decode step (after the embedding lookup, up to the LM head's logits) in
one persistent Triton kernel: a few programs per SM (as many as fit at once) walk the step
phase by phase, and a phase waits on a counter in global memory for the tiles of the phase
before (DESIGN.md, Small steps).

Why: at batch 1-8 a step costs its launches and their bubbles, not its bytes (Qwen3-0.6B: 229
kernels, 3.5x the weight-read floor on an H200). Here the step is one launch (plus the
embedding gather and a counter reset), and what a per-op step loses between kernels is
spent streaming weights: a program loads its first weight chunk of a phase *before* waiting
for the phase's inputs, and chunk i + 1 while it computes chunk i (8 x 1024 bf16 = 16 KiB a
program at batch 1).

Where it stands (tests/gpu/RESULTS.md, "The persistent decode kernel"): correct, but at
Qwen3-0.6B on an H200 a step takes 1.2 ms against the per-op CUDA graph's 0.88 ms. The
kernel's own clocks (NANOSERVE_PERSISTENT_PROFILE=1, `profile`) put ~5 us a phase above
its bytes: the chain of a counter's release, the pollers' acquire, the activations' load
and the last tile's store, five times a layer; attention, with its split merge, ~10 us a
layer. So the runner keeps the per-op path unless --small-batch-kernel persistent is asked.

Phases, per layer (program p takes tiles p, p + P, ...; a counter per (layer, phase) counts
finished tiles, and the next phase waits until it holds them all):
  0 QKV   input RMSNorm and the fused q|k|v projection, BN output columns a tile
  1 ATTN  split-KV attention: one task per (row, kv head, split of the row's context): q/k
          RMSNorm per head, rotary, the new K/V stored (by the row's last split), partial
          softmax sums; the split that finishes a (row, kv head) last merges its splits
          (a per-(row, head) counter says which) and counts one for the phase
  2 O     o_proj, added to the residual stream
  3 GLU   post-attention RMSNorm, gate and up rows, SiLU(gate) * up
  4 DOWN  down_proj, added to the residual stream
then the LM head: the final RMSNorm and BN vocabulary rows a tile. Every wait is for tiles of
earlier phases, which programs reach without waiting on later ones: with all P programs
resident (`_programs` sizes P from the compiled kernel's registers) the waits end. The Triton interpreter runs programs
one after another, so there P = 1 and every wait is already met when it is reached.

Numerics follow the per-op path's roundings: activations, norm outputs, projections and the
residual stream are rounded to the model's dtype where the per-op path stores them, and
accumulated in float32 in between. Covered: dense Qwen3 / Qwen2 / Llama layers without
biases, bf16 / fp16 / fp32 weights and KV cache, one rank, no adapters, one token a row;
the executor (worker_service/persistent_executor.py) declines the rest.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

# per layer in the pointer table: the weights, then the layer's K and V caches
W_QKV, W_O, W_GATE_UP, W_DOWN, N_IN, N_POST, N_Q, N_K, K_CACHE, V_CACHE = range(10)
TABLE_WIDTH = 10
PHASES = 5
MAX_ROWS = 8
MAX_SPLITS = 32          # attention splits of one (row, kv head)
BT = 32                  # context tokens an attention loop iteration reads (splits are multiples;
                         # fewer where a KV block holds fewer)
# (the kernels' copies: Triton reads only constexpr globals)
_SPLITS, _ROWS = tl.constexpr(MAX_SPLITS), tl.constexpr(MAX_ROWS)
# attention tasks a step aims at with one program (the interpreter): several splits a row, so
# that CPU tests run the split merge the GPU runs
INTERPRETER_TASKS = 64
STORE, ADD, GLU = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# a weight chunk is [BN, BK]: BN output rows (BLOCK_N; half of it for each of gate and up),
# BK columns (see _block_k); NANOSERVE_PERSISTENT_* to sweep them on a GPU (on an H200 at
# 0.6B: 8 x 1024, 4 warps, up to 4 programs an SM measured best of 16 or 8 rows, 512
# columns, 8 warps)
BLOCK_N = int(os.environ.get("NANOSERVE_PERSISTENT_BLOCK_N", "8"))
LM_BLOCK_N = int(os.environ.get("NANOSERVE_PERSISTENT_LM_BLOCK_N", str(BLOCK_N)))
BLOCK_K = int(os.environ.get("NANOSERVE_PERSISTENT_BLOCK_K", "1024"))
NUM_WARPS = int(os.environ.get("NANOSERVE_PERSISTENT_WARPS", "4"))
CTAS = int(os.environ.get("NANOSERVE_PERSISTENT_CTAS", "4"))   # programs an SM, where they fit
PROFILE = os.environ.get("NANOSERVE_PERSISTENT_PROFILE") == "1"   # clocks per phase (GPU only)


@dataclass(frozen=True)
class Dims:
    """A model's shapes, as the kernel's compile-time constants."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    block_size: int
    max_blocks: int          # width of the block-table rows
    qk_norm: bool
    eps: float
    scale: float             # softmax scale


@dataclass
class Workspace:
    """The step's float32 activations between phases, attention's partial sums, and the
    counters (one a phase and layer, then one a (row, kv head)), for up to MAX_ROWS rows."""
    resid: torch.Tensor      # [MAX_ROWS, hidden]: the residual stream (the embeddings first)
    qkv: torch.Tensor        # [MAX_ROWS, (heads + 2 kv_heads) head_dim]
    attn: torch.Tensor       # [MAX_ROWS, heads head_dim]
    act: torch.Tensor        # [MAX_ROWS, intermediate]
    part_acc: torch.Tensor   # [MAX_ROWS kv_heads MAX_SPLITS, heads / kv_heads, head_dim]
    part_ml: torch.Tensor    # [MAX_ROWS kv_heads MAX_SPLITS, heads / kv_heads, 2]: max, sum
    counters: torch.Tensor   # [layers * PHASES + MAX_ROWS * kv_heads + 1] int32
    prof: torch.Tensor | None = None   # [1024 programs, 1024] int64 clocks (see `profile`)

    @classmethod
    def allocate(cls, d: Dims, device: torch.device) -> "Workspace":
        f32 = dict(dtype=torch.float32, device=device)
        g = triton.next_power_of_2(max(d.heads // d.kv_heads, 1))
        parts = MAX_ROWS * d.kv_heads * MAX_SPLITS
        return cls(torch.zeros(MAX_ROWS, d.hidden, **f32),
                   torch.zeros(MAX_ROWS, (d.heads + 2 * d.kv_heads) * d.head_dim, **f32),
                   torch.zeros(MAX_ROWS, d.heads * d.head_dim, **f32),
                   torch.zeros(MAX_ROWS, d.intermediate, **f32),
                   torch.zeros(parts, g, d.head_dim, **f32),
                   torch.zeros(parts, g, 2, **f32),
                   torch.zeros(d.layers * PHASES + MAX_ROWS * d.kv_heads + 1, dtype=torch.int32,
                               device=device),
                   torch.zeros(1024, 1024, dtype=torch.int64, device=device) if PROFILE else None)


@triton.jit
def _wait(counter, target):
    """Spin until `counter` reaches `target` (acquire: what its tiles wrote is visible).
    (Triton runs a scalar atomic in one thread and hands its value to all through a
    barrier, so every thread is past the acquire; per-thread ld.acquire polls measured no
    faster on an H200, and plain volatile polls broke that ordering.)"""
    seen = tl.atomic_add(counter, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire")


@triton.jit
def _done(counter):
    """This program's tile is written: count it (release, after every thread's stores)."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release")


@triton.jit
def _stamp(Prof, i, PROFILE: tl.constexpr):
    """Where PROFILE: the GPU's clock (ns) as this program ends phase i (see `profile`)."""
    if PROFILE:
        tl.store(Prof + tl.program_id(0) * 1024 + i, globaltimer())


@triton.jit
def _weight(Table, layer, j, DT: tl.constexpr):
    return tl.load(Table + layer * 10 + j).to(tl.pointer_type(DT))


@triton.jit
def _round(x, DT: tl.constexpr):
    """x as the per-op path stores it (in the model's dtype), back in float32."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _rstd(X, M, K: tl.constexpr, eps, XP: tl.constexpr, BK: tl.constexpr):
    """1 / RMS of each of the M rows of X [XP, K] (float32, written by other programs)."""
    rows = tl.arange(0, XP)
    acc = tl.zeros([XP, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(X + rows[:, None] * K + cols[None, :], mask=rows[:, None] < M, other=0.0,
                    cache_modifier=".cg")
        acc += x * x
    return 1.0 / tl.sqrt(tl.sum(acc, 1) / K + eps)


@triton.jit
def _weights(W, tile, kc, live, N: tl.constexpr, K: tl.constexpr, MODE: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):
    """Weight rows tile * BN.. (and, for GLU, the up rows N further), columns kc * BK..; all
    masked off where not `live` (no memory traffic)."""
    n = tile * BN + tl.arange(0, BN)
    k = kc * BK + tl.arange(0, BK)
    ptr = W + n[:, None] * K + k[None, :]
    m = (n[:, None] < N) & live
    a = tl.load(ptr, mask=m, other=0.0, eviction_policy="evict_first")
    if MODE == GLU:
        b = tl.load(ptr + N * K, mask=m, other=0.0, eviction_policy="evict_first")
    else:
        b = a
    return a, b


@triton.jit
def _activations(X, M, K: tl.constexpr, kc, live, MP: tl.constexpr, BK: tl.constexpr):
    """Columns kc * BK.. of X's first M rows [MP, BK], float32 (zeros past M)."""
    rows = tl.arange(0, MP)
    k = kc * BK + tl.arange(0, BK)
    return tl.load(X + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & live,
                   other=0.0, cache_modifier=".cg")


@triton.jit
def _projection(X, M, K: tl.constexpr, W, N: tl.constexpr, Norm, eps, Y, Wait, target, Done,
                MODE: tl.constexpr, NORM: tl.constexpr, DT: tl.constexpr, MP: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):
    """This program's tiles of y = x @ W.T for x = X's first M rows (RMS-normalized by Norm
    and rounded where NORM), once Wait holds target; MODE STORE: Y = y, ADD: Y += y,
    GLU: Y = SiLU(gate) * up (W: N gate rows, then N up rows; a tile is BN of each). Each
    tile is counted on Done. The first weight chunk is loaded before the wait, chunk i + 1
    (weights and activations) while chunk i is used; products accumulate in a
    [rows, BN, BK] tile reduced once a tile (kernels/gemv.py's shape: on an H200 a
    reduction a chunk made batch 8 2.7x slower)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    NT: tl.constexpr = (N + BN - 1) // BN
    KC: tl.constexpr = K // BK
    chunks = tl.maximum((NT - pid + P - 1) // P, 0) * KC
    wa, wb = _weights(W, pid, 0, chunks > 0, N, K, MODE, BN, BK)
    _wait(Wait, target)
    rows = tl.arange(0, MP)
    x = _activations(X, M, K, 0, chunks > 0, MP, BK)
    if NORM:
        if KC == 1:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / K + eps)
        else:
            rstd = _rstd(X, M, K, eps, MP, BK)
    acc_a = tl.zeros([MP, BN, BK], dtype=tl.float32)
    acc_b = tl.zeros([MP, BN, BK], dtype=tl.float32)
    for i in range(chunks):
        tile = pid + (i // KC) * P
        kc = i % KC
        na, nb = _weights(W, pid + ((i + 1) // KC) * P, (i + 1) % KC, i + 1 < chunks, N, K,
                          MODE, BN, BK)
        nx = _activations(X, M, K, (i + 1) % KC, i + 1 < chunks, MP, BK)
        if NORM:
            g = tl.load(Norm + kc * BK + tl.arange(0, BK)).to(tl.float32)
            x = _round(x * rstd[:, None] * g[None, :], DT)
        acc_a += wa.to(tl.float32)[None, :, :] * x[:, None, :]
        if MODE == GLU:
            acc_b += wb.to(tl.float32)[None, :, :] * x[:, None, :]
        if kc == KC - 1:
            ya = tl.sum(acc_a, 2)
            n = tile * BN + tl.arange(0, BN)
            ptr = Y + rows[:, None] * N + n[None, :]
            keep = (rows[:, None] < M) & (n[None, :] < N)
            if MODE == STORE:
                tl.store(ptr, _round(ya, DT), mask=keep)
            elif MODE == ADD:
                old = tl.load(ptr, mask=keep, other=0.0, cache_modifier=".cg")
                tl.store(ptr, _round(old + _round(ya, DT), DT), mask=keep)
            else:
                gate = _round(ya, DT)
                up = _round(tl.sum(acc_b, 2), DT)
                tl.store(ptr, _round(gate / (1.0 + tl.exp(-gate)) * up, DT), mask=keep)
            _done(Done)
            acc_a = tl.zeros([MP, BN, BK], dtype=tl.float32)
            acc_b = tl.zeros([MP, BN, BK], dtype=tl.float32)
        wa = na
        wb = nb
        x = nx


@triton.jit
def _head_rms(x1, x2, w1, w2, eps, D: tl.constexpr, DT: tl.constexpr):
    """RMSNorm of heads given as halves [G, D/2] (the per-head q/k norm)."""
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
    return _round(x1 * rstd[:, None] * w1[None, :], DT), _round(x2 * rstd[:, None] * w2[None, :], DT)


@triton.jit
def _rotated(x1, x2, Wn, cos, sin, eps, NORM: tl.constexpr, D: tl.constexpr,
             DT: tl.constexpr):
    """Heads [G, D/2] x 2 after their RMSNorm (where NORM) and rotary, rounded."""
    H2: tl.constexpr = D // 2
    if NORM:
        d = tl.arange(0, H2)
        x1, x2 = _head_rms(x1, x2, tl.load(Wn + d).to(tl.float32),
                           tl.load(Wn + H2 + d).to(tl.float32), eps, D, DT)
    return _round(x1 * cos - x2 * sin, DT), _round(x2 * cos + x1 * sin, DT)


@triton.jit
def _attention(Table, layer, QKV, Attn, PartAcc, PartML, Counters, HeadDone, Positions, Slots,
               ctx_all, split, n_splits, BlockTables, CosSin, eps, scale, M, sb, so, sh,
               DT: tl.constexpr, KV_DT: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr,
               D: tl.constexpr, QK_NORM: tl.constexpr, BS: tl.constexpr, MAXB: tl.constexpr,
               MP: tl.constexpr, GP: tl.constexpr, NT0: tl.constexpr, BT: tl.constexpr):
    """This program's (row, kv head, split) tasks of the layer's attention; see the module
    docstring. A row's splits are `split` tokens each (its last split holds the new token);
    rows with no context (a CUDA graph's padding) still take one split, of nothing."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    G: tl.constexpr = HQ // HK
    H2: tl.constexpr = D // 2
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    rows = tl.arange(0, MP)
    h = tl.arange(0, GP)
    hm = h < G
    d = tl.arange(0, H2)
    tasks = M * HK * n_splits
    if pid < tasks:
        _wait(Counters + layer * 5 + 0, NT0)
    Kc = _weight(Table, layer, 8, KV_DT)
    Vc = _weight(Table, layer, 9, KV_DT)
    for task in range(pid, tasks, P):
        m = task // (HK * n_splits)
        g = (task // n_splits) % HK
        s = task % n_splits
        ctx = tl.sum(tl.where(rows == m, ctx_all, 0), 0)
        ns = tl.maximum((ctx + split - 1) // split, 1)
        if s < ns:
            pos = tl.load(Positions + m)
            cos = tl.load(CosSin + pos * D + d)[None, :]
            sin = tl.load(CosSin + pos * D + H2 + d)[None, :]
            row = QKV + m * NQKV
            qp = row + (g * G + h)[:, None] * D + d[None, :]
            q1 = tl.load(qp, mask=hm[:, None], other=0.0, cache_modifier=".cg")
            q2 = tl.load(qp + H2, mask=hm[:, None], other=0.0, cache_modifier=".cg")
            q1, q2 = _rotated(q1, q2, _weight(Table, layer, 6, DT), cos, sin, eps, QK_NORM, D, DT)
            if s == ns - 1:   # the new token's K/V, into the cache this split then reads
                kp = row + HQ * D + g * D + d[None, :]
                k1, k2 = _rotated(tl.load(kp, cache_modifier=".cg"),
                                  tl.load(kp + H2, cache_modifier=".cg"),
                                  _weight(Table, layer, 7, DT), cos, sin, eps, QK_NORM, D, DT)
                v = tl.load(row + (HQ + HK) * D + g * D + tl.arange(0, D), cache_modifier=".cg")
                slot = tl.load(Slots + m).to(tl.int64)
                kv_row = (slot // BS) * sb + (slot % BS) * so + g * sh
                keep = slot >= 0   # (a CUDA graph's padding rows store nothing)
                tl.store(Kc + kv_row + d[None, :], k1.to(KV_DT), mask=keep)
                tl.store(Kc + kv_row + H2 + d[None, :], k2.to(KV_DT), mask=keep)
                tl.store(Vc + kv_row + tl.arange(0, D), v.to(KV_DT), mask=keep)
                tl.debug_barrier()
            m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([GP], dtype=tl.float32)
            acc1 = tl.zeros([GP, H2], dtype=tl.float32)
            acc2 = tl.zeros([GP, H2], dtype=tl.float32)
            end = tl.minimum(s * split + split, ctx)
            for t0 in range(s * split, end, BT):
                t = t0 + tl.arange(0, BT)
                live = t < end
                blk = tl.load(BlockTables + m * MAXB + t // BS, mask=live, other=0).to(tl.int64)
                at = blk * sb + (t % BS) * so + g * sh
                kb1 = tl.load(Kc + at[:, None] + d[None, :], mask=live[:, None], other=0.0,
                              cache_modifier=".cg").to(tl.float32)
                kb2 = tl.load(Kc + at[:, None] + H2 + d[None, :], mask=live[:, None], other=0.0,
                              cache_modifier=".cg").to(tl.float32)
                vb1 = tl.load(Vc + at[:, None] + d[None, :], mask=live[:, None], other=0.0,
                              cache_modifier=".cg").to(tl.float32)
                vb2 = tl.load(Vc + at[:, None] + H2 + d[None, :], mask=live[:, None], other=0.0,
                              cache_modifier=".cg").to(tl.float32)
                sc = (tl.sum(q1[:, None, :] * kb1[None, :, :], 2)
                      + tl.sum(q2[:, None, :] * kb2[None, :, :], 2)) * scale
                sc = tl.where(live[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(sc - m_new[:, None])
                acc1 = acc1 * alpha[:, None] + tl.sum(p[:, :, None] * vb1[None, :, :], 1)
                acc2 = acc2 * alpha[:, None] + tl.sum(p[:, :, None] * vb2[None, :, :], 1)
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
            part = (m * HK + g) * _SPLITS
            pa = PartAcc + (part + s) * (GP * D) + h[:, None] * D + d[None, :]
            tl.store(pa, acc1)
            tl.store(pa + H2, acc2)
            tl.store(PartML + (part + s) * (GP * 2) + h * 2, m_i)
            tl.store(PartML + (part + s) * (GP * 2) + h * 2 + 1, l_i)
            tl.debug_barrier()
            old = tl.atomic_add(HeadDone + m * HK + g, 1, sem="acq_rel")
            if old == (layer + 1) * ns - 1:   # the last of the (row, head)'s splits: merge
                sp = tl.arange(0, _SPLITS)
                sm = sp < ns
                ml = PartML + (part + sp)[:, None] * (GP * 2) + h[None, :] * 2
                mx = tl.load(ml, mask=sm[:, None], other=float("-inf"), cache_modifier=".cg")
                ls = tl.load(ml + 1, mask=sm[:, None], other=0.0, cache_modifier=".cg")
                top = tl.max(mx, 0)
                top = tl.where(top == float("-inf"), 0.0, top)
                wt = tl.where(sm[:, None], tl.exp(mx - top[None, :]), 0.0)    # [splits, GP]
                total = tl.sum(wt * ls, 0)
                total = tl.where(total > 0, total, 1.0)   # (padding rows: zeros)
                pp = (PartAcc + (part + sp)[:, None, None] * (GP * D) + h[None, :, None] * D
                      + d[None, None, :])
                a1 = tl.load(pp, mask=sm[:, None, None], other=0.0, cache_modifier=".cg")
                a2 = tl.load(pp + H2, mask=sm[:, None, None], other=0.0, cache_modifier=".cg")
                o1 = tl.sum(a1 * wt[:, :, None], 0) / total[:, None]
                o2 = tl.sum(a2 * wt[:, :, None], 0) / total[:, None]
                out = Attn + m * (HQ * D) + (g * G + h)[:, None] * D + d[None, :]
                tl.store(out, _round(o1, DT), mask=hm[:, None])
                tl.store(out + H2, _round(o2, DT), mask=hm[:, None])
                _done(Counters + layer * 5 + 1)


@triton.jit
def _decode_kernel(Table, LMHead, FinalNorm, Resid, QKV, Attn, Act, PartAcc, PartML, Logits,
                   Counters, Positions, Slots, ContextLens, BlockTables, CosSin, M, tasks, eps,
                   scale, sb, so, sh, DT: tl.constexpr, KV_DT: tl.constexpr, H: tl.constexpr,
                   HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                   V: tl.constexpr, L: tl.constexpr, QK_NORM: tl.constexpr, BS: tl.constexpr,
                   MAXB: tl.constexpr, MP: tl.constexpr, GP: tl.constexpr,
                   BN_QKV: tl.constexpr, BN_H: tl.constexpr, BN_I: tl.constexpr,
                   BN_V: tl.constexpr, BK_H: tl.constexpr, BK_A: tl.constexpr,
                   BK_I: tl.constexpr, BT: tl.constexpr, AP: tl.constexpr,
                   PROFILE: tl.constexpr, Prof):
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    NT0: tl.constexpr = (NQKV + BN_QKV - 1) // BN_QKV
    NTH: tl.constexpr = (H + BN_H - 1) // BN_H
    NTI: tl.constexpr = (I + BN_I - 1) // BN_I
    HeadDone = Counters + L * 5
    # attention's split length: about `tasks` (row, kv head, split)s in the step (one an SM),
    # a multiple of BT, at most MAX_SPLITS splits a row
    rows = tl.arange(0, AP)
    ctx_all = tl.load(ContextLens + rows, mask=rows < M, other=0)
    longest = tl.maximum(tl.max(ctx_all, 0), 1)
    split = tl.maximum((longest * M * HK + tasks - 1) // tasks,
                       (longest + _SPLITS - 1) // _SPLITS)
    split = (split + BT - 1) // BT * BT
    n_splits = (longest + split - 1) // split
    _stamp(Prof, L * 5, PROFILE)
    for layer in range(L):
        last = Counters + tl.maximum(layer - 1, 0) * 5 + 4   # the layer before's DOWN tiles
        _projection(Resid, M, H, _weight(Table, layer, 0, DT), NQKV, _weight(Table, layer, 4, DT),
                    eps, QKV, last, tl.where(layer > 0, NTH, 0), Counters + layer * 5 + 0,
                    STORE, True, DT, MP, BN_QKV, BK_H)
        _stamp(Prof, layer * 5 + 0, PROFILE)
        _attention(Table, layer, QKV, Attn, PartAcc, PartML, Counters, HeadDone, Positions,
                   Slots, ctx_all, split, n_splits, BlockTables, CosSin, eps, scale, M, sb, so,
                   sh, DT, KV_DT, HQ, HK, D, QK_NORM, BS, MAXB, AP, GP, NT0, BT)
        _stamp(Prof, layer * 5 + 1, PROFILE)
        _projection(Attn, M, HQ * D, _weight(Table, layer, 1, DT), H, FinalNorm, eps, Resid,
                    Counters + layer * 5 + 1, M * HK, Counters + layer * 5 + 2,
                    ADD, False, DT, MP, BN_H, BK_A)
        _stamp(Prof, layer * 5 + 2, PROFILE)
        _projection(Resid, M, H, _weight(Table, layer, 2, DT), I, _weight(Table, layer, 5, DT),
                    eps, Act, Counters + layer * 5 + 2, NTH, Counters + layer * 5 + 3,
                    GLU, True, DT, MP, BN_I, BK_H)
        _stamp(Prof, layer * 5 + 3, PROFILE)
        _projection(Act, M, I, _weight(Table, layer, 3, DT), H, FinalNorm, eps, Resid,
                    Counters + layer * 5 + 3, NTI, Counters + layer * 5 + 4,
                    ADD, False, DT, MP, BN_H, BK_I)
        _stamp(Prof, layer * 5 + 4, PROFILE)
    # (the LM head's tiles are counted on the last counter, which nothing waits for)
    _projection(Resid, M, H, LMHead, V, FinalNorm, eps, Logits, Counters + (L - 1) * 5 + 4,
                NTH, HeadDone + _ROWS * HK, STORE, True, DT, MP, BN_V, BK_H)
    _stamp(Prof, L * 5 + 1, PROFILE)


def _block_k(k: int, rows: int) -> int:
    """Columns a weight chunk: BLOCK_K over the rows (the [rows, BN, BK] accumulator stays
    in registers), at least 128, and a power of two dividing k (no chunk straddles rows)."""
    return min(max(BLOCK_K // rows, 128), k & -k)


_grids: dict[tuple, int] = {}
compiled: list[dict] = []   # per compiled kernel: registers, spills, shared memory, programs


def _programs(sms: int, key: tuple, compile_kernel) -> int:
    """CTAS programs an SM where they all fit at once (registers, shared memory, warps):
    the waits end only when every program is resident. Measured once per compiled kernel."""
    if sms == 1 or CTAS == 1:
        return sms
    if key not in _grids:
        k = compile_kernel()
        k._init_handles()
        regs = -(-k.n_regs // 8) * 8 * 32 * NUM_WARPS
        fit = min(65536 // regs, (227 * 1024) // max(k.metadata.shared, 1), 64 // NUM_WARPS)
        _grids[key] = sms * max(1, min(CTAS, fit))
        compiled.append(dict(regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared,
                             programs=_grids[key]))
    return _grids[key]


def decode_step(table: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor,
                cos_sin: torch.Tensor, dims: Dims, ws: Workspace, positions: torch.Tensor,
                slots: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                logits: torch.Tensor, kv_cache: torch.Tensor, sms: int) -> None:
    """Run the layers and the LM head over ws.resid's first M rows (the embeddings of the
    step's ids), leaving logits [M, vocab]; the K/V of the step are stored in the caches
    the table points to (every layer's laid out as kv_cache, one layer's). table: [layers,
    TABLE_WIDTH] int64 addresses (W_QKV ... V_CACHE); sms: the GPU's SMs (1: run as one
    program, as the interpreter must); no host sync (CUDA-graph safe)."""
    d = dims
    M = positions.shape[0]
    assert 1 <= M <= MAX_ROWS and block_tables.shape[1] == d.max_blocks
    ws.counters.zero_()
    dt = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
          torch.float16: tl.float16}
    sb, so, sh, sd = kv_cache.stride()   # a layer's cache [blocks, block_size, kv heads, D]
    assert sd == 1
    mp = triton.next_power_of_2(M)
    args = (table, lm_head, final_norm, ws.resid, ws.qkv, ws.attn, ws.act, ws.part_acc,
            ws.part_ml, logits, ws.counters, positions, slots, context_lens, block_tables,
            cos_sin, M)
    consts = dict(
        DT=dt[lm_head.dtype], KV_DT=dt[kv_cache.dtype], H=d.hidden, HQ=d.heads, HK=d.kv_heads,
        D=d.head_dim, I=d.intermediate, V=d.vocab, L=d.layers, QK_NORM=d.qk_norm,
        BS=d.block_size, MAXB=d.max_blocks, MP=mp,
        GP=triton.next_power_of_2(max(d.heads // d.kv_heads, 1)),
        BN_QKV=BLOCK_N, BN_H=BLOCK_N, BN_I=max(BLOCK_N // 2, 1), BN_V=LM_BLOCK_N,
        BK_H=_block_k(d.hidden, mp), BK_A=_block_k(d.heads * d.head_dim, mp),
        BK_I=_block_k(d.intermediate, mp), BT=min(BT, d.block_size), AP=MAX_ROWS,
        PROFILE=ws.prof is not None, num_warps=NUM_WARPS)
    rest = (d.eps, d.scale, sb, so, sh)
    prof = ws.prof if ws.prof is not None else ws.counters
    key = (positions.device.index, tuple(sorted((k, str(v)) for k, v in consts.items())))
    programs = _programs(sms, key, lambda: _decode_kernel.warmup(
        *args, 1, *rest, Prof=prof, grid=(1,), **consts))
    # attention aims at one task a program; the interpreter's one program at several
    # splits a row, so that CPU tests run the split merge the GPU runs
    tasks = programs if programs > 1 else INTERPRETER_TASKS
    _decode_kernel[(programs,)](*args, tasks, *rest, Prof=prof, **consts)


def profile(ws: Workspace, dims: Dims) -> dict[str, float]:
    """Microseconds per phase kind over the layers of the last step run with a profiling
    Workspace (NANOSERVE_PERSISTENT_PROFILE=1): a phase lasts from the last program's end of
    the phase before to the last program's end of this one (the step's critical path)."""
    t = ws.prof[:, :dims.layers * PHASES + 2].cpu().double()
    t = t[t[:, -2] > 0]   # (the programs that ran)
    ends = t[:, :dims.layers * PHASES].max(0).values.view(dims.layers, PHASES)
    start, lm_end = t[:, -2].min(), t[:, -1].max()
    before = torch.cat([start.view(1), ends.flatten()[:-1]]).view(dims.layers, PHASES)
    out = {k: float((ends[:, j] - before[:, j]).sum()) / 1e3
           for j, k in enumerate(("qkv", "attention", "o_proj", "gate_up", "down"))}
    out["lm_head"] = float(lm_end - ends[-1, -1]) / 1e3
    out["step"] = float(lm_end - start) / 1e3
    return out
