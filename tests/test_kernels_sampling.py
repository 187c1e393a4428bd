"""Fused Gumbel-max sampling kernel vs its torch reference (TRITON_INTERPRET=1 on CPU)."""
import os

import pytest

if os.environ.get("NANOSERVE_GPU_TESTS"):   # CPU tensors through the interpreter only; on CUDA
    pytest.skip("tests/gpu/test_sampling_gpu.py checks these kernels", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from kernels.sampling import gumbel_sample, gumbel_sample_ref


def _inputs(n=6, v=2500, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    temps = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 0.0][:n], dtype=torch.float32)
    seeds = torch.randint(0, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    return logits, temps, seeds


def test_matches_reference_given_the_same_noise():
    logits, temps, seeds = _inputs()
    tokens, logprobs, uniform = gumbel_sample(logits, temps, seeds, return_uniform=True)
    assert ((uniform > 0) & (uniform < 1)).all()
    ref_tokens, ref_logprobs = gumbel_sample_ref(logits, temps, uniform)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens[temps == 0], logits[temps == 0].argmax(-1))


def test_half_precision_logits_and_a_strided_view():
    logits, temps, seeds = _inputs(dtype=torch.float16)
    wide = torch.zeros(6, 3000, dtype=torch.float16)
    wide[:, :2500] = logits
    tokens, logprobs, uniform = gumbel_sample(wide[:, :2500], temps, seeds, return_uniform=True)
    ref_tokens, ref_logprobs = gumbel_sample_ref(logits, temps, uniform)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=2e-3, rtol=2e-3)


def test_noise_is_uniform_and_keyed_by_seed():
    """Exact Gumbel-max given U (tested above) samples softmax(logits / T) exactly when U is
    uniform: check U's moments and quantiles, and that equal seeds give equal noise."""
    logits, temps, seeds = _inputs(n=4, v=5000)
    _, _, u = gumbel_sample(logits, temps, seeds, return_uniform=True)
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    q = torch.quantile(u.flatten(), torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9]))
    assert torch.allclose(q, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9]), atol=0.01)
    assert not torch.allclose(u[0], u[1])                    # rows with other seeds differ
    same = seeds.clone()
    same[1] = same[0]
    _, _, u2 = gumbel_sample(logits, temps, same, return_uniform=True)
    assert torch.equal(u2[0], u2[1]) and torch.equal(u2[0], u[0])


def test_rows_split_over_several_programs_merge_like_one_pass():
    """A row wider than CHUNK is cut over programs; the merge must pick the best score with
    the smallest index across pieces (ties across pieces included) and sum the pieces'
    logsumexp, as one pass over the row would."""
    from kernels.sampling import CHUNK
    v = 2 * CHUNK + 77                          # three pieces, the last one short
    logits, temps, seeds = _inputs(n=5, v=v, seed=3)
    logits[0, [CHUNK + 5, 2 * CHUNK + 9]] = 50.0          # greedy tie in pieces 1 and 2
    logits[5 - 1, [7, CHUNK + 7]] = 60.0                  # greedy tie in pieces 0 and 1
    temps = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.0])
    tokens, logprobs, uniform = gumbel_sample(logits, temps, seeds, return_uniform=True)
    ref_tokens, ref_logprobs = gumbel_sample_ref(logits, temps, uniform)
    assert tokens[0] == CHUNK + 5 and tokens[4] == 7
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)


def test_variants_without_logprobs_or_noise_draw_the_same_tokens():
    logits, temps, seeds = _inputs(n=6, v=3000, seed=5)
    tokens, logprobs = gumbel_sample(logits, temps, seeds)
    fast, none = gumbel_sample(logits, temps, seeds, logprobs=False)
    assert none is None and torch.equal(fast, tokens)
    zero = torch.zeros_like(temps)
    greedy, glp = gumbel_sample(logits, zero, seeds, greedy=True)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(greedy, gumbel_sample(logits, zero, seeds)[0])
    torch.testing.assert_close(glp, torch.log_softmax(logits, -1).gather(1, greedy[:, None])[:, 0])
