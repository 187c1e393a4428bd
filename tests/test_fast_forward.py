"""Fast-forward tokens end to end (the scheduler's default): a real worker and the control
plane on loopback, a random-weight tiny Qwen3.

Where a format forces its next tokens, the engine core appends them without a sampling step
and the worker computes them as extra decode rows of the next step. Checked against
independent references: every completion validates (jsonschema); greedy completions are,
token by token, Hugging Face's argmax over what the format allows wherever the format left
a choice (teacher-forced logits of the whole output: the KV the extra rows wrote must be
right for that); free requests in the same steps stay token-exact with HF greedy; the
engine core's forced tokens always match what the worker sampled.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
import torch
import transformers
from llguidance import LLMatcher

from nanoserve.grammar_tokenizer import load_tokenizer
from nanoserve.v1 import generate_pb2
from scheduler_service.constraints import grammar_for
from services import generation_stub
from test_structured import hf_greedy
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
VOCAB, EOS = 389, 0
SCHEMA = {   # fixed keys between short values: long forced runs
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5},
                   "city": {"type": "string", "maxLength": 5},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2}},
    "required": ["name", "city", "age", "tags"],
    "additionalProperties": False,
}
FORMAT = generate_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=11)


@pytest.fixture(scope="module")
def stub(model_dir):
    with generation_stub(model_dir, extra=["--fast-forward"]) as stub:
        yield stub


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def request(prompt, constrained=True, **sampling) -> generate_pb2.GenerateRequest:
    params = generate_pb2.SamplingParams(**sampling)
    if constrained:
        params.structured.CopyFrom(FORMAT)
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), sampling=params,
                                        skip_special_tokens=True)


def stats(stub) -> generate_pb2.Stats:
    return stub.GetStats(generate_pb2.StatsRequest())


def test_sampled_completions_validate_and_forced_tokens_skip_steps(stub, hf_model):
    before = stats(stub)
    free = [[7, 8, 9, 10], [20 + i for i in range(30)]]
    with ThreadPoolExecutor(16) as pool:
        constrained = [pool.submit(stub.Complete, request([3, 5 + seed % 7, 11], temperature=1.0,
                                                          seed=seed, max_tokens=200), timeout=120)
                       for seed in range(16)]
        greedy = [pool.submit(stub.Complete, request(p, False, temperature=0.0, max_tokens=24,
                                                     ignore_eos=True), timeout=120) for p in free]
        for p, f in zip(free, greedy):   # free rows share steps with fast-forward rows
            assert list(f.result().token_ids) == hf_greedy(hf_model, p, 24)
        answers = [f.result() for f in constrained]
    stopped = [a for a in answers if a.finish_reason == generate_pb2.FINISH_REASON_STOP]
    assert len(stopped) >= 14, [a.text for a in answers]
    for a in stopped:
        jsonschema.validate(json.loads(a.text), SCHEMA)
    after = stats(stub)
    generated = after.num_generated_tokens - before.num_generated_tokens
    forced = after.num_fast_forward_tokens - before.num_fast_forward_tokens
    assert forced > 0.3 * sum(len(a.token_ids) for a in answers), (forced, generated)
    assert after.num_fast_forward_mismatches == 0


def test_greedy_is_the_masked_argmax_of_hf_wherever_the_format_leaves_a_choice(stub, hf_model,
                                                                               model_dir):
    tokenizer = load_tokenizer(str(model_dir), VOCAB, EOS)
    grammar = grammar_for("json_schema", json.dumps(SCHEMA))
    checked = 0
    for prompt in ([3, 4, 5], [30, 31, 32, 33, 34, 35, 36], [100]):
        a = stub.Complete(request(prompt, temperature=0.0, max_tokens=200), timeout=120)
        assert a.finish_reason == generate_pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads(a.text), SCHEMA)
        out = list(a.token_ids)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:]
        m = LLMatcher(tokenizer, grammar)
        for i, token in enumerate(out):
            mask = np.frombuffer(m.compute_bitmask(), np.uint8)
            allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[:VOCAB])
            assert token in allowed, (i, token)
            if not m.compute_ff_tokens() and len(allowed) > 1:   # the model chose here
                assert token == int(allowed[logits[i, allowed].argmax()]), (prompt, i)
                checked += 1
            m.consume_token(token)
    assert checked >= 10
    assert stats(stub).num_fast_forward_mismatches == 0


def test_what_a_format_forces_before_any_sample_needs_no_step(stub, model_dir):
    """The schema's opening ('{"name": "') is forced: a request for 3 tokens gets them at
    admission, ends with "length", and no step runs; one for more tokens prefills them."""
    tokenizer = load_tokenizer(str(model_dir), VOCAB, EOS)
    opening = LLMatcher(tokenizer, grammar_for("json_schema", json.dumps(SCHEMA))).compute_ff_tokens()
    assert len(opening) > 3
    before = stats(stub)
    a = stub.Complete(request([3, 4, 5], temperature=1.0, seed=1, max_tokens=3), timeout=30)
    after = stats(stub)
    assert list(a.token_ids) == opening[:3] and a.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert after.num_steps == before.num_steps
    b = stub.Complete(request([3, 4, 5], temperature=1.0, seed=1, max_tokens=200), timeout=60)
    assert list(b.token_ids[:len(opening)]) == opening


def test_preempted_and_resumed_under_a_small_kv_cache_still_valid(model_dir):
    """A KV cache of 30 blocks of 8 tokens for 8 concurrent completions: sequences are
    preempted with forced tokens known ahead of their step in flight, and re-prefilled."""
    with generation_stub(model_dir, extra=["--fast-forward", "--num-kv-blocks", "30"]) as stub:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda seed: stub.Complete(
                request([3, 5 + seed, 11], temperature=1.0, seed=seed, max_tokens=120),
                timeout=120), range(8)))
        s = stats(stub)
        assert s.num_preemptions > 0 and s.num_fast_forward_tokens > 0
        assert s.num_fast_forward_mismatches == 0
    for a in answers:
        if a.finish_reason == generate_pb2.FINISH_REASON_STOP:
            jsonschema.validate(json.loads(a.text), SCHEMA)
    assert sum(a.finish_reason == generate_pb2.FINISH_REASON_STOP for a in answers) >= 6


def test_siblings_fast_forward_each_on_their_own(stub):
    """n = 3 completions of one request: each sibling follows its own matcher (the first's
    forced opening is prefilled with its prompt, the others find the prompt's blocks in
    the prefix cache and get the opening at their own admission)."""
    before = stats(stub)
    a = stub.Complete(request([9, 8, 7, 6, 5, 4, 3, 2, 1], temperature=1.0, seed=5, n=3,
                              max_tokens=200), timeout=120)
    assert len(a.choices) == 3
    texts = {c.text for c in a.choices}
    assert len(texts) == 3, texts   # seeds seed, seed + 1, seed + 2
    for c in a.choices:
        assert c.finish_reason == generate_pb2.FINISH_REASON_STOP, c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    after = stats(stub)
    assert after.num_fast_forward_tokens > before.num_fast_forward_tokens
    assert after.num_fast_forward_mismatches == 0
