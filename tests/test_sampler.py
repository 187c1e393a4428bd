"""Sampler vs torch: greedy, filters, distribution, seeds, logprobs."""
import pytest
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


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_seeded_rows_token_does_not_follow_its_neighbours_filters(monkeypatch, deterministic):
    """Where the fused kernel runs (a GPU; here the interpreter), a seeded row without
    filters draws the fused kernel's noise whether its neighbours ask for top-k or not (the
    batch is split by each row's own path), so its token is the one it gets alone. With one
    path chosen for the whole batch, a top-k neighbour moved it to the torch race's noise.
    The same under --deterministic (no path of its own there)."""
    from models import kernel_choice
    monkeypatch.setattr(kernel_choice, "FUSED_ON_CPU", True)
    monkeypatch.setattr(kernel_choice, "DETERMINISTIC", deterministic)
    logits = torch.randn(2, V)
    moved = 0
    for seed in range(12):
        p = SamplingParams(temperature=1.0, seed=seed, logprobs=True)
        alone, _ = _run(logits[:1], [p], positions=[30])
        plain = SamplingParams(temperature=1.0)
        filtered = SamplingParams(temperature=1.0, top_k=5)
        beside_plain, _ = _run(logits, [p, plain], positions=[30, 8])
        beside_filtered, lp = _run(logits, [p, filtered], positions=[30, 8])
        assert beside_plain[0] == alone[0] == beside_filtered[0], seed
        assert SamplingBatch.build([p, filtered], [30, 8], V, torch.device("cpu")).split == ([0], [1])
        torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(
            1, beside_filtered[:, None]).squeeze(1))
        one_path = SamplingBatch.build([p, filtered], [30, 8], V, torch.device("cpu"))
        one_path.split = None   # the old rule: the neighbour's top-k sent the batch to the race
        old_rule, _ = sample(logits, one_path)
        moved += int(old_rule[0] != alone[0])
    assert moved, "under the old rule the seeded row's token moved for some seed"


# ---- the rejection rule with a sampled draft's q (speculative decoding) --------------------

def _chain(p_logits, q, params, n, k, check=None):
    """n independent trials of one sequence's verify step with k sampled drafts: drafts
    d_j ~ q_j, the step's k + 1 rows sampled with check_drafts on the first k, then the
    scheduler's rule (a draft is accepted while it equals the sample before it, then that
    sample). -> [n, k + 1] output tokens (-1 past where a trial's run stopped)."""
    from worker_service.sampler import DraftCheck, sample_step
    check = check or DraftCheck
    v = p_logits.shape[1]
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True) for j in range(k)], 1)
    rows = n * (k + 1)
    logits = p_logits.repeat(n, 1)                    # row t of trial i: index i (k + 1) + t
    batch = SamplingBatch.build([params] * rows, [0] * rows, v, torch.device("cpu"))
    at = torch.arange(n * (k + 1)).view(n, k + 1)[:, :k].reshape(-1)
    samples = sample_step(logits, batch, check=check(
        rows=at, drafts=drafts.reshape(-1), q=q.repeat(n, 1))).tokens.view(n, k + 1)
    out = torch.full((n, k + 1), -1)
    alive = torch.ones(n, dtype=torch.bool)
    for j in range(k + 1):
        out[alive, j] = samples[alive, j]
        if j < k:
            alive &= samples[:, j] == drafts[:, j]
    return out


def _target(p_logits, params):
    from worker_service.sampler import distribution
    t = torch.tensor([params.temperature])
    p = distribution(p_logits[:1], t, torch.tensor([params.top_k or p_logits.shape[1]]),
                     torch.tensor([params.top_p]), None)[0]
    return p / p.sum()


def test_sampled_drafts_keep_every_token_distributed_as_the_target():
    """The rejection rule's q path (Leviathan et al.): with drafts drawn from a q far from the
    target p (and a top-p cut in p), each output position is distributed as p, the first
    one's acceptance is sum(min(p, q)); a rule that resamples a rejected draft from p instead
    of max(p - q, 0) fails this."""
    torch.manual_seed(0)
    v, k, n = 6, 2, 60_000
    p_logits = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.0, 1.0]] * (k + 1))
    params = SamplingParams(temperature=0.9, top_p=0.95)
    q = torch.tensor([[0.05, 0.1, 0.4, 0.2, 0.15, 0.1], [0.5, 0.05, 0.05, 0.1, 0.1, 0.2]])
    out = _chain(p_logits, q, params, n, k)
    p = _target(p_logits, params)
    assert p[3] == 0   # (the cut: a draft of 3 is never accepted, never sampled)
    for j in range(k + 1):   # (no stop token: every trial's position j is output, or is
        col = out[:, j]      # a later step's; given the run reached j it is still ~ p)
        seen = col[col >= 0]
        freq = torch.bincount(seen, minlength=v).double() / len(seen)
        sigma = (p.double() * (1 - p.double()) / len(seen)).sqrt()
        assert ((freq - p.double()).abs() <= 5 * sigma + 1e-9).all(), (j, freq, p)
    accepted = (out[:, 1] >= 0).double().mean()
    assert abs(accepted - torch.minimum(p, q[0]).sum()) < 0.01


def test_a_rejection_resampled_from_the_target_is_caught(monkeypatch):
    """The mutation the test above must catch: after a rejected draft, drawing from p
    instead of max(p - q, 0) over-weights what q over-proposed."""
    from worker_service import sampler
    monkeypatch.setattr(sampler, "residual", lambda p, q: p)
    torch.manual_seed(0)
    p_logits = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.0, 1.0]] * 2)
    params = SamplingParams(temperature=0.9)
    q = torch.tensor([[0.05, 0.1, 0.4, 0.2, 0.15, 0.1]])
    out = _chain(p_logits, q, params, 60_000, 1)
    freq = torch.bincount(out[:, 0], minlength=6).double() / len(out)
    assert (freq - _target(p_logits, params).double()).abs().max() > 0.03
