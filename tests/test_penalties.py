"""Penalties and top-logprobs on the worker, against independent references.

Repetition: Hugging Face's RepetitionPenaltyLogitsProcessor, exactly. Presence / frequency:
OpenAI's formula written out token by token. PenaltyState is driven like the model runner
drives it (history sent once, then its own samples counted on the device).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from nanoserve.v1 import worker_pb2
from kernels.penalties import apply_penalties_ref as apply_penalties
from worker_service.penalties import PenaltyState
from worker_service.sampler import SamplingBatch, sample_step
from worker_service.step_plan import SamplingParams, StepError

V = 97


def _dense(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of ids present, counts) [N, V] for lists of ids."""
    counts = torch.zeros(len(seqs), V, dtype=torch.int32)
    for i, ids in enumerate(seqs):
        for t in ids:
            counts[i, t] += 1
    return counts > 0, counts


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_matches_hf_processor_exactly(penalty):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    logits[0, 5] = 0.0   # the sign boundary
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 9, 30, 4)]
    outputs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (0, 5, 12, 40)]
    prompts[0].append(5)
    p32 = float(np.float32(penalty))   # the wire carries float32
    expected = torch.stack([
        RepetitionPenaltyLogitsProcessor(p32)(torch.tensor([p + o]), logits[i:i + 1].clone())[0]
        for i, (p, o) in enumerate(zip(prompts, outputs))])
    prompt_mask, _ = _dense(prompts)
    _, counts = _dense(outputs)
    got = apply_penalties(logits, prompt_mask, counts, torch.full((4,), p32),
                          torch.zeros(4), torch.zeros(4))
    assert torch.equal(got, expected)


def test_presence_frequency_match_the_formula():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g)
    prompts = [[1, 2, 3], [4] * 10, [7, 8]]
    outputs = [[1, 1, 1, 50], [], [9, 9, 8, 60, 61, 9]]
    presence, frequency = [0.5, -1.0, 2.0], [0.25, 1.5, -0.75]
    expected = logits.clone()
    for i, out in enumerate(outputs):
        for t in set(out):   # prompt ids do not count for these two
            expected[i, t] -= presence[i] + frequency[i] * out.count(t)
    prompt_mask, _ = _dense(prompts)
    _, counts = _dense(outputs)
    got = apply_penalties(logits, prompt_mask, counts, torch.ones(3), torch.tensor(presence),
                          torch.tensor(frequency))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def _reset(seq_id: int, prompt: list[int], output: list[int], **sampling) -> worker_pb2.StepRequest:
    req = worker_pb2.StepRequest(step_id=1)
    req.seqs.add(seq_id=seq_id, num_tokens=1, reset_block_table=True,
                 sampling=worker_pb2.WorkerSampling(**sampling),
                 prompt_ids_i32=np.array(prompt, "<i4").tobytes(),
                 output_ids_i32=np.array(output, "<i4").tobytes())
    return req


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
def test_state_counts_history_and_own_samples_like_hf_greedy_loop(fused):
    """Greedy decoding with a repetition penalty, the state fed as the runner feeds it,
    against HF's processor over the growing id list (fused: the Triton kernel, run by
    the interpreter here)."""
    g = torch.Generator().manual_seed(2)
    table = torch.randn(V, V, generator=g)   # a toy "model": next logits from the last id
    prompt, earlier = [3, 4, 5, 3], [6]
    state = PenaltyState(V, torch.device("cpu"), fused=fused)
    state.update(_reset(7, prompt, earlier, repetition_penalty=1.5, frequency_penalty=0.5))
    other = SamplingParams(temperature=0.0)   # an unpenalized row in the same batch
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5), other]
    batch = SamplingBatch.build(params, [0, 0], V, torch.device("cpu"))
    ids, ref_ids = prompt + earlier, prompt + earlier
    proc = RepetitionPenaltyLogitsProcessor(1.5)
    for _ in range(12):
        logits = torch.stack([table[ids[-1]], table[ids[-1]]])
        pen = state.rows([7, 8], params)
        assert pen is not None and pen.rows.tolist() == [0]
        out = sample_step(logits, batch, lambda x: state.apply(x, pen))
        state.record(pen, out.tokens)
        ref = proc(torch.tensor([ref_ids]), table[ref_ids[-1]][None].clone())[0]
        gen = ref_ids[len(prompt):]
        for t in set(gen):
            ref[t] -= 0.5 * gen.count(t)
        ref_ids = ref_ids + [int(ref.argmax())]
        ids = ids + [int(out.tokens[0])]
        assert out.tokens[1] == table[ids[-2]].argmax()   # the other row is untouched
    assert ids == ref_ids
    assert state.counts[state.slot_of[7]].sum() == 13   # earlier output + 12 samples
    drop = worker_pb2.StepRequest(step_id=2, drop_seq_ids=[7])
    state.update(drop)
    assert not state and state.rows([7], params[:1]) is None


def test_state_rejects_bad_history():
    state = PenaltyState(V, torch.device("cpu"))
    with pytest.raises(StepError, match="out of range"):
        state.update(_reset(1, [1, V], [], presence_penalty=1.0))
    with pytest.raises(StepError, match="prompt_ids"):
        state.update(_reset(2, [], [], presence_penalty=1.0))
    state.update(_reset(3, [1, 2], [], temperature=0.0))   # no penalty: no slot
    assert not state


def test_top_logprobs_are_of_the_raw_distribution():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
              SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, [0, 0, 0], V, torch.device("cpu"))
    penalize = lambda x: x - 10.0 * torch.nn.functional.one_hot(x.argmax(-1), V)   # noqa: E731
    out = sample_step(logits, batch, penalize)
    raw = torch.log_softmax(logits, -1)
    ref_vals, ref_ids = raw.topk(5, dim=-1)
    assert out.top_ids.shape == (3, 5) and torch.equal(out.top_ids, ref_ids)
    torch.testing.assert_close(out.top_logprobs, ref_vals)
    # sampled from the penalized logits (the raw argmax lost 10), logprob of the raw ones
    assert torch.equal(out.tokens, penalize(logits).argmax(-1))
    assert not torch.equal(out.tokens, logits.argmax(-1))
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.tokens[:, None])[:, 0])
    plain = sample_step(logits, SamplingBatch.build(params[2:], [0], V, torch.device("cpu")))
    assert plain.top_ids is None and plain.logprobs is None
