"""OpenAI's structured-output fields as a nanoserve.v1 StructuredOutput, and tool set-up.

* `response_format`: text, json_object, json_schema ({"json_schema": {"name", "schema",
  "strict"}}); vLLM's extras `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar` are accepted as aliases. At most one format per request.
* `tools` are rendered by the model's chat template (Qwen3 lists them in its system
  prompt) and the answer's `<tool_call>` blocks are parsed into `tool_calls`
  (chat_output.py). `tool_choice` "auto" (default) leaves the model free; "none" renders
  no tools and parses none; "required" and a named function are enforced by a grammar:
  one or more `<tool_call>` blocks whose JSON is {"name": <a tool>, "arguments": <its
  parameters' schema>} (a named function: exactly one, of that name).
The grammar is checked like any other format (constraints.py), so a bad schema in a tool
is a 400 before any work is done.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nanoserve.v1 import generate_pb2
from scheduler_service.constraints import JSON_OPTIONS
from scheduler_service.generation import invalid

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output(body: dict) -> generate_pb2.StructuredOutput | None:
    """The request's format (response_format or a guided_* extra), None when free."""
    given = [name for name in GUIDED if body.get(name) is not None]
    fmt = body.get("response_format")
    if fmt is not None and not isinstance(fmt, dict):
        raise invalid("'response_format' must be an object")
    kind = (fmt or {}).get("type", "text")
    if kind != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise invalid(f"give one output format, not {' and '.join(given)}")
    if not given:
        return None
    name = given[0]
    value = body.get(name)
    if name == "response_format":
        if kind == "json_object":
            return generate_pb2.StructuredOutput(json_object=True)
        if kind != "json_schema":
            raise invalid(f"response_format type {kind!r}: expected text, json_object or json_schema")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return generate_pb2.StructuredOutput(json_schema=json.dumps(spec.get("schema", {})))
    if name == "guided_json":
        if isinstance(value, str):
            return generate_pb2.StructuredOutput(json_schema=value)
        if isinstance(value, dict):
            return generate_pb2.StructuredOutput(json_schema=json.dumps(value))
        raise invalid("'guided_json' must be a JSON Schema (an object or its JSON text)")
    if name == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise invalid("'guided_choice' must be a list of strings")
        return generate_pb2.StructuredOutput(choice=generate_pb2.Choices(values=value))
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a string")
    if name == "guided_regex":
        return generate_pb2.StructuredOutput(regex=value)
    return generate_pb2.StructuredOutput(grammar=value)


@dataclass
class Tools:
    tools: list[dict] | None                      # for the chat template (None: render none)
    parse: bool                                   # parse <tool_call> blocks into tool_calls
    structured: generate_pb2.StructuredOutput | None   # required / named: the call grammar


def tool_setup(body: dict) -> Tools:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("'tool_choice' needs 'tools'")
        return Tools(None, False, None)
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise invalid("'tools' must be a list of {'type': 'function', 'function': {'name': ..., "
                      "'parameters': {...}}}")
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice in (None, "auto"):
        return Tools(tools, True, None)
    if choice == "none":
        return Tools(None, False, None)
    if choice == "required":
        return Tools(tools, True, _call_grammar(list(functions.values()), once=False))
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)):
        name = choice["function"].get("name")
        if name not in functions:
            raise invalid(f"tool_choice names {name!r}, which is not among the tools")
        return Tools(tools, True, _call_grammar([functions[name]], once=True))
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                  "{'type': 'function', 'function': {'name': ...}}")


def _is_tool(t: Any) -> bool:
    return (isinstance(t, dict) and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            and isinstance(t["function"].get("parameters", {}), dict))


def _call_grammar(functions: list[dict], once: bool) -> generate_pb2.StructuredOutput:
    """Lark: Qwen3's tool-call blocks, each JSON constrained to one of the functions."""
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for f in functions]
    schema = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_OPTIONS   # the spacing of constraints.py's JSON
    block = '"<tool_call>\\n" call "\\n</tool_call>"'
    start = f"start: {block}" if once else f'start: {block} ("\\n" {block})*'
    return generate_pb2.StructuredOutput(grammar=f"{start}\ncall: %json {json.dumps(schema)}\n")
