"""Sampling features end to end (real worker + control plane on loopback), against HF.

n completions sharing the prompt's KV, repetition / presence / frequency penalties and
top_logprobs, on one tiny Qwen3 checkpoint. Block size 8 and a 64-token prefill budget,
so prompts are chunked and siblings find their prompt in the prefix cache.
"""
from __future__ import annotations

import grpc
import pytest
import torch
import transformers

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import start_scheduler, start_worker, wait_until
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
BLOCK = 8
VOCAB = 389


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=5)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def address(model_dir):
    worker = start_worker(model_dir)
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=BLOCK,
                                extra=["--max-num-batched-tokens", "64"])
        yield f"127.0.0.1:{sched.port}"
    finally:
        if sched:
            sched.stop()
        worker.stop()


@pytest.fixture(scope="module")
def stub(address):
    channel = grpc.insecure_channel(address)
    yield generate_pb2_grpc.GenerationStub(channel)
    channel.close()


def request(prompt, **sampling) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt),
                                        sampling=generate_pb2.SamplingParams(**sampling))


@torch.no_grad()
def hf_loop(model, prompt: list[int], n: int, presence=0.0, frequency=0.0, k=0, bias=None):
    """Greedy with HF forward passes and OpenAI's logit_bias and presence/frequency
    penalties written out; also the raw distribution's top-k at each step."""
    ids, tops = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        if k:
            vals, top = torch.log_softmax(logits, -1).topk(k)
            tops.append((top.tolist(), vals.tolist()))
        for t, b in (bias or {}).items():
            logits[t] += b
        out = ids[len(prompt):]
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], tops


PROMPTS = [[5, 9, 5, 9, 5, 9, 17], [3 + (7 * i) % 380 for i in range(70)], [11] * 13]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "chunked", "repeats"])
def test_repetition_penalty_greedy_matches_hf_generate(stub, hf_model, prompt):
    hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                           repetition_penalty=1.5, min_new_tokens=20,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected = hf[0, len(prompt):].tolist()
    plain = stub.Complete(request(prompt, temperature=0.0, max_tokens=20, ignore_eos=True),
                          timeout=60).token_ids
    assert list(plain) != expected   # the penalty changes the output
    for _ in range(2):   # the second time the prompt is in the prefix cache
        out = stub.Complete(request(prompt, temperature=0.0, max_tokens=20, ignore_eos=True,
                                    repetition_penalty=1.5), timeout=60)
        assert list(out.token_ids) == expected
    assert out.usage.cached_tokens >= (len(prompt) - 1) // BLOCK * BLOCK


def test_presence_frequency_greedy_match_the_formula(stub, hf_model):
    prompt = [7, 7, 8, 9]
    expected, _ = hf_loop(hf_model, prompt, 24, presence=0.75, frequency=1.25)
    out = stub.Complete(request(prompt, temperature=0.0, max_tokens=24, ignore_eos=True,
                                presence_penalty=0.75, frequency_penalty=1.25), timeout=60)
    assert list(out.token_ids) == expected
    assert expected != hf_loop(hf_model, prompt, 24)[0]


def test_logit_bias_greedy_matches_hf_with_the_bias_added(stub, hf_model):
    """A bias that moves the argmax now and then (not always: it is small against the
    logits' spread), with and without penalties on top, and logprobs still of the raw
    distribution."""
    prompt = [7, 7, 8, 9]
    plain, _ = hf_loop(hf_model, prompt, 24)
    bias = {plain[3]: -3.0, 250: 1.5, 17: 2.0}
    # raw: at each step, every id's log-probability before the bias
    expected, raw = hf_loop(hf_model, prompt, 24, k=VOCAB, bias=bias)
    assert expected != plain and len(set(expected)) > 2
    out = stub.Complete(request(prompt, temperature=0.0, max_tokens=24, ignore_eos=True,
                                logit_bias=bias, logprobs=True), timeout=60)
    assert list(out.token_ids) == expected
    for (ids, lps), t, lp in zip(raw, out.token_ids, out.logprobs):
        assert abs(lp - lps[ids.index(t)]) < 1e-3
    with_pen, _ = hf_loop(hf_model, prompt, 24, presence=0.75, frequency=1.25, bias=bias)
    assert with_pen != hf_loop(hf_model, prompt, 24, presence=0.75, frequency=1.25)[0]
    out = stub.Complete(request(prompt, temperature=0.0, max_tokens=24, ignore_eos=True,
                                logit_bias=bias, presence_penalty=0.75,
                                frequency_penalty=1.25), timeout=60)
    assert list(out.token_ids) == with_pen


def test_logit_bias_bans_and_forces_while_sampling(stub):
    banned = {t: -100.0 for t in range(0, VOCAB, 2)}   # every even id
    outs = [stub.Complete(request([3, 4, 5], temperature=1.0, seed=s, max_tokens=40,
                                  ignore_eos=True, logit_bias=banned), timeout=60)
            for s in range(4)]
    assert all(t % 2 for o in outs for t in o.token_ids)
    free = stub.Complete(request([3, 4, 5], temperature=1.0, seed=0, max_tokens=40,
                                 ignore_eos=True), timeout=60)
    assert any(t % 2 == 0 for t in free.token_ids)   # the ban is what kept them out
    forced = stub.Complete(request([3, 4, 5], temperature=1.0, seed=1, max_tokens=10,
                                   ignore_eos=True, logit_bias={42: 100.0}), timeout=60)
    assert list(forced.token_ids) == [42] * 10


def test_min_tokens_holds_back_stop_ids_like_hf(stub, hf_model):
    """Two ids greedy emits early as stop_token_ids: without min_tokens the output ends at
    the first; with min_tokens = 6 neither is sampled for 6 tokens (HF's min_new_tokens
    with those ids as its end-of-sequence), then the first one after ends it."""
    prompt = [7, 7, 8, 9]
    plain, _ = hf_loop(hf_model, prompt, 24)
    stops = [plain[1], plain[4]]
    early = stub.Complete(request(prompt, temperature=0.0, max_tokens=24, ignore_eos=True,
                                  stop_token_ids=stops), timeout=60)
    assert list(early.token_ids) == plain[:2]
    assert early.finish_reason == generate_pb2.FINISH_REASON_STOP
    hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                           min_new_tokens=6, eos_token_id=stops, pad_token_id=0,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected = hf[0, len(prompt):].tolist()
    assert not set(expected[:6]) & set(stops) and expected != plain[:len(expected)]
    for sampling in (dict(temperature=0.0), dict(temperature=0.0, n=2)):
        out = stub.Complete(request(prompt, max_tokens=24, ignore_eos=True, stop_token_ids=stops,
                                    min_tokens=6, **sampling), timeout=60)
        for choice in out.choices:
            assert list(choice.token_ids) == expected
    sampled = [stub.Complete(request([3, 4, 5], temperature=1.0, seed=s, max_tokens=30,
                                     ignore_eos=True, stop_token_ids=list(range(0, VOCAB, 3)),
                                     min_tokens=8), timeout=60) for s in range(4)]
    for out in sampled:   # a third of the vocabulary stops it, yet never in the first 8
        assert len(out.token_ids) > 8 and not any(t % 3 == 0 for t in out.token_ids[:8])


def test_top_logprobs_match_hf_log_softmax(stub, hf_model):
    prompt = PROMPTS[1][:20]
    expected, tops = hf_loop(hf_model, prompt, 10, presence=0.5, k=4)
    chunks = list(stub.Generate(request(prompt, temperature=0.0, max_tokens=10, ignore_eos=True,
                                        logprobs=True, top_logprobs=4, presence_penalty=0.5),
                                timeout=60))
    ids = [t for c in chunks for t in c.token_ids]
    top = [t for c in chunks for t in c.top_logprobs]
    lps = [x for c in chunks for x in c.logprobs]
    assert ids == expected and len(top) == len(lps) == 10
    for step, (t, (ref_ids, ref_vals)) in enumerate(zip(top, tops)):
        assert list(t.token_ids) == ref_ids, f"step {step}"
        assert list(t.logprobs) == pytest.approx(ref_vals, abs=1e-4)
        # the sampled id's logprob is of the raw distribution too (penalty not included)
        assert lps[step] == pytest.approx(ref_vals[ref_ids.index(ids[step])], abs=1e-4) \
            if ids[step] in ref_ids else lps[step] <= ref_vals[-1] + 1e-4


def test_n_greedy_completions_share_the_prompt(stub, hf_model):
    prompt = PROMPTS[1][:45]   # 5 full blocks + 5
    expected, _ = hf_loop(hf_model, prompt, 12)
    out = stub.Complete(request(prompt, temperature=0.0, max_tokens=12, ignore_eos=True, n=3),
                        timeout=60)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(list(c.token_ids) == expected for c in out.choices)
    assert list(out.token_ids) == expected and out.text == out.choices[0].text
    assert out.usage.prompt_tokens == 45 and out.usage.completion_tokens == 36
    # siblings 1 and 2 found completion 0's 5 full blocks in the prefix cache
    assert out.usage.cached_tokens >= 2 * 5 * BLOCK
    chunks = list(stub.Generate(request(prompt, temperature=0.0, max_tokens=12, ignore_eos=True,
                                        n=3, logprobs=True, top_logprobs=2), timeout=60))
    for i in range(3):
        mine = [c for c in chunks if c.index == i]
        assert [t for c in mine for t in c.token_ids] == expected
        assert len([t for c in mine for t in c.top_logprobs]) == 12
        assert mine[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 36
    assert sum(c.HasField("usage") for c in chunks) == 1


def test_n_seeded_is_reproducible_and_siblings_differ(stub):
    req = request([4, 5, 6, 7], temperature=1.0, seed=42, max_tokens=16, ignore_eos=True, n=3)
    a = stub.Complete(req, timeout=60)
    b = stub.Complete(req, timeout=60)
    runs = [[list(c.token_ids) for c in r.choices] for r in (a, b)]
    assert runs[0] == runs[1] and all(len(x) == 16 for x in runs[0])
    assert len({tuple(x) for x in runs[0]}) == 3
    # sibling i samples with seed + i: sibling 1 of seed 42 is completion 0 of seed 43
    single = stub.Complete(request([4, 5, 6, 7], temperature=1.0, seed=43, max_tokens=16,
                                   ignore_eos=True), timeout=60)
    assert list(single.token_ids) == runs[0][1]


def test_cancel_stops_every_completion(stub):
    total = stub.GetStats(generate_pb2.StatsRequest()).num_kv_blocks
    call = stub.Generate(request(list(range(3, 40)), temperature=0.0, max_tokens=400,
                                 ignore_eos=True, n=4), timeout=120)
    seen = set()
    while len(seen) < 4:
        seen.add(next(call).index)
    assert stub.GetStats(generate_pb2.StatsRequest()).num_running == 4
    call.cancel()
    assert wait_until(lambda: stub.GetStats(generate_pb2.StatsRequest()).num_running == 0)
    stats = stub.GetStats(generate_pb2.StatsRequest())
    assert stats.num_free_kv_blocks == total and stats.num_waiting == 0


@pytest.mark.parametrize("sampling, fragment", [
    (dict(n=0), "n must be"), (dict(n=17), "n must be"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
    (dict(top_logprobs=3), "needs logprobs"),
    (dict(logit_bias={VOCAB: 1.0}), "out of vocabulary"),
    (dict(logit_bias={5: 100.5}), "[-100, 100]"),
    (dict(logit_bias={5: float("nan")}), "[-100, 100]"),
    (dict(logit_bias={t: 1.0 for t in range(1025)}), "at most 1024"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens (9) must be <= max_tokens (8)"),
    (dict(min_tokens=2, structured=generate_pb2.StructuredOutput(regex="a+")), "output format"),
])
def test_bad_sampling_is_invalid_argument(stub, sampling, fragment):
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(request([5, 6, 7], **sampling), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()
    assert len(stub.Complete(request([5, 6, 7], max_tokens=3, ignore_eos=True), timeout=30).token_ids) == 3


def test_python_client_passes_the_new_fields(address, stub):
    from client import Client, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2, logprobs=True,
                            top_logprobs=2, frequency_penalty=1.0, logit_bias={33: 4.0})
    with Client(address) as c:
        chunks = list(c.generate([9, 8, 7], params))
    ref = stub.Complete(request([9, 8, 7], temperature=0.0, max_tokens=6, ignore_eos=True, n=2,
                                logprobs=True, top_logprobs=2, frequency_penalty=1.0,
                                logit_bias={33: 4.0}), timeout=60)
    for choice in ref.choices:
        mine = [ch for ch in chunks if ch.index == choice.index]
        assert [t for ch in mine for t in ch.token_ids] == list(choice.token_ids)
        tops = [t for ch in mine for t in ch.top_logprobs]
        assert [list(t) for t in tops] == [list(t.token_ids) for t in choice.top_logprobs]
