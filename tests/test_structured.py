"""Structured output end to end: a real worker and the control plane on loopback.

A random-weight tiny Qwen3 sampled at temperature 1 under each kind of format, many
seeds: every completion that ends with "stop" must match its format, checked by an
independent judge (jsonschema, re.fullmatch, membership, a Lark parser's language written
out as a regex); unconstrained requests in the same batch stay token-exact with Hugging
Face greedy; formats that do not compile are INVALID_ARGUMENT before any work is done.
"""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import torch
import transformers

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import (KILLED_LOG, engine_idle, generation_stub, kill, start_null_worker,
                      start_scheduler, start_worker, wait_until)
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
VOCAB = 389

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,6}@[a-z]{1,5}\.(com|org)"
CHOICES = ["red", "green", "blue sky", "yellow"]
LARK = 'start: "(" expr ")"\nexpr: NUM ("+" NUM){0,3}\nNUM: /[0-9]{1,3}/'
LARK_LANGUAGE = r"\([0-9]{1,3}(\+[0-9]{1,3}){0,3}\)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=7)


@pytest.fixture(scope="module")
def stub(model_dir):
    with generation_stub(model_dir) as stub:
        yield stub


def request(prompt, structured=None, **sampling) -> generate_pb2.GenerateRequest:
    params = generate_pb2.SamplingParams(**sampling)
    if structured is not None:
        params.structured.CopyFrom(generate_pb2.StructuredOutput(**structured))
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), sampling=params,
                                        skip_special_tokens=True)


def judge(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "grammar":
        assert re.fullmatch(LARK_LANGUAGE, text), text


FORMATS = {
    "json_schema": {"json_schema": json.dumps(SCHEMA)},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": generate_pb2.Choices(values=CHOICES)},
    "grammar": {"grammar": LARK},
}


@pytest.mark.parametrize("kind", list(FORMATS))
def test_every_sampled_completion_matches_its_format(stub, kind):
    def one(seed):
        return stub.Complete(request([3, 5 + seed % 7, 11], FORMATS[kind], temperature=1.0,
                                     seed=seed, max_tokens=160), timeout=120)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(24)))
    stopped = [a for a in answers if a.finish_reason == generate_pb2.FINISH_REASON_STOP]
    # Any JSON object has unbounded keys: a random model runs out of tokens in some.
    assert len(stopped) >= (8 if kind == "json_object" else 20), [a.text for a in answers]
    for a in stopped:
        judge(kind, a.text)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_free_requests_batched_with_constrained_ones_stay_exact_with_hf(stub, hf_model):
    """Constrained rows get masks in the same steps; the free rows' logits are untouched."""
    free = [[7, 8, 9, 10], [20 + i for i in range(30)], [3]]
    with ThreadPoolExecutor(16) as pool:
        constrained = [pool.submit(stub.Complete, request([4, 6, 8 + i], FORMATS[kind], temperature=1.0,
                                                          seed=i, max_tokens=120), timeout=120)
                       for i, kind in enumerate(list(FORMATS) * 2)]
        greedy = [pool.submit(stub.Complete, request(p, temperature=0.0, max_tokens=24,
                                                     ignore_eos=True), timeout=120) for p in free]
        for p, f in zip(free, greedy):
            assert list(f.result().token_ids) == hf_greedy(hf_model, p, 24)
        for kind, f in zip(list(FORMATS) * 2, constrained):
            a = f.result()
            if a.finish_reason == generate_pb2.FINISH_REASON_STOP:
                judge(kind, a.text)


def test_n_completions_with_penalties_each_follow_the_format(stub):
    a = stub.Complete(request([5, 6, 7], FORMATS["json_schema"], temperature=1.0, seed=3, n=4,
                              max_tokens=160, repetition_penalty=1.3, presence_penalty=0.5),
                      timeout=120)
    assert len(a.choices) == 4
    assert len({c.text for c in a.choices}) > 1   # seeds seed + i: different completions
    for c in a.choices:
        assert c.finish_reason == generate_pb2.FINISH_REASON_STOP
        judge("json_schema", c.text)


def test_greedy_constrained_is_the_masked_argmax(stub, hf_model):
    """Greedy under a choice: the first token is HF's argmax over the tokens the choice
    allows, so the completion is the choice HF likes best at that first token."""
    a = stub.Complete(request([9, 10, 11], FORMATS["choice"], temperature=0.0, max_tokens=20),
                      timeout=60)
    judge("choice", a.text)
    with torch.no_grad():
        logits = hf_model(torch.tensor([[9, 10, 11]])).logits[0, -1]
    firsts = {}
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(hf_model.name_or_path) + "/tokenizer.json")
    for c in CHOICES:   # the first token of each choice as the tokenizer splits it
        firsts.setdefault(tok.encode(c)[0], c)
    assert a.token_ids[0] == max(firsts, key=lambda t: logits[t])


@pytest.mark.parametrize("structured, fragment", [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": '{"type": "nope"}'}, "nope"),
    ({"json_schema": "[1, 2]"}, "JSON object"),
    ({"regex": "[a-z"}, "regex"),
    ({"regex": ""}, "empty"),
    ({"grammar": "start: missing_rule"}, "missing_rule"),
    ({"choice": generate_pb2.Choices(values=[])}, "choice"),
    ({"choice": generate_pb2.Choices(values=["a", ""])}, "choice"),
])
def test_formats_that_do_not_compile_are_invalid_argument(stub, structured, fragment):
    steps = lambda: stub.GetStats(generate_pb2.StatsRequest()).num_steps
    assert wait_until(lambda: engine_idle(stub))
    assert wait_until(lambda: steps() == (time.sleep(0.2), steps())[1])   # the last step answered
    before = stub.GetStats(generate_pb2.StatsRequest())
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(request([1, 2, 3], structured, max_tokens=4), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in e.value.details()
    after = stub.GetStats(generate_pb2.StatsRequest())
    assert after.num_steps == before.num_steps   # refused before any work


@pytest.mark.parametrize("flags", [["--no-fast-forward"], []], ids=["sampled", "fast-forward"])
@pytest.mark.parametrize("victim", ["worker", "engine-core"])
def test_killed_mid_stream_constrained_output_still_valid(model_dir, flags, victim):
    """A worker SIGKILLed: the new one rebuilds each matcher from the output the scheduler
    resends (with fast-forward, samples known ahead are forgotten with the steps that never
    answered). The engine core SIGKILLed: the frontend resumes each stream on the new core
    with the tokens it has; the core re-prefills them and the worker rebuilds each matcher
    from that output (with fast-forward, so does the core's own)."""
    worker = start_worker(model_dir)
    sched = start_scheduler(model_dir, [worker.port], block_size=8, extra=flags)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            schema = {"type": "array", "items": {"type": "string", "maxLength": 4},
                      "minItems": 30, "maxItems": 40}
            streams = [stub.Generate(request([3, 4 + i], {"json_schema": json.dumps(schema)},
                                             temperature=1.0, seed=i, max_tokens=400), timeout=180)
                       for i in range(4)]
            texts = ["" for _ in streams]
            finish = [None] * len(streams)
            for _ in range(10):   # 10 tokens in: every matcher has state to lose
                texts[0] += next(streams[0]).text
            worker = kill(victim, sched, worker, model_dir)
            for i, s in enumerate(streams):
                for chunk in s:
                    texts[i] += chunk.text
                    finish[i] = chunk.finish_reason
            assert KILLED_LOG[victim] in sched.output()
            for text, reason in zip(texts, finish):
                assert reason == generate_pb2.FINISH_REASON_STOP, text
                jsonschema.validate(json.loads(text), schema)
            assert stub.GetStats(generate_pb2.StatsRequest()).num_fast_forward_mismatches == 0
    finally:
        sched.stop()
        worker.stop()


def test_workers_that_cannot_follow_grammars_refuse_formats(model_dir):
    """A worker without a tokenizer llguidance reads says so (WorkerInfo.structured_output):
    formats are refused (FAILED_PRECONDITION), not silently ignored; free requests run."""
    worker = start_null_worker()   # no model directory: no tokenizer.json
    sched = start_scheduler(model_dir, [worker.port])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.Complete(request([1, 2, 3], FORMATS["regex"], max_tokens=4), timeout=30)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "tokenizer.json" in e.value.details()
            assert len(stub.Complete(request([1, 2, 3], max_tokens=4, ignore_eos=True),
                                     timeout=30).token_ids) == 4
    finally:
        sched.stop()
        worker.stop()
