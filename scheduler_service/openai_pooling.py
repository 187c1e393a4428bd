"""The HTTP routes of embeddings and reranking, beside openai_api.py's completions:

  POST /v1/embeddings          OpenAI's: input (string, list of strings, token ids, list of
                               token id lists), dimensions, encoding_format float | base64;
                               nanoserve's extras truncate (bool) and priority
  POST /score, /v1/score       vLLM's: text_1 (a query, or a list paired 1:1 with text_2),
                               text_2 (a document or a list) -> a score per pair
  POST /rerank, /v1/rerank,    Cohere's / Jina's shape (vLLM serves it): query, documents
       /v2/rerank              (strings or {"text": ...}), top_n, return_documents ->
                               results by relevance_score, highest first

Everything runs through pooling.py (the gRPC API's path), so errors, auth, priorities and
quotas are those of completions: a route for a task this deployment does not serve is 400.
"""
from __future__ import annotations

import base64
import time
import uuid
from array import array
from typing import Any, Callable

from aiohttp import web

from scheduler_service.generation import RequestError, invalid
from scheduler_service.openai_api import OpenAIApi, _json_body, _timeout, error_response
from scheduler_service.pooling import EMBED, SCORE, Pooled, Pooling


def _floats(values: bytes) -> list[float]:
    return array("f", values).tolist()


def _texts(value: Any, name: str) -> list[str]:
    """A string or a list of strings (documents may be {"text": ...} objects)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        out = []
        for v in value:
            if isinstance(v, dict) and isinstance(v.get("text"), str):
                v = v["text"]
            if not isinstance(v, str):
                raise invalid(f"'{name}' must hold strings")
            out.append(v)
        return out
    raise invalid(f"'{name}' must be a string or a non-empty list of strings")


def routes(pooling: Pooling) -> Callable[[web.Application, OpenAIApi], None]:
    """openai_api.start's more_routes: these routes on its app."""
    return lambda app, api: PoolingApi(pooling, api).add_routes(app)


class PoolingApi:
    def __init__(self, pooling: Pooling, api: OpenAIApi) -> None:
        self.pooling, self.api = pooling, api   # api: its model check, deadline, config

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)
        for path in ("/score", "/v1/score"):
            app.router.add_post(path, self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, self.rerank)

    async def _body(self, request: web.Request, task: str) -> dict:
        body = await _json_body(request)
        if self.api._check_model(body.get("model")):
            raise invalid("LoRA adapters do not serve embeddings or scores")
        self.pooling.require(task)
        return body

    def _options(self, request: web.Request, body: dict, kind: int, dimensions: int = 0):
        priority = body.get("priority")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)
                                     or not -2**31 <= priority < 2**31):
            raise invalid("'priority' must be a 32-bit integer")
        t = self.api.cfg.request_timeout
        return self.pooling.options(kind, request["api_key"], priority, dimensions,
                                    time.monotonic() + t if t > 0 else 0.0)

    async def _run(self, prompts: list[list[int]], opts) -> Pooled:
        try:
            async with self.api._deadline():
                return await self.pooling.run(prompts, opts)
        except TimeoutError:
            raise _timeout(self.api.cfg.request_timeout) from None

    # ---- routes -----------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, "embed")
            truncate = self._truncate(body)
            prompts = self._embed_inputs(body.get("input"), truncate)
            dims = body.get("dimensions") or 0
            if not isinstance(dims, int) or isinstance(dims, bool) or dims < 0:
                raise invalid("'dimensions' must be a positive integer")
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise invalid("'encoding_format' must be float or base64")
            out = await self._run(prompts, self._options(request, body, EMBED, dims))
        except RequestError as e:
            return error_response(e)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v).decode() if fmt == "base64" else _floats(v)}
                for i, v in enumerate(out.values)]
        return web.json_response({"object": "list", "data": data,
                                  "model": self.api.cfg.model_name,
                                  "usage": {"prompt_tokens": out.prompt_tokens,
                                            "total_tokens": out.prompt_tokens}})

    @staticmethod
    def _truncate(body: dict) -> bool:
        """nanoserve's `truncate`, or vLLM's truncate_prompt_tokens (any value: to the context)."""
        t = body.get("truncate", False)
        if not isinstance(t, bool):
            raise invalid("'truncate' must be a boolean")
        return t or body.get("truncate_prompt_tokens") not in (None, 0)

    def _embed_inputs(self, value: Any, truncate: bool) -> list[list[int]]:
        """OpenAI's `input`: a string, strings, token ids, or lists of token ids."""
        p = self.pooling
        if isinstance(value, str):
            return [p.embed_prompt(text=value, truncate=truncate)]
        if not isinstance(value, list) or not value:
            raise invalid("'input' must be a string, a list of strings, token ids or lists "
                          "of token ids, not empty")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [p.embed_prompt(ids=value, truncate=truncate)]
        out = []
        for v in value:
            if isinstance(v, str):
                out.append(p.embed_prompt(text=v, truncate=truncate))
            elif isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in v):
                out.append(p.embed_prompt(ids=v, truncate=truncate))
            else:
                raise invalid("'input' entries must all be strings or lists of token ids")
        return out

    async def score(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, "score")
            queries = _texts(body.get("text_1", body.get("queries")), "text_1")
            docs = _texts(body.get("text_2", body.get("documents")), "text_2")
            if len(queries) == 1:
                queries = queries * len(docs)
            elif len(queries) != len(docs):
                raise invalid("'text_1' must be one string or as many as 'text_2'")
            truncate = self._truncate(body)
            instruction = body.get("instruction") or ""
            prompts = [self.pooling.score_prompt(q, d, instruction, truncate)
                       for q, d in zip(queries, docs)]
            out = await self._run(prompts, self._options(request, body, SCORE))
        except RequestError as e:
            return error_response(e)
        return web.json_response({
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.api.cfg.model_name,
            "data": [{"index": i, "object": "score", "score": _floats(v)[0]}
                     for i, v in enumerate(out.values)],
            "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}})

    async def rerank(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, "score")
            query = body.get("query")
            if not isinstance(query, str) or not query:
                raise invalid("'query' must be a non-empty string")
            docs = _texts(body.get("documents"), "documents")
            top_n = body.get("top_n") or len(docs)
            if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
                raise invalid("'top_n' must be a positive integer")
            keep = body.get("return_documents", True)
            if not isinstance(keep, bool):
                raise invalid("'return_documents' must be a boolean")
            prompts = [self.pooling.score_prompt(query, d, body.get("instruction") or "",
                                                 self._truncate(body)) for d in docs]
            out = await self._run(prompts, self._options(request, body, SCORE))
        except RequestError as e:
            return error_response(e)
        scores = [_floats(v)[0] for v in out.values]
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if keep else {})} for i in order]
        return web.json_response({"id": f"rerank-{uuid.uuid4().hex}",
                                  "model": self.api.cfg.model_name, "results": results,
                                  "usage": {"total_tokens": out.prompt_tokens}})
