"""Speculative decoding end to end: a real worker and the control plane on loopback, a
random-weight tiny Qwen3, `--speculative ngram` plus requests' predictions.

The reference is no speculation: Hugging Face greedy for greedy requests, and the same
server with `speculative = false` for seeded sampling, logprobs and stops. Proposals must
change only speed: every stream equals the reference token for token, whatever the
proposal (the exact answer, a corrupted one, an unrelated one, one longer or shorter than
the answer), and the step counters show the proposals were really verified.
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import torch
import transformers

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import KILLED_LOG, engine_idle, kill, start_scheduler, start_worker, wait_until
from test_structured import hf_greedy
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
VOCAB = 389
K = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=21)


@pytest.fixture(scope="module")
def served(model_dir):
    """(gRPC stub, openai client) of a scheduler running --speculative ngram."""
    worker = start_worker(model_dir)
    sched = None
    try:
        # (not adaptive: on 2 CPU cores a decode row can cost more than an n-gram is worth,
        # and the tests below assert that proposals were verified, in either order)
        sched = start_scheduler(model_dir, [worker.port], block_size=4, extra=[
            "--speculative", "ngram", "--num-speculative-tokens", str(K), "--http-port", "0",
            "--served-model-name", "tiny", "--no-speculative-adaptive"])
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as channel:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{sched.http_port}/v1",
                                   api_key="unused", max_retries=0, timeout=120)
            yield generate_pb2_grpc.GenerationStub(channel), client
    finally:
        if sched:
            sched.stop()
        worker.stop()


@pytest.fixture(scope="module")
def stub(served):
    return served[0]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def request(prompt, prediction=None, **sampling) -> generate_pb2.GenerateRequest:
    params = generate_pb2.SamplingParams(**sampling)
    if prediction is not None:
        params.prediction.token_ids.ids.extend(prediction)
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), sampling=params)


def stats(stub) -> generate_pb2.Stats:
    return stub.GetStats(generate_pb2.StatsRequest())


PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [30 + i for i in range(20)], [7]]


def test_greedy_predictions_of_every_quality_equal_hf(stub, hf_model):
    """Exact, corrupted, unrelated, longer and shorter predictions: the output is HF greedy;
    an exact prediction is never rejected."""
    rng = random.Random(0)
    before = stats(stub)
    for prompt in PROMPTS:
        ref = hf_greedy(hf_model, prompt, 40)
        half = [t if (i // 5) % 2 == 0 else (t + 1) % VOCAB for i, t in enumerate(ref)]
        cases = {"exact": ref, "half": half, "wrong": [rng.randrange(VOCAB) for _ in ref],
                 "longer": ref + ref[:10], "shorter": ref[:15], "none": None}
        for name, prediction in cases.items():
            out = stub.Complete(request(prompt, prediction, temperature=0.0, max_tokens=40,
                                        ignore_eos=True), timeout=120)
            assert list(out.token_ids) == ref, name
            u = out.usage
            if name == "exact":   # (how many are proposed is the cost model's choice)
                assert u.accepted_prediction_tokens >= 15 and u.rejected_prediction_tokens == 0, u
            if prediction is None:
                assert u.accepted_prediction_tokens == u.rejected_prediction_tokens == 0
            elif name != "wrong":   # (an unrelated one may never meet the output)
                assert u.accepted_prediction_tokens > 0, name
    after = stats(stub)
    assert after.num_verify_steps > before.num_verify_steps
    assert after.num_spec_accepted_tokens > before.num_spec_accepted_tokens
    assert wait_until(lambda: engine_idle(stub)), "blocks leaked"


def test_ngram_greedy_equals_hf(stub, hf_model):
    """Greedy requests with n-gram proposals equal HF greedy, alone and concurrently (where
    the measured cost of a row may stop proposals). Alone, the second prompt's output
    repeats a token (368 368 ...), which n-grams predict: proposals are accepted."""
    before = stats(stub)
    prompt = PROMPTS[1]
    out = stub.Complete(request(prompt, temperature=0.0, max_tokens=48, ignore_eos=True), timeout=120)
    assert list(out.token_ids) == hf_greedy(hf_model, prompt, 48)
    after = stats(stub)
    assert after.num_spec_accepted_tokens > before.num_spec_accepted_tokens
    prompts = PROMPTS + [[11, 12, 11, 12, 11, 12], [100 + 3 * i for i in range(30)]]
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(stub.Complete, request(p, temperature=0.0, max_tokens=48, ignore_eos=True),
                            timeout=120) for p in prompts]
        outs = [list(f.result().token_ids) for f in futs]
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(hf_model, p, 48)


def test_stops_and_limits_inside_an_accepted_run(stub, hf_model):
    """A stop id, a max_tokens and min_tokens that fall inside a run of accepted proposals
    end the output exactly where they would without speculation."""
    prompt = PROMPTS[0]
    ref = hf_greedy(hf_model, prompt, 40)
    stop_id = ref[9]
    first = ref.index(stop_id)
    out = stub.Complete(request(prompt, ref, temperature=0.0, max_tokens=40, ignore_eos=True,
                                stop_token_ids=[stop_id]), timeout=60)
    assert list(out.token_ids) == ref[:first + 1]
    assert out.finish_reason == generate_pb2.FINISH_REASON_STOP
    for max_tokens in (1, 2, 3, 7):
        out = stub.Complete(request(prompt, ref, temperature=0.0, max_tokens=max_tokens,
                                    ignore_eos=True), timeout=60)
        assert list(out.token_ids) == ref[:max_tokens]
        assert out.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    plain = stub.Complete(request(prompt, None, temperature=0.0, max_tokens=40, ignore_eos=True,
                                  stop_token_ids=[stop_id], min_tokens=first + 2,
                                  speculative=False), timeout=60)
    spec = stub.Complete(request(prompt, ref, temperature=0.0, max_tokens=40, ignore_eos=True,
                                 stop_token_ids=[stop_id], min_tokens=first + 2), timeout=60)
    assert list(spec.token_ids) == list(plain.token_ids) and len(plain.token_ids) > first + 1


def test_seeded_sampling_and_logprobs_equal_no_speculation(stub):
    """A seeded request's noise is keyed by position, so accepting a proposal that equals
    the draw leaves every later draw as it was: the same tokens (and logprobs) with the
    prediction of its own answer, of a corrupted one and of none, n = 2 included."""
    prompt = PROMPTS[1]
    kw = dict(temperature=0.8, top_p=0.9, seed=1234, max_tokens=40, ignore_eos=True,
              logprobs=True, top_logprobs=2, n=2)
    plain = stub.Complete(request(prompt, None, speculative=False, **kw), timeout=60)
    answer = list(plain.choices[0].token_ids)
    for prediction in (answer, answer[:10] + [1, 2, 3] + answer[13:]):
        spec = stub.Complete(request(prompt, prediction, **kw), timeout=60)
        for a, b in zip(plain.choices, spec.choices):
            assert list(a.token_ids) == list(b.token_ids)
            assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=1e-4)
            assert [list(t.token_ids) for t in a.top_logprobs] == \
                [list(t.token_ids) for t in b.top_logprobs]
        assert spec.usage.accepted_prediction_tokens > 0


def test_bad_predictions_are_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(request([1, 2], [VOCAB + 5]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(request([1, 2], [3] * 100_000), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in e.value.details()


def test_openai_prediction(served, hf_model):
    """OpenAI's `prediction` on completions and chat: same output as without it, and the
    usage's completion_tokens_details counts; a malformed prediction is a 400."""
    stub, client = served
    plain = client.completions.create(model="tiny", prompt="hello world", max_tokens=30,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    text = plain.choices[0].text
    spec = client.completions.create(model="tiny", prompt="hello world", max_tokens=30,
                                     temperature=0.0, extra_body={
                                         "ignore_eos": True,
                                         "prediction": {"type": "content", "content": text}})
    assert spec.choices[0].text == text
    details = spec.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                temperature=0.0)
    plain = client.chat.completions.create(**chat)
    answer = plain.choices[0].message.content
    spec = client.chat.completions.create(
        **chat, prediction={"type": "content", "content": [{"type": "text", "text": answer}]})
    assert spec.choices[0].message.content == answer
    for bad in ({"type": "content", "content": 5}, {"type": "other", "content": "x"}, "text"):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**chat, extra_body={"prediction": bad})


@pytest.mark.parametrize("victim", ["worker", "engine-core"])
def test_killed_mid_speculation_streams_finish_identical(model_dir, hf_model, victim):
    """A worker SIGKILLed while predictions are verified: the engine core re-prefills every
    sequence (rejected proposals' KV is gone with the rest) and proposes again. The engine
    core SIGKILLed: each frontend stream resumes on the new core with its tokens and its
    prediction. Greedy streams equal HF greedy; a seeded sampled one equals its run without
    speculation; no block is left in use."""
    worker = start_worker(model_dir)
    sched = start_scheduler(model_dir, [worker.port], block_size=4,
                            extra=["--speculative", "ngram", "--num-speculative-tokens", "3"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            n = 120
            prompts = [PROMPTS[0], PROMPTS[1], [40 + i for i in range(12)]]
            refs = [hf_greedy(hf_model, p, n) for p in prompts]
            seeded = dict(temperature=0.9, seed=77, max_tokens=n, ignore_eos=True)
            plain = list(stub.Complete(request(PROMPTS[2], speculative=False, **seeded),
                                       timeout=120).token_ids)
            # right for 30 tokens, then unrelated: streams slow down to a token a step
            reqs = [request(p, ref[:30] + [5] * 40, temperature=0.0, max_tokens=n, ignore_eos=True)
                    for p, ref in zip(prompts, refs)]
            reqs.append(request(PROMPTS[2], plain[:30] + [5] * 40, **seeded))
            streams = [stub.Generate(r, timeout=180) for r in reqs]
            got = [[] for _ in streams]
            while len(got[0]) < 40:
                got[0] += next(streams[0]).token_ids
            worker = kill(victim, sched, worker, model_dir)
            for i, s in enumerate(streams):
                for chunk in s:
                    got[i] += chunk.token_ids
            assert KILLED_LOG[victim] in sched.output()
            assert got == refs + [plain]
            assert wait_until(lambda: engine_idle(stub)), "blocks leaked"
    finally:
        sched.stop()
        worker.stop()


def test_structured_output_with_predictions_and_ngrams(stub):
    """Constrained requests speculate too: the engine core cuts what the format forbids
    from a proposal, the sampling rank masks every verify row with the grammar's state
    after the proposals before it (llguidance's draft masks) and takes in the accepted run.
    Greedy output equals the same request without speculation (fast-forward on in both),
    sampled output validates; corrupted predictions and n-grams alike; no mismatch between
    the engine core's forced tokens and the worker's samples."""
    from test_structured import FORMATS, judge
    before = stats(stub)
    for kind in ("json_schema", "regex", "grammar"):
        fmt = generate_pb2.StructuredOutput(**FORMATS[kind])
        for prompt in ([3, 5, 11], [3, 9, 11, 20]):
            def req(prediction=None, **kw):
                r = request(prompt, prediction, max_tokens=120, **kw)
                r.sampling.structured.CopyFrom(fmt)
                r.skip_special_tokens = True
                return r
            plain = stub.Complete(req(temperature=0.0, speculative=False), timeout=120)
            judge(kind, plain.text)
            ids = list(plain.token_ids)
            bad = [t if i % 5 else (t + 1) % VOCAB for i, t in enumerate(ids)]
            for prediction in (ids, bad, None):
                out = stub.Complete(req(prediction, temperature=0.0), timeout=120)
                assert list(out.token_ids) == ids, (kind, prediction is ids)
            sampled = stub.Complete(req(ids, temperature=1.0, seed=3), timeout=120)
            judge(kind, sampled.text)
    after = stats(stub)
    assert after.num_spec_accepted_tokens > before.num_spec_accepted_tokens
    assert after.num_fast_forward_mismatches == 0


def test_penalties_with_predictions_equal_no_speculation(stub):
    """Repetition, presence and frequency penalties: a verify row counts the proposals
    before it as output, and only the accepted run is counted after the step. Greedy and
    seeded outputs equal the same requests without speculation, with exact, corrupted and
    no predictions, n-grams on."""
    for pen in (dict(repetition_penalty=1.3), dict(presence_penalty=1.5, frequency_penalty=0.7)):
        for kw in (dict(temperature=0.0), dict(temperature=0.9, seed=11)):
            prompt = PROMPTS[1]
            plain = stub.Complete(request(prompt, None, speculative=False, max_tokens=60,
                                          ignore_eos=True, **pen, **kw), timeout=120)
            ids = list(plain.token_ids)
            for prediction in (ids, ids[:20] + [7] * 5 + ids[25:], None):
                out = stub.Complete(request(prompt, prediction, max_tokens=60, ignore_eos=True,
                                            **pen, **kw), timeout=120)
                assert list(out.token_ids) == ids, (pen, kw)
                if prediction is ids:
                    assert out.usage.accepted_prediction_tokens > 0


def test_a_stop_string_inside_an_accepted_run(stub):
    """Tokens of an accepted run arrive together; the frontend still ends the text before
    the first stop string and reports STOP, as without speculation."""
    base = request(PROMPTS[1], None, temperature=0.0, max_tokens=60, ignore_eos=True)
    base.skip_special_tokens = True
    plain = stub.Complete(base, timeout=60)
    ids, text = list(plain.token_ids), plain.text
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text) - 3)
                if text[i:i + 3].strip() and text.index(text[i:i + 3]) == i)
    for prediction, spec in ((None, False), (ids, True)):
        before = stats(stub)
        r = request(PROMPTS[1], prediction, temperature=0.0, max_tokens=60, ignore_eos=True,
                    stop=[stop], speculative=spec)
        r.skip_special_tokens = True
        out = stub.Complete(r, timeout=60)
        assert out.text == text[:text.index(stop)] and out.finish_reason == generate_pb2.FINISH_REASON_STOP
        # (usage's prediction counts, like cached_tokens, come with the engine core's end of
        # the request; a stop string ends it in the frontend first)
        assert (stats(stub).num_spec_accepted_tokens > before.num_spec_accepted_tokens) == spec
