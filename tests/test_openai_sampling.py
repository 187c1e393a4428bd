"""OpenAI sampling fields served by the sampler's n, penalties and top-k logprobs
(generate.proto fields 11-15): the HTTP answer must equal the gRPC answer to the same
request, token for token, and the fields must change what is sampled.
"""
from __future__ import annotations

import openai
import pytest

from test_openai_api import CHAT, grpc_complete, tiny  # noqa: F401  (tiny is a fixture)

pytestmark = pytest.mark.slow
PROMPT = "Once upon"


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.8), ("presence_penalty", 1.5),
                                         ("frequency_penalty", 1.5)])
def test_penalties_match_grpc_and_change_the_output(tiny, field, value):
    client, stub, model = tiny
    plain = grpc_complete(stub, PROMPT, temperature=0, max_tokens=24, ignore_eos=True).text
    ref = grpc_complete(stub, PROMPT, temperature=0, max_tokens=24, ignore_eos=True,
                        **{field: value}).text
    assert ref != plain, f"{field}={value} should change a greedy 24-token completion"
    extra = {"ignore_eos": True}
    kw = {field: value} if field != "repetition_penalty" else {}
    if field == "repetition_penalty":
        extra[field] = value   # a vLLM extra, not in the SDK's signature
    r = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=24,
                                  extra_body=extra, **kw)
    assert r.choices[0].text == ref


def test_chat_top_logprobs_match_grpc(tiny):
    client, stub, model = tiny
    ref = grpc_complete(stub, CHAT, temperature=0, max_tokens=6, ignore_eos=True, logprobs=True,
                        top_logprobs=3)
    r = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.top_logprobs) == 6
    for entry, top in zip(content, ref.top_logprobs):
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(list(top.logprobs), abs=1e-5)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy


def test_completion_logprobs_int_gives_top_k(tiny):
    client, stub, model = tiny
    r = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=5,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 5
    for sampled, tops in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(tops) <= 2 and max(tops.values()) == pytest.approx(sampled, abs=1e-5)


def test_n_matches_grpc_choices(tiny):
    """n completions of one prompt (siblings sharing its KV) equal gRPC's choices."""
    client, stub, model = tiny
    ref = grpc_complete(stub, CHAT, temperature=1.0, seed=11, n=3, max_tokens=6, ignore_eos=True)
    r = client.chat.completions.create(model=model, messages=CHAT, temperature=1.0, seed=11, n=3,
                                       max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.message.content for c in r.choices] == [c.text for c in ref.choices]
    assert r.usage.completion_tokens == ref.usage.completion_tokens == 18
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens


def test_out_of_range_values_are_400(tiny):
    client, _, model = tiny
    for kw in (dict(presence_penalty=3.0), dict(frequency_penalty=-2.5), dict(n=17),
               dict(extra_body={"repetition_penalty": 0})):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2, **kw)
