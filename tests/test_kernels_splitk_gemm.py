"""kernels/splitk_gemm.py against torch (F.linear in fp32) in the Triton interpreter."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.splitk_gemm import WORKSPACE, GemmConfig, splitk_gemm  # noqa: E402


@pytest.mark.parametrize("m,n,k,config", [
    (131, 96, 256, GemmConfig(64, 32, 64, 4)),     # split K, ragged last row tile
    (5, 40, 200, GemmConfig(16, 32, 64, 3)),       # K not a multiple of the split: masks
    (33, 64, 128, GemmConfig(32, 32, 32, 1)),      # no split: direct store
])
def test_splitk_gemm_matches_torch_and_rearms(m, n, k, config):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    y = splitk_gemm(x, w, config)
    exact = (x.float() @ w.float().T).to(torch.bfloat16)   # one rounding of the fp32 sum
    torch.testing.assert_close(y, exact, atol=0, rtol=1e-2)
    assert torch.equal(y, splitk_gemm(x, w, config))        # deterministic
    counts = WORKSPACE.count.get(torch.device("cpu"))
    assert counts is None or not counts.any()               # every tile counter reset
