"""Split Qwen3 chat output into OpenAI chat-completion parts: reasoning, content, tool calls.

Why: OpenAI-style clients read a model's thinking from `reasoning_content` and its
function calls from `tool_calls`, but Qwen3 writes both as tagged text in the answer:

    <think>\\n...reasoning...\\n</think>\\n\\nvisible answer
    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>

Reasoning is one block at the very start of the output (leading whitespace allowed);
with templates that open `<think>` in the prompt the output starts inside it
(`in_reasoning=True`) and only `</think>` appears. Newlines around the reasoning and the
whitespace after `</think>` are stripped. Tool calls (Hermes format) are parsed only in
content and only when the request had tools: each `<tool_call>` block whose body is a
JSON object with a string "name" becomes a call (arguments re-serialized as a JSON
string); whitespace around valid blocks is dropped (the whitespace before one still
separates content on both sides of it); a block that does not parse, or is
left open at the end, stays content, tags and all.

Text arrives in streaming chunks split anywhere, so `ChatOutputParser` holds back any
tail that could still become a tag (and whitespace whose fate a later tag decides);
`finish()` releases it. A tool call is emitted once its block closes (start, then the
whole arguments JSON). `parse_chat_output` runs the same parser over the whole text, so
the streamed deltas always add up to the non-streaming result. Pure Python, no torch.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


@dataclass
class Reasoning:
    text: str


@dataclass
class Content:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArguments:
    index: int
    text: str


Event = Reasoning | Content | ToolCallStart | ToolCallArguments


@dataclass
class ParsedOutput:
    reasoning_content: str | None
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_tool_call(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole <tool_call> block, or None if it isn't a call."""
    try:
        obj = json.loads(block[len(TOOL_START):-len(TOOL_END)])
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # already a JSON string
        return obj["name"], args
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ChatOutputParser:
    """Incremental parser: `feed` chunks of output text, then `finish` once."""

    def __init__(self, reasoning: bool, tools: bool, in_reasoning: bool = False) -> None:
        self.tools = tools
        self._state = ("reasoning" if in_reasoning else "start") if reasoning else "content"
        self._buf = ""          # text not yet classified
        self._held = ""         # trailing whitespace whose fate a later tag decides
        self._lead = in_reasoning and reasoning  # strip leading whitespace next
        self._block = ""        # the open <tool_call> block, raw
        self._index = 0         # next tool call index
        self._said = False      # some content was emitted
        self._sep = ""          # whitespace that stood before a call, owed to later content

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._state == "start":  # is the answer opening with <think>?
                rest = self._buf.lstrip()
                if rest.startswith(THINK_START):
                    self._buf, self._state, self._lead = rest[len(THINK_START):], "reasoning", True
                    continue
                if not final and THINK_START.startswith(rest):
                    return out
                self._state = "content"
            elif self._state == "reasoning":
                i = self._buf.find(THINK_END)
                if i < 0:
                    keep = 0 if final else _partial_tag(self._buf, THINK_END)
                    self._reasoning(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    if final:
                        self._held = ""  # trailing newlines of unclosed reasoning
                    return out
                self._reasoning(self._buf[:i], out)
                self._buf, self._state = self._buf[i + len(THINK_END):], "content"
                self._held, self._lead = "", True
            elif self._state == "content":
                i = self._buf.find(TOOL_START) if self.tools else -1
                if i < 0:
                    keep = 0 if final or not self.tools else _partial_tag(self._buf, TOOL_START)
                    self._content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    if final and self._held:
                        out.append(Content(self._held))
                        self._held = ""
                    return out
                self._content(self._buf[:i], out)
                self._block, self._buf = TOOL_START, self._buf[i + len(TOOL_START):]
                self._state = "tool"
            else:  # "tool": inside a <tool_call> block
                i = self._buf.find(TOOL_END)
                if i < 0:
                    keep = 0 if final else _partial_tag(self._buf, TOOL_END)
                    self._block += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    if not final:
                        return out
                    self._state, self._lead = "content", False  # unclosed: raw text
                    self._content(self._block, out)
                    self._block = ""
                    continue
                block = self._block + self._buf[:i + len(TOOL_END)]
                self._buf, self._block, self._state = self._buf[i + len(TOOL_END):], "", "content"
                call = _parse_tool_call(block)
                if call is None:
                    self._lead = False
                    self._content(block, out)
                    continue
                out.append(ToolCallStart(self._index, "call_" + secrets.token_hex(12), call[0]))
                out.append(ToolCallArguments(self._index, call[1]))
                self._index += 1
                # Whitespace around a call is dropped, unless content stands on both sides:
                # then the whitespace before the call still separates them.
                self._sep = self._sep or (self._held if self._said else "")
                self._held, self._lead = "", True

    def _reasoning(self, text: str, out: list[Event]) -> None:
        if self._lead:
            text = text.lstrip("\n")
            self._lead = not text
        text = self._held + text
        body = text.rstrip("\n")
        self._held = text[len(body):]
        if body:
            out.append(Reasoning(body))

    def _content(self, text: str, out: list[Event]) -> None:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        text = self._held + text
        body = text.rstrip() if self.tools else text
        self._held = text[len(body):]
        if body:
            out.append(Content(self._sep + body))
            self._said, self._sep = True, ""


def parse_chat_output(text: str, reasoning: bool, tools: bool,
                      in_reasoning: bool = False) -> ParsedOutput:
    """Non-streaming parse of a whole output (the streaming parser, fed once)."""
    parser = ChatOutputParser(reasoning, tools, in_reasoning)
    events = parser.feed(text) + parser.finish()
    thought = "".join(e.text for e in events if isinstance(e, Reasoning)).strip("\n")
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            calls[e.index] = {"id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, ToolCallArguments):
            calls[e.index]["function"]["arguments"] += e.text
    tool_calls = [calls[i] for i in sorted(calls)]
    if not content or (tool_calls and not content.strip()):
        content = None
    return ParsedOutput(thought or None, content, tool_calls)
