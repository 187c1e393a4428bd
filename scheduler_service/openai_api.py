"""The OpenAI-compatible HTTP API of a frontend: /v1/models, /v1/completions, /v1/chat/completions.

An aiohttp app on the frontend's asyncio loop, beside the gRPC server, over the same
request path (generation.py): a JSON body becomes prompt ids and a nanoserve.v1
SamplingParams, checked by the very code the gRPC API uses (`sampling_from_proto`), so
both protocols accept and refuse the same things. `RequestError`s keep their gRPC status
name and are mapped to HTTP statuses in OpenAI's error shape. Streams are Server-Sent
Events; a client that goes away cancels its handler (aiohttp handler_cancellation), which
aborts the request in the engine core and frees its KV blocks. Output formats and tools
come in through openai_structured.py; chat answers are split into reasoning_content,
content and tool_calls by chat_output.py (reasoning where the model's chat template
writes `<think>`, as Qwen3's does).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from nanoserve.v1 import generate_pb2
from scheduler_service.api_keys import OPEN, ApiKey, KeyRing
from scheduler_service.chat_output import (ChatOutputParser, Content, Reasoning, ToolCallArguments,
                                           ToolCallStart, parse_chat_output)
from scheduler_service.generation import (Delta, Generation, RequestError, invalid,
                                          sampling_from_proto)
from scheduler_service.openai_structured import structured_output, tool_setup
from scheduler_service.sequence import SamplingOptions

log = logging.getLogger("nanoserve.http")

# grpc.StatusCode name -> (HTTP status, OpenAI error type)
_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (400, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


@dataclass
class HttpConfig:
    model_name: str                  # the one id /v1/models lists and requests must name
    api_key: str | None = None       # bearer token every /v1 route requires when set
    request_timeout: float = 0.0     # seconds per request (0 = none): DEADLINE_EXCEEDED -> 504
    keys: KeyRing | None = None      # several keys (--api-keys; with api_key as "default")


def error_body(e: RequestError) -> tuple[int, dict]:
    status, kind = _STATUS.get(e.code, (500, "server_error"))
    return status, {"error": {"message": e.message, "type": kind, "param": None,
                              "code": e.code.lower()}}


def error_response(e: RequestError) -> web.Response:
    status, body = error_body(e)
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return web.json_response(body, status=status, headers=headers)


# ---------------------------------------------------------------------------- requests
@dataclass
class Request:
    """One OpenAI request, parsed: prompts (one per batch entry), sampling, output options."""
    prompts: list[list[int]]
    sampling: generate_pb2.SamplingParams
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    skip_special_tokens: bool
    reasoning: bool = False      # chat: split <think>...</think> into reasoning_content
    in_reasoning: bool = False   # chat: the prompt opened <think> (the answer starts inside)
    tool_calls: bool = False     # chat: parse <tool_call> blocks into tool_calls
    adapter: int = 0             # the LoRA adapter `model` named (0: the base model)
    priority: int | None = None  # vLLM's extra field: lower runs earlier (None: the key's)
    deadline: float = 0.0        # time.monotonic() of --http-request-timeout (0: none)
    key: ApiKey = OPEN           # the caller's API key


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise invalid("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def _field(body: dict, name: str, types: tuple, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise invalid(f"'{name}' has the wrong type ({type(value).__name__})")
    return value


def sampling_params(body: dict, chat: bool) -> tuple[generate_pb2.SamplingParams, bool, int]:
    """OpenAI's sampling fields (logit_bias included; and vLLM's extras top_k, min_p,
    repetition_penalty, stop_token_ids, ignore_eos, min_tokens) as a nanoserve.v1
    SamplingParams; also (logprobs, k)."""
    p = generate_pb2.SamplingParams()
    num = (int, float)
    for name, types in (("temperature", num), ("top_p", num), ("min_p", num),
                        ("repetition_penalty", num), ("presence_penalty", num),
                        ("frequency_penalty", num), ("top_k", (int,))):
        value = _field(body, name, types)
        if value is not None:
            if name == "top_k" and value == -1:   # vLLM's "off"
                value = 0
            setattr(p, name, value)
    seed = _field(body, "seed", (int,))
    if seed is not None:
        p.seed = seed & (2**64 - 1)
    max_tokens = _field(body, "max_completion_tokens", (int,)) if chat else None
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,))
    if max_tokens is not None:
        if max_tokens < 1:
            raise invalid("max_tokens must be >= 1")
        p.max_tokens = max_tokens
    min_tokens = _field(body, "min_tokens", (int,))
    if min_tokens is not None:
        if not 0 <= min_tokens < 2**32:
            raise invalid("min_tokens must be >= 0")
        p.min_tokens = min_tokens
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise invalid("'stop' must be a string or a list of strings")
    p.stop.extend(stop)
    stop_ids = _field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and t >= 0 for t in stop_ids):
        raise invalid("'stop_token_ids' must be a list of token ids")
    p.stop_token_ids.extend(stop_ids)
    p.ignore_eos = _field(body, "ignore_eos", (bool,), False)
    prediction = _field(body, "prediction", (dict,))
    if prediction is not None:   # {"type": "content", "content": str or [{"type": "text", ...}]}
        content = prediction.get("content")
        if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text"
                                              and isinstance(c.get("text"), str) for c in content):
            content = "".join(c["text"] for c in content)
        if prediction.get("type") != "content" or not isinstance(content, str):
            raise invalid("'prediction' must be {\"type\": \"content\", \"content\": <text>}")
        p.prediction.text = content
    speculative = _field(body, "speculative", (bool,))   # nanoserve's extra: opt out
    if speculative is not None:
        p.speculative = speculative
    for key, bias in (_field(body, "logit_bias", (dict,)) or {}).items():   # {"id": bias}
        if not (isinstance(key, str) and key.isdigit()) or isinstance(bias, bool) \
                or not isinstance(bias, num):
            raise invalid("'logit_bias' must map token ids (as strings) to numbers")
        p.logit_bias[int(key)] = bias
    if chat:
        logprobs = _field(body, "logprobs", (bool,), False)
        k = _field(body, "top_logprobs", (int,), 0)
        if k and not logprobs:
            raise invalid("'top_logprobs' needs 'logprobs': true")
    else:   # completions: logprobs=k asks for the sampled token's and the k most likely
        k = _field(body, "logprobs", (int,))
        logprobs = k is not None
        k = k or 0
    if not 0 <= k <= 20:
        raise invalid("top_logprobs must be in 0..20")
    p.logprobs = logprobs
    if k:
        p.top_logprobs = k
    p.n = _field(body, "n", (int,), 1)
    return p, logprobs, k


def chat_messages(body: dict) -> list[dict]:
    """OpenAI messages with content as a string or a list of text parts."""
    messages = _field(body, "messages", (list,))
    if not messages:
        raise invalid("'messages' must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid("each message needs a 'role' and 'content'")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise invalid("message 'tool_calls' must be a list")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise invalid("only text content parts are supported")
            content = "".join(str(c.get("text", "")) for c in content)
        elif content is not None and not isinstance(content, str):
            raise invalid("message 'content' must be a string or a list of text parts")
        # Assistant tool calls and tool results go to the template as OpenAI writes them.
        out.append({"role": m["role"], "content": content or "",
                    **{k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}})
    return out


def completion_prompts(gen: Generation, body: dict) -> list[list[int]]:
    """prompt: a string, a list of token ids, or a batch of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [gen.prompt_from_text(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [gen.prompt_from_ids(prompt)]
    if isinstance(prompt, list) and prompt:
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(gen.prompt_from_text(p))
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                out.append(gen.prompt_from_ids(p))
            else:
                raise invalid("'prompt' entries must be strings or lists of token ids")
        return out
    raise invalid("'prompt' must be a string, a list of token ids, or a non-empty list of them")


# ---------------------------------------------------------------------------- the API
class OpenAIApi:
    def __init__(self, gen: Generation, cfg: HttpConfig,
                 more_routes: Callable[[web.Application, "OpenAIApi"], None] | None = None):
        self.gen = gen
        self.cfg = cfg
        self.more_routes = more_routes   # routes served beside these (openai_pooling.routes)
        self.created = int(time.time())
        self._opens: dict[str, bool] = {}   # _opens_reasoning by its template kwargs

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 << 20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_post("/tokenize", self.tokenize)
        if self.more_routes is not None:
            self.more_routes(app, self)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        key, keys = self.cfg.api_key, self.cfg.keys
        request["api_key"] = OPEN
        if keys is not None and keys.enabled and request.path != "/health":
            found = keys.from_bearer(request.headers.get("Authorization"))
            if found is None:
                return error_response(RequestError(
                    "UNAUTHENTICATED", "missing or wrong API key (Authorization: Bearer ...)"))
            request["api_key"] = found
        elif key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return error_response(RequestError(
                    "UNAUTHENTICATED", "missing or wrong API key (Authorization: Bearer ...)"))
        try:
            return await handler(request)
        except web.HTTPException as e:   # unknown route, wrong method, body too large
            if e.status < 400:
                raise
            return web.json_response({"error": {"message": e.text or e.reason, "type":
                                                "invalid_request_error", "param": None,
                                                "code": e.reason.lower().replace(" ", "_")}},
                                     status=e.status)

    async def health(self, request: web.Request) -> web.Response:
        ok = self.gen.engine.serving and self.gen.accepting
        return web.json_response({"status": "ok" if ok else "unavailable"},
                                 status=200 if ok else 503)

    def _model_card(self, adapter: int = 0) -> dict:
        """The base model's card, or a LoRA adapter's (its base as `parent`, as vLLM's)."""
        base = self.cfg.model_name
        card = {"id": base, "object": "model", "created": self.created, "owned_by": "nanoserve",
                "root": base, "parent": None, "max_model_len": self.gen.limits.max_model_len,
                "deterministic": bool(self.gen.engine.info.get("deterministic"))}
        if adapter:
            name = next(n for n, i in self.gen.engine.adapters.items() if i == adapter)
            card.update(id=name, parent=base)
        return card

    async def models(self, request: web.Request) -> web.Response:
        ids = [0, *self.gen.engine.adapters.values()]
        return web.json_response({"object": "list", "data": [self._model_card(i) for i in ids]})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's endpoint: {"lora_name": ..., "lora_path": ...} -> 200 and a line of text."""
        return await self._change_adapter(request, "load")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._change_adapter(request, "unload")

    async def _change_adapter(self, request: web.Request, op: str) -> web.Response:
        try:
            body = await _json_body(request)
            name = _field(body, "lora_name", (str,), "")
            path = _field(body, "lora_path", (str,), "") if op == "load" else ""
            await self.gen.change_adapter(self.cfg.model_name, op, name, path,
                                          request["api_key"])
        except RequestError as e:
            return error_response(e)
        done = "added" if op == "load" else "removed"
        return web.Response(text=f"Success: LoRA adapter '{name}' {done} successfully.")

    async def model(self, request: web.Request) -> web.Response:
        try:
            adapter = self._check_model(request.match_info["model"])
        except RequestError as e:
            return error_response(e)
        return web.json_response(self._model_card(adapter))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize ({"prompt"} or {"messages"} -> {"count", "max_model_len",
        "tokens"}): what vllm-router's kv_aware policy calls to match a request's tokens
        against the KV events (scheduler_service/kv_events.py)."""
        try:
            body = await _json_body(request)
            self._check_model(body.get("model"))
            tok = self.gen.tokenizer
            if isinstance(body.get("messages"), list):
                ids = tok.encode_chat(body["messages"], bool(body.get("add_generation_prompt", True)))
            elif isinstance(body.get("prompt"), str):
                ids = tok.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                raise invalid("give 'prompt' (a string) or 'messages'")
        except RequestError as e:
            return error_response(e)
        except ValueError as e:   # a chat template's own error
            return error_response(invalid(str(e)))
        return web.json_response({"count": len(ids), "max_model_len": self.gen.limits.max_model_len,
                                  "tokens": ids, "token_strs": None})

    def _check_model(self, name: Any) -> int:
        """The LoRA adapter a request's `model` names (0: the base model; absent: the base)."""
        if name is None or name == self.cfg.model_name:
            return 0
        adapters = self.gen.engine.adapters
        if isinstance(name, str) and name in adapters:
            return adapters[name]
        served = ", ".join((self.cfg.model_name, *adapters))
        raise RequestError("NOT_FOUND", f"The model `{name}` does not exist "
                                        f"(this server serves {served})")

    async def _parse(self, request: web.Request, chat: bool) -> Request:
        body = await _json_body(request)
        adapter = self._check_model(body.get("model"))
        for name in ("functions", "suffix"):   # refused, not ignored
            if body.get(name):
                raise invalid(f"'{name}' is not supported")
        structured = structured_output(body)
        tools = tool_setup(body) if chat else None
        if tools and tools.structured is not None:
            if structured is not None:
                raise invalid("tool_choice 'required' or a named function comes with its own "
                              "format: drop response_format")
            structured = tools.structured
        reasoning = in_reasoning = False
        if chat:
            kwargs = _field(body, "chat_template_kwargs", (dict,), {})
            if tools.tools is not None:
                kwargs = {**kwargs, "tools": tools.tools}
            prompts = [self.gen.prompt_from_chat(chat_messages(body), **kwargs)]
            reasoning = "<think>" in (self.gen.tokenizer.chat_template or "")
            in_reasoning = reasoning and self._opens_reasoning(kwargs)
        else:
            if _field(body, "echo", (bool,), False):
                raise invalid("'echo' is not supported")
            if _field(body, "best_of", (int,), 1) != 1:
                raise invalid("'best_of' is not supported")
            prompts = completion_prompts(self.gen, body)
        try:
            sampling, logprobs, k = sampling_params(body, chat)
        except (TypeError, ValueError) as e:   # a value protobuf cannot hold
            raise invalid(f"bad sampling value: {e}") from None
        if structured is not None:
            sampling.structured.CopyFrom(structured)
        for ids in prompts:   # the shared checks, for every prompt before any starts
            sampling_from_proto(sampling, len(ids), self.gen.limits, self.gen.encode_output)
        stream = _field(body, "stream", (bool,), False)
        options = _field(body, "stream_options", (dict,), {})
        priority = _field(body, "priority", (int,))
        if priority is not None and not -2**31 <= priority < 2**31:
            raise invalid("'priority' must be a 32-bit integer")
        timeout = self.cfg.request_timeout
        return Request(prompts, sampling, sampling.n, stream, bool(options.get("include_usage")),
                       logprobs, k, _field(body, "skip_special_tokens", (bool,), True),
                       reasoning, in_reasoning, bool(tools and tools.parse), adapter, priority,
                       time.monotonic() + timeout if timeout > 0 else 0.0)

    def _opens_reasoning(self, template_kwargs: dict) -> bool:
        """The template's generation prompt ends with `<think>` (thinking-only models): the
        answer starts inside the reasoning. Read off a one-message render (the suffix does
        not depend on the messages, only on flags such as enable_thinking), once per set of
        flags: a chat request renders the template once, for its prompt."""
        key = json.dumps(template_kwargs, sort_keys=True, default=str)
        if key not in self._opens:
            try:
                text = self.gen.tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                                              True, **template_kwargs)
                opens = text.rstrip().endswith("<think>")
            except ValueError:
                opens = False
            if len(self._opens) >= 256:
                self._opens.clear()
            self._opens[key] = opens
        return self._opens[key]

    async def _choices(self, req: Request) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) of every completion, interleaved as they come: choice
        i*n + j is prompt i's j-th completion (OpenAI's order). A prompt's n completions
        are one engine request (siblings sharing the prompt's KV, seed + j); a batch's
        prompts run concurrently. Leaving the iteration cancels them all, which aborts
        them in the engine core."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(i: int, ids: list[int]) -> None:
            try:
                opts = sampling_from_proto(req.sampling, len(ids), self.gen.limits,
                                           self.gen.encode_output)
                opts.adapter_id = req.adapter
                opts.deadline = req.deadline
                self.gen.apply_key(req.key, opts, req.priority)
                async for delta in self.gen.stream(ids, opts, list(req.sampling.stop),
                                                   req.skip_special_tokens):
                    queue.put_nowait((i * req.n + delta.index, delta))
            except RequestError as e:
                queue.put_nowait((i, e))
            except Exception as e:   # never leave the consumer waiting
                log.exception("request failed")
                queue.put_nowait((i, RequestError("INTERNAL", str(e))))
            queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(run(i, ids)) for i, ids in enumerate(req.prompts)]
        try:
            left = len(tasks)
            while left:
                index, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, RequestError):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _deadline(self):
        t = self.cfg.request_timeout
        return asyncio.timeout(t if t > 0 else None)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            req = await self._parse(request, chat)
            self.gen.apply_key(request["api_key"], SamplingOptions(), req.priority)
        except RequestError as e:
            return error_response(e)
        req.key = request["api_key"]
        out = Output(self.gen, req, chat, self.cfg.model_name)
        if req.stream:
            return await self._stream(request, req, out)
        deltas = self._choices(req)
        try:
            async with self._deadline():
                async for index, delta in deltas:
                    out.add(index, delta)
        except TimeoutError:
            return error_response(_timeout(self.cfg.request_timeout))
        except RequestError as e:
            return error_response(e)
        finally:
            await deltas.aclose()
        return web.json_response(out.whole())

    async def _stream(self, request: web.Request, req: Request, out: "Output"
                      ) -> web.StreamResponse:
        """SSE. The first event is awaited before the headers go out, so that a request
        refused by the engine core (queue full, core unavailable) gets its HTTP status;
        a failure after that is an `error` event, then the stream ends."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        deltas = self._choices(req)
        try:
            async with self._deadline():
                async for index, delta in deltas:
                    if not resp.prepared:
                        await resp.prepare(request)
                        for event in out.opening():
                            await _send(resp, event)
                    event = out.chunk(index, delta)
                    if event is not None:
                        await _send(resp, event)
                if req.include_usage:
                    await _send(resp, out.usage_chunk())
                await resp.write(b"data: [DONE]\n\n")
        except (TimeoutError, RequestError) as e:
            err = e if isinstance(e, RequestError) else _timeout(self.cfg.request_timeout)
            if not resp.prepared:
                return error_response(err)
            await _send(resp, error_body(err)[1])
        finally:
            await deltas.aclose()
        await resp.write_eof()
        return resp


def _timeout(seconds: float) -> RequestError:
    return RequestError("DEADLINE_EXCEEDED", f"the request took longer than {seconds:g}s "
                                             "(--http-request-timeout)")


async def _send(resp: web.StreamResponse, event: dict) -> None:
    await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")


# ---------------------------------------------------------------------------- responses
class Output:
    """Builds the OpenAI response objects of one request, whole or as stream chunks."""

    def __init__(self, gen: Generation, req: Request, chat: bool, model: str):
        self.gen, self.req, self.chat, self.model = gen, req, chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        count = len(req.prompts) * req.n
        self.texts = [[] for _ in range(count)]
        self.logprobs: list[list[dict]] = [[] for _ in range(count)]
        self.offsets = [0] * count          # completions' text_offset
        self.finish: list[str | None] = [None] * count
        self.usages = {}
        # Chat answers with reasoning or tools: one parser per choice (streams).
        self.split = chat and (req.reasoning or req.tool_calls)
        self.parsers = [ChatOutputParser(req.reasoning, req.tool_calls, req.in_reasoning)
                        for _ in range(count)] if self.split else []
        self.called = [False] * count   # the choice made a tool call (finish_reason tool_calls)

    # ---- shared pieces ----

    def _token(self, token_id: int) -> str:
        return self.gen.tokenizer.decode([token_id])

    def _logprob_entries(self, index: int, delta: Delta) -> list[dict]:
        """One entry per token: the token, its logprob, and the k most likely."""
        tops = delta.top_logprobs or [None] * len(delta.token_ids)
        entries = []
        for tok, lp, top in zip(delta.token_ids, delta.logprobs, tops):
            text = self._token(tok)
            alts = []
            if top is not None and self.req.top_logprobs:
                ids, lps = top
                alts = [(self._token(t), float(l)) for t, l in zip(ids, lps)]
            entries.append({"token": text, "logprob": float(lp), "top": alts,
                            "offset": self.offsets[index]})
            self.offsets[index] += len(text)
        return entries

    def _usage(self) -> dict:
        prompt = completion = cached = accepted = rejected = 0
        for u in self.usages.values():   # one per prompt, summed over its n completions
            completion += u.completion_tokens
            prompt += u.prompt_tokens
            cached += u.cached_tokens
            accepted += u.accepted_prediction_tokens
            rejected += u.rejected_prediction_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": rejected}}

    def _chat_logprobs(self, entries: list[dict]) -> dict:
        return {"content": [{"token": e["token"], "logprob": e["logprob"],
                             "bytes": list(e["token"].encode()),
                             "top_logprobs": [{"token": t, "logprob": l, "bytes": list(t.encode())}
                                              for t, l in e["top"]]} for e in entries]}

    def _completion_logprobs(self, entries: list[dict]) -> dict:
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [dict(e["top"]) for e in entries] if self.req.top_logprobs else None,
                "text_offset": [e["offset"] for e in entries]}

    def _note(self, index: int, delta: Delta) -> list[dict] | None:
        if delta.finish_reason is not None:
            self.finish[index] = delta.finish_reason
        if delta.usage is not None:
            self.usages[index // self.req.n] = delta.usage
        return self._logprob_entries(index, delta) if self.req.logprobs else None

    # ---- whole ----

    def add(self, index: int, delta: Delta) -> None:
        entries = self._note(index, delta)
        self.texts[index].append(delta.text)
        if entries:
            self.logprobs[index] += entries

    def whole(self) -> dict:
        choices = []
        for i, parts in enumerate(self.texts):
            text = "".join(parts)
            lp = None
            if self.req.logprobs:
                lp = (self._chat_logprobs if self.chat else self._completion_logprobs)(self.logprobs[i])
            if self.chat:
                message, finish = {"role": "assistant", "content": text}, self.finish[i]
                if self.split:
                    parsed = parse_chat_output(text, self.req.reasoning, self.req.tool_calls,
                                               self.req.in_reasoning)
                    message["content"] = parsed.content
                    if self.req.reasoning:
                        message["reasoning_content"] = parsed.reasoning_content
                    if parsed.tool_calls:
                        message["tool_calls"] = parsed.tool_calls
                        finish = "tool_calls" if finish == "stop" else finish
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": finish})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp,
                                "finish_reason": self.finish[i]})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self._usage(), "system_fingerprint": None}

    # ---- stream ----

    def _envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": usage, "system_fingerprint": None}

    def opening(self) -> list[dict]:
        """Chat streams start with each choice's role."""
        if not self.chat:
            return []
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}])
                for i in range(len(self.texts))]

    def chunk(self, index: int, delta: Delta) -> dict | None:
        """The delta as a stream event; None when it carries nothing (tokens that do not
        complete a character yet, no logprobs asked for)."""
        entries = self._note(index, delta)
        if not delta.text and delta.finish_reason is None and not entries:
            return None
        lp = None
        if entries is not None:
            lp = (self._chat_logprobs if self.chat else self._completion_logprobs)(entries)
        if self.chat:
            finish = delta.finish_reason
            if self.split:
                parser = self.parsers[index]
                events = parser.feed(delta.text) + (parser.finish() if finish is not None else [])
                body = self._split_delta(index, events)
                if self.called[index] and finish == "stop":
                    finish = "tool_calls"
                if not body and finish is None and not entries:
                    return None
            else:
                body = {"content": delta.text} if delta.text else {}
            choice = {"index": index, "delta": body, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta.text, "logprobs": lp,
                      "finish_reason": delta.finish_reason}
        return self._envelope([choice])

    def _split_delta(self, index: int, events: list) -> dict:
        """A chat delta from parser events: reasoning_content / content text, and tool
        calls as OpenAI streams them (id, type and name first, then argument text)."""
        body: dict = {}
        calls: list[dict] = []
        for e in events:
            if isinstance(e, Reasoning):
                body["reasoning_content"] = body.get("reasoning_content", "") + e.text
            elif isinstance(e, Content):
                body["content"] = body.get("content", "") + e.text
            elif isinstance(e, ToolCallStart):
                self.called[index] = True
                calls.append({"index": e.index, "id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, ToolCallArguments):
                calls.append({"index": e.index, "function": {"arguments": e.text}})
        if calls:
            body["tool_calls"] = calls
        return body

    def usage_chunk(self) -> dict:
        return self._envelope([], self._usage())


async def start(gen: Generation, cfg: HttpConfig, host: str, port: int, reuse_port: bool,
                more_routes: Callable[[web.Application, OpenAIApi], None] | None = None
                ) -> tuple[web.AppRunner, int]:
    """Serve the API on host:port (0 = any free port); (runner to clean up, bound port).
    more_routes: adds routes beside these (openai_pooling.routes: embeddings, rerank)."""
    # The frontend drains in-flight requests before cleanup(): what is left then is cut.
    runner = web.AppRunner(OpenAIApi(gen, cfg, more_routes).app(), handler_cancellation=True,
                           access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    return runner, bound
