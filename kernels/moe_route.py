"""Qwen3-MoE's router in one launch: softmax over experts, top k, renormalised.

Reference: `models.moe.route` (Hugging Face's Qwen3MoeTopKRouter step for step: float32
softmax, torch.topk, divide by the k weights' sum, cast back). In torch that is five
small kernels a layer, each a few microseconds of a decode step's GPU time; here one
program takes BLOCK_T tokens' logits and does it all in registers.

The k experts are chosen on the logits, not on the probabilities: softmax is monotone, so
the order is the same, and the logits have no rounding in them (exp's can tie two
probabilities that differ in their logits). Ties go to the lower expert id. Weights come
out in descending order, as torch.topk's (sorted). A logit that is NaN (the padding rows
of a CUDA graph's batch carry garbage) ranks below every number, so ids stay in range.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16


@triton.jit
def _route_kernel(Logits, Weights, Ids, T, E, stride_t, TOP_K: tl.constexpr,
                  K_P2: tl.constexpr, NORM: tl.constexpr, E_P2: tl.constexpr,
                  BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_P2)
    row_mask = rows < T
    mask = row_mask[:, None] & (cols < E)[None, :]
    x = tl.load(Logits + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    # Padding columns, and NaN (a padded row's garbage): never chosen while a real expert is
    # left, so a row of NaN still names k distinct experts in range.
    x = tl.where((cols < E)[None, :] & (x == x), x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    taken = (cols >= E)[None, :] | (rows < 0)[:, None]     # [BLOCK_T, E_P2]
    ks = tl.arange(0, K_P2)
    weights = tl.zeros([BLOCK_T, K_P2], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_P2], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), x), axis=1)
        hit = (x == best[:, None]) & ~taken
        idx = tl.min(tl.where(hit, cols[None, :], E_P2), axis=1)   # ties: the lower id
        pick = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(pick, p, 0.0), axis=1)
        weights = tl.where(ks[None, :] == j, w[:, None], weights)
        ids = tl.where(ks[None, :] == j, idx[:, None].to(tl.int64), ids)
        taken = taken | pick
    if NORM:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = rows[:, None] * TOP_K + ks[None, :]
    out_mask = row_mask[:, None] & (ks < TOP_K)[None, :]
    tl.store(Weights + out, weights.to(Weights.dtype.element_ty), mask=out_mask)
    tl.store(Ids + out, ids, mask=out_mask)


def route_topk(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """models.moe.route's result from one launch: (weights [T, k] in the logits' dtype,
    expert ids [T, k] int64). No host sync (CUDA graphs)."""
    assert router_logits.dim() == 2 and router_logits.stride(1) == 1
    T, E = router_logits.shape
    assert 0 < top_k <= E
    weights = torch.empty(T, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        _route_kernel[(triton.cdiv(T, BLOCK_T),)](
            router_logits, weights, ids, T, E, router_logits.stride(0), TOP_K=top_k,
            K_P2=triton.next_power_of_2(top_k), NORM=norm_topk_prob,
            E_P2=triton.next_power_of_2(E), BLOCK_T=BLOCK_T, num_warps=4)
    return weights, ids
