"""Fused SiLU-and-mul Triton kernel vs its torch reference (interpreter on CPU)."""
from __future__ import annotations

import os

if not os.environ.get("NANOSERVE_GPU_TESTS"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.mark.parametrize("d", [48, 1536])         # one tile padded; several column tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_ref(d: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(d)
    x = (3 * torch.randn(3, 2 * d, generator=g)).to(dtype).to(DEVICE)
    out = silu_and_mul(x)
    assert out.shape == (3, d) and out.dtype == dtype
    # bf16: torch's default tolerance (about one ulp; exp differs in the last bit)
    torch.testing.assert_close(out, silu_and_mul_ref(x))


def test_silu_and_mul_3d_and_empty() -> None:
    x = torch.randn(2, 3, 64).to(DEVICE)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=1e-5, rtol=1e-5)
    assert silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)
