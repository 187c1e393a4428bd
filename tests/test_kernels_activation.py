"""Fused SiLU-and-mul Triton kernel vs its torch reference (interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref

from triton_device import DEVICE, needs_triton

pytestmark = needs_triton


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


@pytest.mark.parametrize("rows", [3, 130])        # 130: _scaled_mm's zero padding to 256 rows
def test_silu_and_mul_fp8_rows(rows: int) -> None:
    """fp8=True: the same output, plus its e4m3 copy bit for bit as quantize_rows makes it
    from that output (what an FP8 GEMM would quantize), zero rows past the tokens."""
    from kernels.fp8_linear import QuantizedRows, fp8_rows, quantize_rows
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 2 * 96, generator=g)).bfloat16().to(DEVICE)
    rows_q = silu_and_mul(x, fp8=True)
    assert isinstance(rows_q, QuantizedRows)
    plain = silu_and_mul(x)
    assert torch.equal(rows_q.x, plain)
    q, scale = quantize_rows(plain.cpu())   # CPU: IEEE divisions (CUDA's torch multiplies
    # by 1/448 for the scale, 1 ulp off)
    assert rows_q.q.shape == (fp8_rows(rows), 96) and rows_q.scale.shape == (fp8_rows(rows), 1)
    assert torch.equal(rows_q.q[:rows].float().cpu(), q.float())
    assert torch.equal(rows_q.scale[:rows].cpu(), scale)
    assert not rows_q.q[rows:].float().any()
