"""kernels/moe_route.py (one-launch router) vs models.moe.route (Hugging Face's, in torch),
on CPU via the interpreter: the same experts' logits in the same order, the same weights.
Where logits tie (bf16 ones often do) torch.topk picks either; the kernel the lower id,
which a stable descending sort gives independently."""
from __future__ import annotations

import pytest
import torch

from kernels.moe_route import route_topk
from models.moe import route

from triton_device import DEVICE, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("tokens,experts,top_k,norm,dtype", [
    (1, 128, 8, True, torch.bfloat16),      # Qwen3-30B-A3B, one decode token
    (40, 128, 8, True, torch.bfloat16),     # several programs, the last one partial
    (17, 7, 3, False, torch.float32),       # experts not a power of two, no renormalising
    (5, 60, 4, True, torch.float16),
    (3, 5, 5, False, torch.float32),        # k = E: every expert
])
def test_route_topk_matches_reference(tokens, experts, top_k, norm, dtype) -> None:
    g = torch.Generator().manual_seed(tokens * 1000 + experts)
    logits = (torch.randn(tokens, experts, generator=g) * 2).to(dtype).to(DEVICE)
    weights, ids = route_topk(logits, top_k, norm)
    ref_weights, ref_ids = route(logits, top_k, norm)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    stable = torch.sort(logits.float().cpu(), dim=1, descending=True, stable=True).indices
    assert torch.equal(ids.cpu(), stable[:, :top_k])
    chosen = logits.cpu().gather(1, ids.cpu())
    assert torch.equal(chosen, logits.cpu().gather(1, ref_ids.cpu()))   # same up to ties
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(weights.float().cpu(), ref_weights.float().cpu(), atol=tol, rtol=tol)


def test_strided_logits_dead_experts_and_ties() -> None:
    """Logits a column slice of a wider buffer; an expert at -inf is never chosen while a
    finite one is left; equal logits go to the lower id."""
    wide = torch.zeros(4, 12, device=DEVICE)
    logits = wide[:, :9]
    logits[:] = torch.tensor([0.0, 1.0, 1.0, -1.0, 3.0, float("-inf"), 1.0, 0.5, 2.0])
    weights, ids = route_topk(logits, 4, False)
    assert ids.tolist() == [[4, 8, 1, 2]] * 4
    ref_weights, _ = route(logits.contiguous(), 4, False)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
    only_two = torch.full((2, 6), float("-inf"), device=DEVICE)
    only_two[:, 3], only_two[:, 1] = 0.0, 1.0
    weights, ids = route_topk(only_two, 3, True)      # a third expert of weight 0, not a repeat
    assert ids[:, :2].tolist() == [[1, 3]] * 2 and set(ids[:, 2].tolist()) <= {0, 2, 4, 5}
    assert (weights[:, 2] == 0).all() and torch.allclose(weights.sum(1), torch.ones(2, device=DEVICE))


def test_nan_rows_still_name_distinct_experts_in_range() -> None:
    """A padded row's garbage must not send the grouped GEMMs out of bounds."""
    logits = torch.full((3, 10), float("nan"), device=DEVICE)
    logits[1, 4] = 2.0                                     # one real logit among NaN
    _, ids = route_topk(logits, 3, True)
    assert ids.tolist() == [[0, 1, 2], [4, 0, 1], [0, 1, 2]]


def test_no_tokens() -> None:
    weights, ids = route_topk(torch.empty(0, 8, device=DEVICE), 2, True)
    assert weights.shape == ids.shape == (0, 2)
