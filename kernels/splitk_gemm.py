"""y = x @ w.T for decode-sized batches (few rows), with K split over more programs.

Why: at decode batch ~131 a Qwen3-0.6B projection reads 4-13 MB of weights and does
little math, so its time is how fast the weights stream in. cuBLAS's tiles leave most
SMs without loads in flight for the narrow projections (o_proj and down_proj, N = 1024:
~7 us each on an H100, 0.6-0.9 TB/s). Splitting K gives every SM a slice to stream.

Partial sums go to an fp32 workspace; the program that finishes an output tile last
(an atomic arrival counter per tile) adds the partials in split order and writes y, so
the result does not depend on which program finished last, and it resets the counter so
the next call (or the next CUDA graph replay) starts from zero. One launch, deterministic.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def splitk_gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: x [M, K] @ w[N, K].T -> [M, N] (what nn.Linear without bias computes)."""
    return F.linear(x, w)


@dataclass(frozen=True)
class GemmConfig:
    """One tiling: an output tile is block_m x block_n; K is cut into split_k slices,
    each walked block_k at a time."""
    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


# Triton's CPU interpreter (the CI tests) multiplies bf16 tiles as raw 16-bit integers:
# there the tiles are widened to fp32 before the dot.
_WIDEN = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _splitk_gemm_kernel(X, W, Y, Part, Count, M, N, K, stride_xm, stride_wn, stride_ym,
                        K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:   # K_PER_SPLIT * SPLIT_K == K: no column masks on the hot loop
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (offs_k + k) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if _WIDEN:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        tile_off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]   # workspace [SPLIT_K, M, N]
        tl.store(Part + pid_k * M * N + tile_off, acc, mask=out_mask)
        tl.debug_barrier()   # every thread's partial is written before the arrival is
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(Count + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:   # the last of this tile's programs: add up in split order
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(Part + s * M * N + tile_off, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(Count + tile, 0, sem="relaxed", scope="gpu")


def pick_config(m: int, n: int, k: int, num_sms: int) -> GemmConfig | None:
    """The tiling for an [m, k] x [k, n] GEMM, or None where cuBLAS is the better choice
    (batches past decode sizes). Split K until the grid covers every SM twice."""
    if m > 256:
        return None
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 2 * num_sms and split < 8 and k % (2 * split * block_k) == 0:
        split *= 2
    return GemmConfig(block_m, block_n, block_k, split)


class Workspace:
    """The fp32 partials and the tile counters, grown on demand and kept per device.

    Counters are zero between calls (each tile's last program resets its own), so one
    workspace serves every layer: kernels on one stream run one after the other. A
    buffer that is outgrown stays allocated: a CUDA graph captured earlier points at it."""

    def __init__(self) -> None:
        self.part: dict[torch.device, torch.Tensor] = {}
        self.count: dict[torch.device, torch.Tensor] = {}
        self.outgrown: list[torch.Tensor] = []

    def get(self, device: torch.device, floats: int, tiles: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        part, count = self.part.get(device), self.count.get(device)
        if part is None or part.numel() < floats:
            self.outgrown += [part] if part is not None else []
            part = self.part[device] = torch.empty(floats, dtype=torch.float32, device=device)
        if count is None or count.numel() < tiles:
            self.outgrown += [count] if count is not None else []
            count = self.count[device] = torch.zeros(tiles, dtype=torch.int32, device=device)
        return part, count


WORKSPACE = Workspace()


def splitk_gemm(x: torch.Tensor, w: torch.Tensor, config: GemmConfig,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype; x's and w's rows contiguous."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert x.stride(1) == 1 and w.stride(1) == 1
    m, k = x.shape
    n = w.shape[0]
    c = config
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    k_per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    grid = (triton.cdiv(n, c.block_n), c.split_k, triton.cdiv(m, c.block_m))
    if c.split_k > 1:
        part, count = WORKSPACE.get(x.device, c.split_k * m * n, grid[0] * grid[2])
    else:
        part = count = y   # unused
    _splitk_gemm_kernel[grid](
        x, w, y, part, count, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        K_PER_SPLIT=k_per_split, SPLIT_K=c.split_k, EVEN_K=k_per_split * c.split_k == k,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages)
    return y
