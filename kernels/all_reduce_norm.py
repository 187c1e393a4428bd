"""All-reduce, residual add and RMSNorm in one kernel, over peer memory (tensor parallelism).

Why: under TP every decoder layer ends its attention and its MLP with a row-parallel GEMM
whose output is a partial sum; the next thing done with it is "sum over ranks, add to the
residual, RMSNorm". At decode sizes (~1 MiB) the all-reduce is latency (barriers and
launches), not bytes, and done as torch's two-shot kernel it costs a staging copy, the
kernel, a copy out and then the norm's launch: ~19 us a time, 72 times an 8B step. Here one
kernel per rank does it all: copies its partial rows into its slot of a symmetric buffer
(models/fast_all_reduce.py maps every rank's into every other's address space), meets the
peers at a barrier, then reads every rank's rows from peer memory and sums them in rank
order (so every rank gets bit-identical sums, as TP needs), and finishes as kernels/rmsnorm.py
does: residual += sum (rounded to the activation dtype), out = norm(residual) * weight.

The barrier, per program b (a fixed grid of G programs; program b owns rows b, b+G, ...,
so every call has the same programs whatever its row count):
  * each program counts its calls in `counts[b]` (ordinary memory; only b touches it);
  * it adds 1 to flag (b, rank) in every rank's buffer (release, system scope: its slot
    writes become visible first), then spins until every flag (b, r) in its own buffer has
    reached its count (acquire), i.e. program b of every rank has written this call's rows;
  * two slots alternate by call parity: call k writes slot k & 1, which peers last read at
    call k - 2; they signalled call k - 1 after finishing k - 2, and this program waited for
    that signal, so no peer can still be reading what call k overwrites. No exit barrier.
Counters wrap (int32); `flag - count >= 0` stays right across the wrap.

Every rank must make the same sequence of calls (TP ranks run the same forwards), G must be
the same on every rank, and all G programs must be resident at once (G <= SMs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rmsnorm import normalize_row, rms_norm_ref

MAX_PROGRAMS = 256    # G: the GPU's SMs up to this (one row each at decode batches <= G)
MAX_WORLD = 8
FLAGS_BYTES = MAX_PROGRAMS * MAX_WORLD * 4


def all_reduce_norm_ref(partials: list[torch.Tensor], residual: torch.Tensor,
                        weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (norm(sum + residual), sum + residual), the sum in rank order in float32
    rounded to the activation dtype, as an all-reduce followed by rms_norm_ref gives it."""
    total = partials[0].float()
    for p in partials[1:]:
        total = total + p.float()
    return rms_norm_ref(total.to(partials[0].dtype), weight, eps, residual.clone())


@triton.jit
def _buffer(Bases, r, dtype: tl.constexpr):
    """Rank r's buffer as a pointer; 16-byte aligned, which Triton cannot know of an address
    it loaded: said, so the row copies are 16-byte loads and stores, not one per element."""
    return tl.multiple_of(tl.load(Bases + r).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _all_reduce_norm_kernel(
    X, Residual, Weight, Out, Bases, Counts, rank, T, eps,
    slot0, slot_elems, flags_byte_off,
    N: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr, WORLD_PAD: tl.constexpr,
    G: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    dtype = X.dtype.element_ty
    count = tl.load(Counts + b) + 1
    slot = slot0 + (count & 1).to(tl.int64) * slot_elems    # element offset of this call's slot
    mine = _buffer(Bases, rank, dtype) + slot
    for row in range(b, T, G):
        r64 = row * N   # < 2**31: a slot holds at most a few MiB
        tl.store(mine + r64 + offs, tl.load(X + r64 + offs, mask=mask), mask=mask)
    tl.debug_barrier()   # every thread's rows are written (and count read) before:
    tl.store(Counts + b, count)

    ranks = tl.arange(0, WORLD_PAD)
    live = ranks < WORLD
    bases = tl.load(Bases + ranks, mask=live, other=0)
    peer_flags = (bases + flags_byte_off + (b * WORLD + rank) * 4).to(tl.pointer_type(tl.int32))
    tl.atomic_add(peer_flags, 1, mask=live, sem="release", scope="sys")
    own = tl.load(Bases + rank) + flags_byte_off + (b * WORLD + ranks) * 4
    own_flags = own.to(tl.pointer_type(tl.int32))
    lag = tl.full([], -1, tl.int32)
    while lag < 0:
        seen = tl.atomic_add(own_flags, 0, mask=live, sem="acquire", scope="sys")
        lag = tl.min(tl.where(live, seen - count, 0), axis=0)
    tl.debug_barrier()   # the acquire above orders every thread's peer reads below

    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(b, T, G):
        r64 = row * N   # < 2**31: a slot holds at most a few MiB
        acc = tl.zeros([BLOCK_N], tl.float32)
        for r in tl.static_range(WORLD):
            src = _buffer(Bases, r, dtype) + slot + r64
            acc += tl.load(src + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        res = Residual + r64 + offs
        x = (acc.to(dtype).to(tl.float32) + tl.load(res, mask=mask, other=0.0).to(tl.float32)
             ).to(dtype)
        tl.store(res, x, mask=mask)
        tl.store(Out + r64 + offs, normalize_row(x, w, eps, N).to(Out.dtype.element_ty),
                 mask=mask)


def all_reduce_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    bases: torch.Tensor, rank: int, counts: torch.Tensor, slot_offset: int,
                    slot_bytes: int, flags_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum over ranks of x + residual), that sum written into residual) for this rank.

    x, residual: [T, N] contiguous, one dtype; bases: int64 [world], every rank's symmetric
    buffer address as this process maps it; counts: int32 [G] zeros at start, this rank's
    (G = the grid, the same on every rank); the buffer holds two slots of slot_bytes from
    slot_offset and FLAGS_BYTES of zeroed flags at flags_offset (byte offsets)."""
    t, n = x.shape
    world, g = bases.numel(), counts.numel()
    assert x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape
    assert residual.dtype == x.dtype and weight.shape == (n,)
    assert x.numel() * x.element_size() <= slot_bytes and world <= MAX_WORLD
    assert g <= MAX_PROGRAMS and slot_offset % x.element_size() == 0 and flags_offset % 4 == 0
    out = torch.empty_like(x)
    block_n = triton.next_power_of_2(n)
    _all_reduce_norm_kernel[(g,)](
        x, residual, weight, out, bases, counts, rank, t, eps,
        slot_offset // x.element_size(), slot_bytes // x.element_size(), flags_offset,
        N=n, BLOCK_N=block_n, WORLD=world, WORLD_PAD=max(triton.next_power_of_2(world), 2),
        G=g, num_warps=min(max(block_n // 256, 1), 8))
    return out, residual
