"""Structured output, tools and reasoning through the official `openai` client.

A tiny random Qwen3 with a Qwen3-style chat template (tools listed in a system block,
`<think>` reasoning, `enable_thinking`), real worker and control plane on loopback. The
random model would never write a tool call or a `<think>` block by itself, so the tool
tests use tool_choice "required" / a named function (enforced by a grammar) and the
reasoning tests a regex that writes the tags: what is checked is the parsing into
`tool_calls` and `reasoning_content`, whole and streamed, and that every output obeys
its format.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from services import start_scheduler, start_worker
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}\n</tool_call>'
    "{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK_REGEX = r"<think>\n[a-z]{1,8}( [a-z]{1,8}){0,3}\n</think>\n\n[a-z]{1,8}( [a-z]{1,8}){0,2}"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)
    member: bool


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=8,
                               max_position_embeddings=2048)   # tools make long prompts
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    worker = start_worker(model_dir)
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port],
                                extra=["--http-port", "0", "--served-model-name", "tiny"])
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{sched.http_port}/v1", api_key="x")
    finally:
        if sched:
            sched.stop()
        worker.stop()


def test_parse_with_a_pydantic_model(client):
    for seed in range(6):
        done = client.beta.chat.completions.parse(
            model="tiny", messages=CHAT, response_format=Person, temperature=1.0, seed=seed,
            max_tokens=150)
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_guided_aliases(client):
    out = client.chat.completions.create(model="tiny", messages=CHAT, temperature=1.0, seed=1,
                                         max_tokens=150, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    for extra, check in [
        ({"guided_choice": ["yes", "no", "maybe not"]}, lambda t: t in ("yes", "no", "maybe not")),
        ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
        ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
         lambda t: isinstance(json.loads(t), list)),
        ({"guided_grammar": 'start: "x" ("+" "x")*'}, lambda t: set(t) <= {"x", "+"})]:
        for seed in range(3):
            done = client.completions.create(model="tiny", prompt="Answer:", temperature=1.0,
                                              seed=seed, max_tokens=60, extra_body=extra)
            assert done.choices[0].finish_reason == "stop", extra
            assert check(done.choices[0].text), (extra, done.choices[0].text)


def check_calls(calls, names=None) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_tool_choice_required_and_named_give_parsed_tool_calls(client):
    for seed in range(4):
        out = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS,
                                             tool_choice="required", temperature=1.0, seed=seed,
                                             max_tokens=200)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
        assert not choice.message.content
    named = client.chat.completions.create(
        model="tiny", messages=CHAT, tools=TOOLS, temperature=1.0, seed=9, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    check_calls(calls, names={"get_time"})
    assert len(calls) == 1


def test_tool_calls_stream_id_and_name_first_then_arguments(client):
    for seed in range(3):
        whole = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS,
                                               tool_choice="required", temperature=1.0,
                                               seed=seed, max_tokens=200)
        stream = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS,
                                                tool_choice="required", temperature=1.0,
                                                seed=seed, max_tokens=200, stream=True)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            delta = chunk.choices[0].delta
            for tc in delta.tool_calls or []:
                if tc.index not in calls:   # the first delta of a call names it
                    assert tc.id.startswith("call_") and tc.function.name and tc.type == "function"
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        expected = [(c.function.name, json.loads(c.function.arguments))
                    for c in whole.choices[0].message.tool_calls]
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == expected


def test_tools_rendered_by_the_chat_template_and_none_renders_none(client):
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    auto = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=1)
    none = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS,
                                          tool_choice="none", max_tokens=1)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens == none.usage.prompt_tokens
    # A conversation that carries an assistant tool call and its result renders too.
    history = CHAT + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=1)
    assert out.usage.prompt_tokens > auto.usage.prompt_tokens


def test_reasoning_content_whole_and_streamed(client):
    for seed in range(4):
        kw = dict(model="tiny", messages=CHAT, temperature=1.0, seed=seed, max_tokens=120,
                  extra_body={"guided_regex": THINK_REGEX})
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "stop"
        reasoning = whole.message.model_extra["reasoning_content"]
        assert reasoning and "<think>" not in reasoning and "\n" not in reasoning
        assert whole.message.content and "think>" not in whole.message.content
        parts = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            for key in parts:
                parts[key] += (delta.model_extra or {}).get(key) or getattr(delta, key, None) or ""
        assert parts == {"reasoning_content": reasoning, "content": whole.message.content}


def test_enable_thinking_false_reaches_the_template(client):
    on = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    off = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_template_that_opens_think_starts_the_answer_in_reasoning(tmp_path_factory):
    """Templates that write `<think>` into the prompt (Qwen3 thinking-only models): the answer
    starts inside the reasoning, and everything up to `</think>` is reasoning_content."""
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=8,
                               max_position_embeddings=2048)
    opened = tmp_path_factory.mktemp("opened") / "model"
    import shutil
    shutil.copytree(model_dir, opened)
    (opened / "chat_template.jinja").write_text(
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}")
    worker = start_worker(opened)
    sched = None
    try:
        sched = start_scheduler(opened, [worker.port],
                                extra=["--http-port", "0", "--served-model-name", "tiny"])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{sched.http_port}/v1", api_key="x")
        for seed in range(3):
            out = client.chat.completions.create(
                model="tiny", messages=CHAT, temperature=1.0, seed=seed, max_tokens=80,
                extra_body={"guided_regex": r"[a-z]{1,8}( [a-z]{1,8}){0,2}\n</think>\n\n[a-z]{1,8}"})
            message = out.choices[0].message
            assert out.choices[0].finish_reason == "stop"
            reasoning = message.model_extra["reasoning_content"]
            assert reasoning and "think>" not in reasoning and reasoning == reasoning.strip()
            assert message.content and message.content.isalpha()
    finally:
        if sched:
            sched.stop()
        worker.stop()
