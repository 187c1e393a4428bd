"""chat_output: Qwen3 reasoning / tool-call tags become OpenAI reasoning_content, content
and tool_calls; streaming at any split point adds up to the non-streaming parse, and no
partial tag ever leaks into content."""

from __future__ import annotations

import json
import random

import pytest

from scheduler_service.chat_output import (ChatOutputParser, Content, Event, Reasoning,
                                           ToolCallArguments, ToolCallStart,
                                           parse_chat_output)

CALL1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "lookup", "arguments": {"q": "a <b> </tool c", "n": 2}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "broken", "arguments": {\n</tool_call>'

# (text, reasoning, tools, in_reasoning)
CASES = [
    ("Hello, world!\n", True, True, False),
    ("<think>\nLet me think.\n\nStep 2.\n</think>\n\nThe answer is 4.", True, False, False),
    ("<think>\nstill thinking\n", True, True, False),
    ("thinking from the prompt\n</think>\n\nDone.", True, True, True),
    ("<think>\nI should call.\n</think>\n\nLet me check.\n" + CALL1, True, True, False),
    ("Two calls:\n" + CALL1 + "\n" + CALL2 + "\n", True, True, False),
    ("Before\n" + BAD + "\nafter", True, True, False),
    ("<think>x</think>" + CALL1, True, True, False),
    ("a <b> c, x < y, <thi <tool <think> </think> <tool_cal", True, True, False),
    ("<think>\nr\n</think>\n\n<think> is text now, " + CALL1, False, False, False),
    ("unclosed " + CALL1[:-5], True, True, False),
    ("<think>\n\n</think>\n\nshort", True, True, False),
    ("  \n<think>lead ws</think>body\n\n", True, True, False),
    ("<thinking> is not a tag", True, True, False),
    ("ends inside reasoning </thin", True, True, True),
    ("", True, True, False),
    ("hi " + CALL1 + " bye\n" + CALL2 + "\n\nend", True, True, False),
]


def collect(events: list[Event]) -> tuple[str, str, list[tuple[str, str, str]]]:
    """Concatenated reasoning, content and (id, name, arguments) per tool call index."""
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(calls) and e.index not in calls
            calls[e.index] = [e.id, e.name, ""]
        elif isinstance(e, ToolCallArguments):
            assert e.index in calls, "arguments before their start"
            calls[e.index][2] += e.text
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]


def stream(chunks: list[str], reasoning: bool, tools: bool, in_reasoning: bool):
    parser = ChatOutputParser(reasoning, tools, in_reasoning)
    events: list[Event] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    assert all(e.text for e in events if isinstance(e, (Reasoning, Content)))
    return collect(events)


def expected(text: str, reasoning: bool, tools: bool, in_reasoning: bool):
    p = parse_chat_output(text, reasoning, tools, in_reasoning)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in p.tool_calls]
    return p.reasoning_content or "", p.content or "", calls


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) \
        if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_plain_text():
    p = parse_chat_output("Hello, world!\n", reasoning=True, tools=True)
    assert (p.reasoning_content, p.content, p.tool_calls) == (None, "Hello, world!\n", [])


def test_reasoning_and_content():
    p = parse_chat_output(CASES[1][0], reasoning=True, tools=False)
    assert p.reasoning_content == "Let me think.\n\nStep 2."
    assert p.content == "The answer is 4."
    assert p.tool_calls == []


def test_unfinished_reasoning_only():
    p = parse_chat_output("<think>\nstill thinking\n", reasoning=True, tools=True)
    assert (p.reasoning_content, p.content) == ("still thinking", None)


def test_in_reasoning_start():
    p = parse_chat_output(CASES[3][0], reasoning=True, tools=True, in_reasoning=True)
    assert (p.reasoning_content, p.content) == ("thinking from the prompt", "Done.")
    p = parse_chat_output("no end tag <think>", reasoning=True, tools=True, in_reasoning=True)
    assert (p.reasoning_content, p.content) == ("no end tag <think>", None)


def test_empty_think_block():
    p = parse_chat_output("<think>\n\n</think>\n\nshort", reasoning=True, tools=True)
    assert (p.reasoning_content, p.content) == (None, "short")


def test_one_tool_call_with_content_before():
    p = parse_chat_output(CASES[4][0], reasoning=True, tools=True)
    assert p.reasoning_content == "I should call."
    assert p.content == "Let me check."
    [call] = p.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "°C"}
    assert "°C" in call["function"]["arguments"]  # ensure_ascii=False


def test_two_tool_calls():
    p = parse_chat_output(CASES[5][0], reasoning=True, tools=True)
    assert p.content == "Two calls:"
    assert [c["function"]["name"] for c in p.tool_calls] == ["get_weather", "lookup"]
    assert json.loads(p.tool_calls[1]["function"]["arguments"]) == {"q": "a <b> </tool c", "n": 2}
    ids = [c["id"] for c in p.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_text_on_both_sides_of_calls_keeps_its_separator():
    p = parse_chat_output(CASES[-1][0], reasoning=True, tools=True)
    assert p.content == "hi bye\nend"   # the whitespace before each call separates
    assert [c["function"]["name"] for c in p.tool_calls] == ["get_weather", "lookup"]


def test_only_tool_call_gives_none_content():
    p = parse_chat_output("\n" + CALL1 + "\n\n", reasoning=False, tools=True)
    assert p.content is None and len(p.tool_calls) == 1


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {', '{"arguments": {}}', '[1, 2]',
                                  '{"name": 3}', '{"name": "f", "arguments": 7}'])
def test_bad_block_stays_content(body):
    block = f"<tool_call>\n{body}\n</tool_call>"
    p = parse_chat_output("Before\n" + block + "\nafter", reasoning=True, tools=True)
    assert p.tool_calls == []
    assert p.content == "Before\n" + block + "\nafter"


def test_unclosed_tool_call_becomes_content():
    text = "unclosed " + CALL1[:-5]
    p = parse_chat_output(text, reasoning=True, tools=True)
    assert (p.content, p.tool_calls) == (text, [])


def test_reasoning_off_leaves_think_tags():
    text = "<think>\nr\n</think>\n\nok"
    p = parse_chat_output(text, reasoning=False, tools=True)
    assert (p.reasoning_content, p.content) == (None, text)


def test_tools_off_leaves_tool_call_tags():
    text = "call: " + CALL1
    p = parse_chat_output(text, reasoning=True, tools=False)
    assert (p.content, p.tool_calls) == (text, [])


@pytest.mark.parametrize("text", ["a <b> c", "x < y", "<thi", "a <thi", "<tool_ca", "end </think",
                                  "<", "<thinking> is not a tag"])
def test_partial_tag_prefixes_are_emitted(text):
    assert parse_chat_output(text, reasoning=True, tools=True).content == text
    parser = ChatOutputParser(reasoning=True, tools=True)
    events = [e for ch in text for e in parser.feed(ch)]
    events += parser.finish()
    assert collect(events)[1] == text


def test_no_partial_tag_leaks_while_streaming():
    parser = ChatOutputParser(reasoning=True, tools=True)
    events = [e for ch in "<think>\nhm\n</think>\n\n" + CALL1 for e in parser.feed(ch)]
    assert not any(isinstance(e, Content) for e in events)
    assert [type(e) for e in events if not isinstance(e, Reasoning)] == [ToolCallStart,
                                                                          ToolCallArguments]
    assert parser.finish() == []


def test_held_newlines_released_when_reasoning_goes_on():
    parser = ChatOutputParser(reasoning=True, tools=False)
    assert parser.feed("<think>\na\n\n") == [Reasoning("a")]
    assert parser.feed("b") == [Reasoning("\n\nb")]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_streaming_matches_non_streaming(case):
    text, reasoning, tools, in_reasoning = case
    want = expected(text, reasoning, tools, in_reasoning)
    chunkings = [[text], list(text)]
    rng = random.Random(1234)
    chunkings += [random_chunks(text, rng) for _ in range(200)]
    chunkings += [[text[:i], text[i:]] for i in range(len(text) + 1)]  # every split point
    seen_ids: set[str] = set()
    for chunks in chunkings:
        r, c, calls = stream(chunks, reasoning, tools, in_reasoning)
        assert (r, c, [(n, a) for _, n, a in calls]) == want, chunks
        for call_id, _, _ in calls:
            assert call_id.startswith("call_") and call_id not in seen_ids
            seen_ids.add(call_id)
