"""FP8 GEMM for a few tokens (kernels/fp8_linear.py: fp8_small_m_linear, e4m3 weights with
per-channel scales, activations quantized per token, the weight as the dot's left operand)
vs fp8_linear_ref, on CPU via the interpreter.

Sizes are tiny but ragged: T in {1, 5, 37}, N in {64, 200}, K in {128, 300}, so token,
channel and reduction tiles are partial; channel scales span two decades, so a scale
applied to the wrong channel (or not at all) shows.
"""
from __future__ import annotations

import itertools
import pytest
import torch

from kernels.fp8_linear import (FP8, MID_M_TILES, fp8_linear_ref, fp8_small_m_linear,
                                fp8_weight_only_ref, quantize_rows)

from triton_device import DEVICE, needs_triton

pytestmark = needs_triton


def make_case(t: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0,
              lead: tuple[int, ...] | None = None) -> tuple:
    """x [*lead or t, k] in dtype, e4m3 weights [n, k] with per-row scales, bias [n] (in
    dtype) or None; outputs are O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*(lead or (t,)), k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) / k ** 0.5 * torch.logspace(-1, 1, n)[:, None]
    w_q, w_scale = quantize_rows(w)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return (x.to(DEVICE), w_q.to(DEVICE), w_scale.to(DEVICE),
            None if b is None else b.to(DEVICE))


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: tight. bf16/fp16: both round float32 sums to the output dtype, so about one
    ulp of it apart (2e-2 relative to the output's scale leaves margin)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = ref.float().abs().max().item()
    tol = 1e-4 if ref.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


CASES = list(itertools.product([1, 5, 37], [64, 200], [128, 300]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, n, k", CASES)
def test_small_m_matches_ref(t: int, n: int, k: int, dtype: torch.dtype) -> None:
    """Ragged tokens (37: three token tiles), channels (200) and columns (300) with small
    tiles, so every mask and the loop's last partial step run; bias on and off."""
    for bias in (False, True):
        x, w_q, w_scale, b = make_case(t, n, k, dtype, bias, seed=t * n + k)
        out = fp8_small_m_linear(x, w_q, w_scale, b, block_n=32, block_k=64)
        assert_matches(out, fp8_linear_ref(x, w_q, w_scale, b))


def test_small_m_default_tiles_3d_input_and_fp16() -> None:
    """The model's tiles (64 x 256, even N and K: the unmasked loads) on a [2, 3, K] input."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w_q, w_scale, b = make_case(0, 128, 512, dtype, bias=True, seed=3, lead=(2, 3))
        out = fp8_small_m_linear(x, w_q, w_scale, b)
        assert out.shape == (2, 3, 128)
        assert_matches(out, fp8_linear_ref(x, w_q, w_scale, b))
        assert_matches(out[1], fp8_small_m_linear(x[1], w_q, w_scale, b))


@pytest.mark.parametrize("t", [17, 40, 64])
def test_mid_m_tiles(t: int) -> None:
    """fp8_linear's tiles for 17-64 tokens (32-token tiles, walked fastest: several token
    tiles share each weight tile, the last one partial at 17 and 40) on a ragged shape."""
    x, w_q, w_scale, b = make_case(t, 200, 300, torch.bfloat16, bias=True, seed=t)
    assert_matches(fp8_small_m_linear(x, w_q, w_scale, b, **MID_M_TILES),
                   fp8_linear_ref(x, w_q, w_scale, b))


def test_small_m_differs_from_wrong_references() -> None:
    """The comparison can fail: without a weight scale, with the scales of other channels,
    or with x left unquantized (the weight-only reference: within bf16 tolerances here,
    so this checks at float32 output)."""
    x, w_q, w_scale, b = make_case(5, 200, 300, torch.float32, bias=False, seed=5)
    out = fp8_small_m_linear(x, w_q, w_scale, block_n=32, block_k=64)
    assert_matches(out, fp8_linear_ref(x, w_q, w_scale))
    for wrong in (torch.ones_like(w_scale), w_scale.flip(0)):
        with pytest.raises(AssertionError):
            assert_matches(out, fp8_linear_ref(x, w_q, wrong))
    with pytest.raises(AssertionError):
        assert_matches(out, fp8_weight_only_ref(x, w_q, w_scale))
    assert w_q.dtype == FP8


def test_small_m_empty_batch() -> None:
    x, w_q, w_scale, _ = make_case(0, 64, 128, torch.bfloat16, bias=False)
    assert fp8_small_m_linear(x, w_q, w_scale).shape == (0, 64)
