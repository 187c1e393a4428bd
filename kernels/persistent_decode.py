"""A decoder's whole decode step (after the embedding lookup, up to the LM head's logits) in
one persistent Triton kernel: one program per SM walks a task list, tasks wait on counters
in global memory (DESIGN.md, Small steps).

Why: at batch 1-8 a step costs its launches, not its bytes (Qwen3-0.6B: 229 kernels, 3.5x
the weight-read floor on an H200). Here the step is one launch (plus the embedding gather
and a counter reset), and a program that finishes a task goes straight on to its next one,
whose weights it streams while other programs finish theirs.

The task list, per layer (phases in order; a phase's tasks wait for every task of the
phase before, which a counter per (layer, phase) counts):
  0 QKV   input norm (recomputed per task from the residual stream) and BLOCK_N columns of
          the fused q|k|v projection
  1 ATTN  one (row, kv head): q/k RMSNorm per head, rotary, K/V store, attention over the
          row's paged context for the group's q heads
  2 O     BLOCK_N columns of o_proj, added to the residual stream
  3 UP    post-attention norm, BLOCK_N columns of gate and of up, SiLU(gate) * up
  4 DOWN  BLOCK_N columns of down_proj, added to the residual stream
then the LM head: final norm and BLOCK_N vocabulary rows a task. Every task's inputs are
written by tasks earlier in the global order, and program p takes tasks p, p + P, ...:
with all P programs resident (P <= SMs) the earliest unfinished task can always run, so
the waits end. The Triton interpreter runs programs one after another, so there P = 1 and
every wait is already met when it is reached.

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

# per layer in the pointer table: the weights, then the layer's K and V caches
W_QKV, W_O, W_GATE_UP, W_DOWN, N_IN, N_POST, N_Q, N_K, K_CACHE, V_CACHE = range(10)
TABLE_WIDTH = 10
PHASES = 5
MAX_ROWS = 8
# output columns a projection task computes (the tile is [rows, BLOCK_N, 128] in registers):
# at most this many, fewer as rows grow; NANOSERVE_PERSISTENT_BLOCK_N to sweep it
BLOCK_N = int(os.environ.get("NANOSERVE_PERSISTENT_BLOCK_N", "16"))


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
    """The step's float32 activations between tasks, and the counters (one a phase and
    layer, and one for the LM head), for up to MAX_ROWS rows."""
    resid: torch.Tensor      # [MAX_ROWS, hidden]: the residual stream (the embeddings first)
    qkv: torch.Tensor        # [MAX_ROWS, (heads + 2 kv_heads) head_dim]
    attn: torch.Tensor       # [MAX_ROWS, heads head_dim]
    act: torch.Tensor        # [MAX_ROWS, intermediate]
    counters: torch.Tensor   # [layers * PHASES + 1] int32

    @classmethod
    def allocate(cls, d: Dims, device: torch.device) -> "Workspace":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros(MAX_ROWS, d.hidden, **f32),
                   torch.zeros(MAX_ROWS, (d.heads + 2 * d.kv_heads) * d.head_dim, **f32),
                   torch.zeros(MAX_ROWS, d.heads * d.head_dim, **f32),
                   torch.zeros(MAX_ROWS, d.intermediate, **f32),
                   torch.zeros(d.layers * PHASES + 1, dtype=torch.int32, device=device))


@triton.jit
def _wait(counter, target):
    """Spin until `counter` reaches `target` (acquire: what its tasks wrote is visible)."""
    seen = tl.atomic_add(counter, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire")


@triton.jit
def _done(counter):
    """This program's task is written: count it (release, after every thread's stores)."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release")


@triton.jit
def _weight(Table, layer, j, DT: tl.constexpr):
    return tl.load(Table + layer * 10 + j).to(tl.pointer_type(DT))


@triton.jit
def _round(x, DT: tl.constexpr):
    """x as the per-op path stores it (in the model's dtype), back in float32."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _rstd(X, M, K: tl.constexpr, eps, MP: tl.constexpr, BK: tl.constexpr):
    """1 / RMS of each of the M rows of X [MP, K] (float32, written by other programs)."""
    rows = tl.arange(0, MP)
    acc = tl.zeros([MP, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(X + rows[:, None] * K + cols[None, :], mask=m, other=0.0,
                    cache_modifier=".cg")
        acc += x * x
    return 1.0 / tl.sqrt(tl.sum(acc, 1) / K + eps)


@triton.jit
def _tile(X, M, K: tl.constexpr, W, n0, N: tl.constexpr, Norm, rstd, NORM: tl.constexpr,
          DT: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """[MP, BN] float32 = x @ W[n0:n0 + BN].T, x = X's rows (normalized by rstd and the
    norm weight, rounded, where NORM), products on CUDA cores (a few rows: no tensor-core
    padding to 16), reduced once after the K loop."""
    rows = tl.arange(0, MP)
    n = n0 + tl.arange(0, BN)
    acc = tl.zeros([MP, BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(X + rows[:, None] * K + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0, cache_modifier=".cg")
        if NORM:
            g = tl.load(Norm + k, mask=k < K, other=0.0).to(tl.float32)
            x = _round(x * rstd[:, None] * g[None, :], DT)
        w = tl.load(W + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                    other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    return tl.sum(acc, 2)


@triton.jit
def _store_rows(Y, M, N: tl.constexpr, n0, y, MP: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, MP)
    n = n0 + tl.arange(0, BN)
    tl.store(Y + rows[:, None] * N + n[None, :], y, mask=(rows[:, None] < M) & (n[None, :] < N))


@triton.jit
def _add_rows(Y, M, N: tl.constexpr, n0, y, DT: tl.constexpr, MP: tl.constexpr,
              BN: tl.constexpr):
    """Y[:, n0:n0 + BN] += y, both rounded as the per-op path rounds them."""
    rows = tl.arange(0, MP)
    n = n0 + tl.arange(0, BN)
    ptr = Y + rows[:, None] * N + n[None, :]
    m = (rows[:, None] < M) & (n[None, :] < N)
    old = tl.load(ptr, mask=m, other=0.0, cache_modifier=".cg")
    tl.store(ptr, _round(old + _round(y, DT), DT), mask=m)


@triton.jit
def _head_rms(x1, x2, w1, w2, eps, D: tl.constexpr, DT: tl.constexpr):
    """RMSNorm of heads given as halves [G, D/2] (the per-head q/k norm)."""
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
    return _round(x1 * rstd[:, None] * w1[None, :], DT), _round(x2 * rstd[:, None] * w2[None, :], DT)


@triton.jit
def _attention_task(Table, layer, task, QKV, Attn, Positions, Slots, ContextLens, BlockTables,
                    CosSin, eps, scale, M, sb, so, sh, DT: tl.constexpr, KV_DT: tl.constexpr,
                    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                    BS: tl.constexpr, MAXB: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr):
    """Row `task // HK`, kv head `task % HK`: its q heads and k/v from the fused projection,
    q/k norm, rotary, K/V store, then attention over the row's context (its new token
    included, from the cache just written)."""
    m = task // HK
    g = task % HK
    G: tl.constexpr = HQ // HK
    H2: tl.constexpr = D // 2
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    pos = tl.load(Positions + m)
    slot = tl.load(Slots + m).to(tl.int64)
    ctx = tl.load(ContextLens + m)
    h = tl.arange(0, GP)
    hm = h < G
    d = tl.arange(0, H2)
    row = QKV + m * NQKV
    qp = row + (g * G + h)[:, None] * D + d[None, :]
    q1 = tl.load(qp, mask=hm[:, None], other=0.0, cache_modifier=".cg")
    q2 = tl.load(qp + H2, mask=hm[:, None], other=0.0, cache_modifier=".cg")
    kp = row + HQ * D + g * D + d[None, :]
    k1 = tl.load(kp, cache_modifier=".cg")
    k2 = tl.load(kp + H2, cache_modifier=".cg")
    vp = row + (HQ + HK) * D + g * D + tl.arange(0, D)
    v = tl.load(vp, cache_modifier=".cg")
    if QK_NORM:
        wq = _weight(Table, layer, 6, DT)
        wk = _weight(Table, layer, 7, DT)
        q1, q2 = _head_rms(q1, q2, tl.load(wq + d).to(tl.float32),
                           tl.load(wq + H2 + d).to(tl.float32), eps, D, DT)
        k1, k2 = _head_rms(k1, k2, tl.load(wk + d).to(tl.float32),
                           tl.load(wk + H2 + d).to(tl.float32), eps, D, DT)
    cos = tl.load(CosSin + pos * D + d)[None, :]
    sin = tl.load(CosSin + pos * D + H2 + d)[None, :]
    q1, q2 = _round(q1 * cos - q2 * sin, DT), _round(q2 * cos + q1 * sin, DT)
    k1, k2 = _round(k1 * cos - k2 * sin, DT), _round(k2 * cos + k1 * sin, DT)
    Kc = _weight(Table, layer, 8, KV_DT)
    Vc = _weight(Table, layer, 9, KV_DT)
    kv_row = (slot // BS) * sb + (slot % BS) * so + g * sh   # (cache strides: block, slot, head)
    keep = slot >= 0   # (a CUDA graph's padding rows store nothing)
    tl.store(Kc + kv_row + d[None, :], k1.to(KV_DT), mask=keep)
    tl.store(Kc + kv_row + H2 + d[None, :], k2.to(KV_DT), mask=keep)
    tl.store(Vc + kv_row + tl.arange(0, D), v.to(KV_DT), mask=keep)
    tl.debug_barrier()
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc1 = tl.zeros([GP, H2], dtype=tl.float32)
    acc2 = tl.zeros([GP, H2], dtype=tl.float32)
    for t0 in range(0, ctx, BT):
        t = t0 + tl.arange(0, BT)
        live = t < ctx
        blk = tl.load(BlockTables + m * MAXB + t // BS, mask=live, other=0).to(tl.int64)
        at = blk * sb + (t % BS) * so + g * sh
        kb1 = tl.load(Kc + at[:, None] + d[None, :], mask=live[:, None], other=0.0,
                      cache_modifier=".cg").to(tl.float32)
        kb2 = tl.load(Kc + at[:, None] + H2 + d[None, :], mask=live[:, None], other=0.0,
                      cache_modifier=".cg").to(tl.float32)
        s = (tl.sum(q1[:, None, :] * kb1[None, :, :], 2)
             + tl.sum(q2[:, None, :] * kb2[None, :, :], 2)) * scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        vb1 = tl.load(Vc + at[:, None] + d[None, :], mask=live[:, None], other=0.0,
                      cache_modifier=".cg").to(tl.float32)
        vb2 = tl.load(Vc + at[:, None] + H2 + d[None, :], mask=live[:, None], other=0.0,
                      cache_modifier=".cg").to(tl.float32)
        acc1 = acc1 * alpha[:, None] + tl.sum(p[:, :, None] * vb1[None, :, :], 1)
        acc2 = acc2 * alpha[:, None] + tl.sum(p[:, :, None] * vb2[None, :, :], 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = Attn + m * (HQ * D) + (g * G + h)[:, None] * D + d[None, :]
    l_i = tl.where(l_i > 0, l_i, 1.0)   # (padding rows attend to nothing: zeros)
    tl.store(out, _round(acc1 / l_i[:, None], DT), mask=hm[:, None])
    tl.store(out + H2, _round(acc2 / l_i[:, None], DT), mask=hm[:, None])


@triton.jit
def _decode_kernel(Table, LMHead, FinalNorm, Resid, QKV, Attn, Act, Logits, Counters,
                   Positions, Slots, ContextLens, BlockTables, CosSin, M, eps, scale,
                   sb, so, sh, DT: tl.constexpr, KV_DT: tl.constexpr, H: tl.constexpr, HQ: tl.constexpr,
                   HK: tl.constexpr, D: tl.constexpr, I: tl.constexpr, V: tl.constexpr,
                   L: tl.constexpr, QK_NORM: tl.constexpr, BS: tl.constexpr,
                   MAXB: tl.constexpr, MP: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, BT: tl.constexpr):
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    N0: tl.constexpr = (NQKV + BN - 1) // BN
    N2: tl.constexpr = (H + BN - 1) // BN
    N3: tl.constexpr = (I + BN - 1) // BN
    N4: tl.constexpr = (H + BN - 1) // BN
    NLM: tl.constexpr = (V + BN - 1) // BN
    n1 = M * HK
    per_layer = N0 + n1 + N2 + N3 + N4
    total = L * per_layer + NLM
    for task in range(tl.program_id(0), total, tl.num_programs(0)):
        layer = task // per_layer
        r = task % per_layer
        if layer >= L:   # the LM head, after the last layer's down projection
            _wait(Counters + (L - 1) * 5 + 4, N4)
            n0 = (task - L * per_layer) * BN
            rstd = _rstd(Resid, M, H, eps, MP, BK)
            y = _tile(Resid, M, H, LMHead, n0, V, FinalNorm, rstd, True, DT, MP, BN, BK)
            _store_rows(Logits, M, V, n0, y.to(DT), MP, BN)
        elif r < N0:
            if layer > 0:
                _wait(Counters + (layer - 1) * 5 + 4, N4)
            rstd = _rstd(Resid, M, H, eps, MP, BK)
            y = _tile(Resid, M, H, _weight(Table, layer, 0, DT), r * BN, NQKV,
                      _weight(Table, layer, 4, DT), rstd, True, DT, MP, BN, BK)
            _store_rows(QKV, M, NQKV, r * BN, _round(y, DT), MP, BN)
            _done(Counters + layer * 5 + 0)
        elif r < N0 + n1:
            _wait(Counters + layer * 5 + 0, N0)
            _attention_task(Table, layer, r - N0, QKV, Attn, Positions, Slots, ContextLens,
                            BlockTables, CosSin, eps, scale, M, sb, so, sh, DT, KV_DT, HQ, HK, D, QK_NORM,
                            BS, MAXB, GP, BT)
            _done(Counters + layer * 5 + 1)
        elif r < N0 + n1 + N2:
            _wait(Counters + layer * 5 + 1, n1)
            n0 = (r - N0 - n1) * BN
            y = _tile(Attn, M, HQ * D, _weight(Table, layer, 1, DT), n0, H, FinalNorm, M,
                      False, DT, MP, BN, BK)
            _add_rows(Resid, M, H, n0, y, DT, MP, BN)
            _done(Counters + layer * 5 + 2)
        elif r < N0 + n1 + N2 + N3:
            _wait(Counters + layer * 5 + 2, N2)
            n0 = (r - N0 - n1 - N2) * BN
            rstd = _rstd(Resid, M, H, eps, MP, BK)
            Wgu = _weight(Table, layer, 2, DT)
            Post = _weight(Table, layer, 5, DT)
            gate = _round(_tile(Resid, M, H, Wgu, n0, I, Post, rstd, True, DT, MP, BN, BK), DT)
            up = _round(_tile(Resid, M, H, Wgu + I * H, n0, I, Post, rstd, True, DT, MP, BN,
                              BK), DT)
            act = _round(gate / (1.0 + tl.exp(-gate)) * up, DT)
            _store_rows(Act, M, I, n0, act, MP, BN)
            _done(Counters + layer * 5 + 3)
        else:
            _wait(Counters + layer * 5 + 3, N3)
            n0 = (r - N0 - n1 - N2 - N3) * BN
            y = _tile(Act, M, I, _weight(Table, layer, 3, DT), n0, H, FinalNorm, M, False,
                      DT, MP, BN, BK)
            _add_rows(Resid, M, H, n0, y, DT, MP, BN)
            _done(Counters + layer * 5 + 4)


def decode_step(table: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor,
                cos_sin: torch.Tensor, dims: Dims, ws: Workspace, positions: torch.Tensor,
                slots: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                logits: torch.Tensor, kv_cache: torch.Tensor, programs: int) -> None:
    """Run the layers and the LM head over ws.resid's first M rows (the embeddings of the
    step's ids), leaving logits [M, vocab]; the K/V of the step are stored in the caches
    the table points to (every layer's laid out as kv_cache, one layer's). table: [layers, TABLE_WIDTH] int64 addresses (W_QKV ... V_CACHE);
    no host sync (CUDA-graph safe)."""
    d = dims
    M = positions.shape[0]
    assert 1 <= M <= MAX_ROWS and block_tables.shape[1] == d.max_blocks
    ws.counters.zero_()
    dt = tl.float32 if lm_head.dtype == torch.float32 else (
        tl.bfloat16 if lm_head.dtype == torch.bfloat16 else tl.float16)
    kv = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[kv_cache.dtype]
    sb, so, sh, sd = kv_cache.stride()   # a layer's cache [blocks, block_size, kv heads, D]
    assert sd == 1
    _decode_kernel[(programs,)](
        table, lm_head, final_norm, ws.resid, ws.qkv, ws.attn, ws.act, logits, ws.counters,
        positions, slots, context_lens, block_tables, cos_sin, M, d.eps, d.scale, sb, so, sh,
        DT=dt, KV_DT=kv, H=d.hidden, HQ=d.heads, HK=d.kv_heads, D=d.head_dim,
        I=d.intermediate, V=d.vocab, L=d.layers, QK_NORM=d.qk_norm, BS=d.block_size,
        MAXB=d.max_blocks, MP=triton.next_power_of_2(M),
        GP=triton.next_power_of_2(max(d.heads // d.kv_heads, 1)),
        BN=max(16, BLOCK_N // triton.next_power_of_2(M)), BK=128, BT=32,
        num_warps=8)
