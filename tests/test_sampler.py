"""Sampler vs torch: greedy, filters, distribution, seeds, logprobs."""
import torch

from worker_service.sampler import SamplingBatch, SamplingParams, sample

V = 50


def _run(logits, params, positions=None):
    positions = positions or list(range(len(params)))
    return sample(logits, SamplingBatch.build(params, positions, logits.shape[1], logits.device))


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = torch.randn(7, V)
    tokens, logprobs = _run(logits, [SamplingParams(temperature=0.0, logprobs=True)] * 7)
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_filters_that_leave_one_token_reduce_to_greedy():
    logits = torch.randn(6, V) * 3
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6),
              SamplingParams(temperature=0.7, min_p=1.0)] * 2
    tokens, logprobs = _run(logits, params)
    assert torch.equal(tokens, logits.argmax(-1))
    assert logprobs is None


def test_top_k_and_top_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0] + [-1.0] * (V - 4)]).repeat(2000, 1)
    tokens, _ = _run(logits, [SamplingParams(temperature=1.0, top_k=2)] * 2000)
    assert set(tokens.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)
    # Nucleus: smallest set whose mass reaches top_p -> the first two tokens here.
    top_p = float(probs[0] + probs[1] * 0.5)
    tokens, _ = _run(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 2000)
    assert set(tokens.tolist()) == {0, 1}


def test_sampling_follows_softmax_with_temperature():
    torch.manual_seed(1)
    n = 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]]).repeat(n, 1)
    tokens, _ = _run(logits, [SamplingParams(temperature=0.8)] * n)
    freq = torch.bincount(tokens, minlength=4).float() / n
    expected = torch.softmax(logits[0] / 0.8, -1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_min_p_drops_unlikely_tokens():
    torch.manual_seed(2)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(3000, 1)
    tokens, _ = _run(logits, [SamplingParams(temperature=1.0, min_p=0.5)] * 3000)
    assert set(tokens.tolist()) == {0, 1}   # 0.15 < 0.5 * 0.5


def test_seed_reproducible_and_independent_of_batch():
    logits = torch.randn(4, V)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone, _ = _run(logits[2:3], [p], positions=[17])
    others = [SamplingParams(temperature=1.0)] * 3
    for _ in range(3):
        batch, _ = _run(logits, others[:2] + [p] + others[2:], positions=[5, 9, 17, 3])
        assert batch[2] == alone[0]
    draws = {int(_run(logits[2:3], [p], positions=[pos])[0]) for pos in range(40)}
    assert len(draws) > 1, "the seed must mix in the position, not repeat one draw"


def test_fused_path_agrees_with_the_torch_path():
    """The fused kernel (used on GPUs) and the torch path pick the same greedy tokens and
    report the same logprobs; sampled rows draw from the same support."""
    logits = torch.randn(5, V) * 2
    params = [SamplingParams(temperature=0.0, logprobs=True)] * 3 + [SamplingParams(temperature=0.8, logprobs=True)] * 2
    batch = SamplingBatch.build(params, list(range(5)), V, torch.device("cpu"))
    assert not batch.fused                       # CPU default: the torch path
    ref_tokens, ref_logprobs = sample(logits, batch)
    batch.fused = True
    tokens, logprobs = sample(logits, batch)
    assert torch.equal(tokens[:3], ref_tokens[:3])
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)
