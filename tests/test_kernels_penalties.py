"""Fused penalties kernel vs its torch reference (TRITON_INTERPRET=1 on CPU) and the
reference vs Hugging Face's RepetitionPenaltyLogitsProcessor."""
import os

import pytest

if os.environ.get("NANOSERVE_GPU_TESTS"):   # CPU tensors through the interpreter only; on CUDA
    pytest.skip("tests/gpu/test_sampling_gpu.py checks these kernels", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from kernels.penalties import apply_penalties_, apply_penalties_ref


def test_kernel_matches_reference_on_the_penalized_rows_only():
    g = torch.Generator().manual_seed(0)
    n, s, v = 5, 4, 2500   # vocab not a multiple of the block
    logits = torch.randn(n, v, generator=g) * 3
    logits[:, :7] = 0.0
    mask = torch.rand(s, v, generator=g) < 0.05
    counts = ((torch.rand(s, v, generator=g) < 0.05).int()
              * torch.randint(1, 4, (s, v), generator=g, dtype=torch.int32))
    rows, slots = torch.tensor([4, 0, 2]), torch.tensor([1, 3, 0])
    rep = torch.tensor([1.3, 0.7, 2.0])
    pres, freq = torch.tensor([0.5, -2.0, 0.0]), torch.tensor([1.0, 0.25, -1.5])
    out = apply_penalties_(logits.clone(), rows, slots, mask, counts, rep, pres, freq)
    ref = apply_penalties_ref(logits[rows], mask[slots], counts[slots], rep, pres, freq)
    torch.testing.assert_close(out[rows], ref, rtol=0, atol=1e-6)
    untouched = [1, 3]
    assert torch.equal(out[untouched], logits[untouched])


def test_repetition_only_is_bit_exact_against_hf():
    g = torch.Generator().manual_seed(1)
    v = 1500
    logits = torch.randn(2, v, generator=g) * 5
    history = [torch.randint(0, v, (40,), generator=g).tolist(), [3, 3, 9]]
    p = float(np.float32(1.3))
    mask = torch.zeros(2, v, dtype=torch.bool)
    for i, h in enumerate(history):
        mask[i, h] = True
    out = apply_penalties_(logits.clone(), torch.tensor([0, 1]), torch.tensor([0, 1]), mask,
                           torch.zeros(2, v, dtype=torch.int32), torch.full((2,), p),
                           torch.zeros(2), torch.zeros(2))
    for i, h in enumerate(history):
        hf = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([h]), logits[i:i + 1].clone())[0]
        assert torch.equal(out[i], hf)
