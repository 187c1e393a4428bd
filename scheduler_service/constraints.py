"""Structured output at admission: a request's format turned into an llguidance grammar.

A format (nanoserve.v1.StructuredOutput: JSON Schema, any JSON object, regex, grammar,
choice) becomes the one grammar text the worker's sampling rank compiles into a matcher
(worker_service/grammar.py). It is checked here, in the frontend, so a format that does
not compile is INVALID_ARGUMENT before the request reaches the engine core or any KV is
spent. Checking needs no tokenizer and takes well under a millisecond; results are cached
by text, so a backend that sends the same schema with every request pays it once.

JSON comes out in the spacing models write (`{"a": 1, "b": [2, 3]}`) with no free
whitespace: a model sampled at temperature 1 cannot wander off into endless blank space.
A schema may change that through llguidance's own "x-guidance" options.
"""
from __future__ import annotations

import json
from functools import lru_cache

import llguidance
from llguidance import LLMatcher

from nanoserve.v1 import generate_pb2

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_FORMAT_BYTES = 1 << 20


class FormatError(ValueError):
    """A format that does not compile (the message says where)."""


def grammar_for(kind: str, text: str) -> str:
    """The llguidance grammar of one format, checked (FormatError if it does not compile).

    kind: "json_schema" (text = the schema), "json_object" (text ignored), "regex",
    "grammar" (Lark or GBNF) or "choice" (text = a JSON list of strings)."""
    if len(text) > MAX_FORMAT_BYTES:
        raise FormatError(f"{kind} is over {MAX_FORMAT_BYTES} bytes")
    return _compiled(kind, text)


@lru_cache(maxsize=1024)
def _compiled(kind: str, text: str) -> str:
    if kind == "json_object":
        kind, text = "json_schema", '{"type": "object"}'
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise FormatError("json_schema must be a JSON object")
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "choice":
            values = json.loads(text)
            if not values or not all(isinstance(v, str) and v for v in values):
                raise FormatError("choice needs at least one value, each a non-empty string")
            grammar = llguidance.grammar_from("choice", values)
        elif kind in ("regex", "grammar"):
            if not text:
                raise FormatError(f"{kind} is empty")
            grammar = llguidance.grammar_from(kind, text)
        else:
            raise FormatError(f"unknown format {kind!r}")
    except (json.JSONDecodeError, ValueError) as e:
        raise e if isinstance(e, FormatError) else FormatError(f"{kind}: {e}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise FormatError(f"{kind} does not compile: {messages[0].strip()}")
    return grammar


def grammar_from_proto(s: generate_pb2.StructuredOutput) -> str:
    """The grammar of the public API's StructuredOutput ("" when no format is set)."""
    kind = s.WhichOneof("format")
    if kind is None:
        return ""
    if kind == "json_object":
        if not s.json_object:
            return ""
        return grammar_for(kind, "")
    if kind == "choice":
        return grammar_for(kind, json.dumps(list(s.choice.values)))
    return grammar_for(kind, getattr(s, kind))
