"""Streams that survive a replica: continue a Generate stream whose server died mid-stream
on another one, with the prompt plus the tokens already delivered (NVIDIA Dynamo's request
migration; llm-d and vllm-router have none).

Why it continues token-identically: a greedy step depends only on the tokens before it,
and a seeded sample's noise is keyed by (seed, absolute position) (worker_service/
sampler.py), so prompt + delivered tokens as the new prompt puts every later token at the
position, and under the draw, it had. max_tokens and min_tokens shrink by what was
delivered; usage is reported as one request's.

The text a dead server held back is the hard part: its detokenizer holds back a partial
UTF-8 character and any tail that may grow into a stop string, and that text died with it.
So a deterministic request (greedy or seeded) resumes a few tokens early, from before
the last token whose text the caller saw complete: the new server recomputes those tokens
(the same ones: checked, never delivered twice) and re-decodes their text, which also lets
its stop matcher see a stop string straddling the cut; the client passes on only the text
past what the caller already has. An unseeded sampled request resumes exactly at the cut
(it cannot regenerate the same tokens): its text may lack what the dead server held back.

Not resumed (the error reaches the caller): n > 1, output formats and predictions (their
state on the server starts over with the prompt), and errors other than a lost server.
Penalties that count output tokens (presence, frequency) see the delivered tokens as prompt.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import grpc

from nanoserve.v1 import generate_pb2

MAX_RESUMES = 3     # per stream: more means something other than one replica is wrong
MAX_OVERLAP = 32    # tokens recomputed at most to recover held-back text
# What a server lost mid-stream looks like: UNAVAILABLE (connection refused/reset, the
# server going away), or the transport's own words under INTERNAL / UNKNOWN.
_LOST_WORDS = ("reset", "socket closed", "rst_stream", "connection", "goaway", "eof")


def lost_server(err: grpc.RpcError) -> bool:
    code = err.code() if hasattr(err, "code") else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    details = (err.details() if hasattr(err, "details") else str(err)) or ""
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and any(
        w in details.lower() for w in _LOST_WORDS)


class _Diverged(Exception):
    """The recomputed overlap differs from what was delivered (not deterministic after all)."""


@dataclass
class Resumption:
    """One stream's progress, and the requests that continue it."""
    request: generate_pb2.GenerateRequest
    max_resumes: int = MAX_RESUMES
    token_ids: list[int] = field(default_factory=list)   # delivered to the caller
    text: str = ""                                       # delivered to the caller
    resumes: int = 0
    prompt_len: int = 0          # of the original prompt, once known
    _tail_tokens: int = 0        # delivered tokens since (and with) the last chunk with text
    _skip: list[int] = field(default_factory=list)   # overlap ids the new server recomputes
    _overlap_text: str = ""
    _base: int = 0               # delivered tokens the current attempt's prompt holds
    finished: bool = False

    @property
    def deterministic(self) -> bool:
        s = self.request.sampling
        return not s.HasField("temperature") or s.temperature == 0 or s.HasField("seed")

    def resumable(self, err: Exception) -> bool:
        s = self.request.sampling
        return (not self.finished and self.resumes < self.max_resumes
                and (isinstance(err, _Diverged) or lost_server(err))
                and (not s.HasField("n") or s.n <= 1)
                and not s.HasField("structured") and not s.HasField("prediction"))

    def next_request(self, prompt_ids: Callable[[], list[int]],
                     overlap: bool = True) -> generate_pb2.GenerateRequest | None:
        """The request that continues the stream (None: nothing is left to generate)."""
        self.resumes += 1
        s = self.request.sampling
        done = len(self.token_ids)
        if s.HasField("max_tokens") and done >= s.max_tokens:
            return None
        if not done:
            self._base, self._skip = 0, []
            return self.request
        ids = list(self.request.token_ids.ids) if self.request.HasField("token_ids") \
            else prompt_ids()
        self.prompt_len = len(ids)
        j = min(self._tail_tokens, MAX_OVERLAP, done) if overlap and self.deterministic else 0
        self._base = done - j
        self._skip = self.token_ids[self._base:]
        self._overlap_text = ""
        req = generate_pb2.GenerateRequest()
        req.CopyFrom(self.request)
        req.token_ids.CopyFrom(generate_pb2.TokenIds(ids=ids + self.token_ids[:self._base]))
        if s.HasField("max_tokens"):
            req.sampling.max_tokens = s.max_tokens - self._base
        if s.HasField("min_tokens"):
            req.sampling.min_tokens = max(0, s.min_tokens - self._base)
        return req

    def accept(self, msg: generate_pb2.GenerateResponse) -> generate_pb2.GenerateResponse | None:
        """A message of the current attempt as the caller should see it (None: nothing new)."""
        if self._skip:
            ids = list(msg.token_ids)
            n = min(len(ids), len(self._skip))
            if ids[:n] != self._skip[:n]:
                raise _Diverged(f"recomputed {ids[:n]}, delivered {self._skip[:n]}")
            self._skip = self._skip[n:]
            self._overlap_text += msg.text
            out = generate_pb2.GenerateResponse()
            out.CopyFrom(msg)
            del out.token_ids[:n]
            del out.logprobs[:min(n, len(out.logprobs))]
            del out.top_logprobs[:min(n, len(out.top_logprobs))]
            if self._skip and not msg.finish_reason:
                return None   # all overlap: its text waits in _overlap_text
            out.text = self._align(self._overlap_text)
            msg = out
        if self._base and msg.HasField("usage"):   # one request's usage, not the last attempt's
            msg.usage.prompt_tokens -= self._base
            msg.usage.completion_tokens += self._base
            msg.usage.cached_tokens = min(msg.usage.cached_tokens, msg.usage.prompt_tokens)
        self.token_ids.extend(msg.token_ids)
        self.text += msg.text
        if msg.text:
            self._tail_tokens = len(msg.token_ids)
        else:
            self._tail_tokens += len(msg.token_ids)
        if msg.finish_reason:
            self.finished = True
        return msg

    def _align(self, recomputed: str) -> str:
        """What of the recomputed overlap's text the caller has not seen: the longest start
        of it that the delivered text ends with is already there."""
        for q in range(min(len(recomputed), len(self.text)), 0, -1):
            if self.text.endswith(recomputed[:q]):
                return recomputed[q:]
        return recomputed

    def finish_message(self) -> generate_pb2.GenerateResponse:
        """The last message of a stream that died after its last token, before its end."""
        self.finished = True
        n = len(self.token_ids)
        if self.request.HasField("token_ids"):
            self.prompt_len = len(self.request.token_ids.ids)
        return generate_pb2.GenerateResponse(
            request_id=self.request.request_id, finish_reason=generate_pb2.FINISH_REASON_LENGTH,
            usage=generate_pb2.Usage(prompt_tokens=self.prompt_len, completion_tokens=n))


def tokenize_request(req: generate_pb2.GenerateRequest) -> generate_pb2.TokenizeRequest:
    """The Tokenize call that gives a text or chat prompt's ids as Generate computes them."""
    if req.HasField("chat"):
        return generate_pb2.TokenizeRequest(chat=req.chat)
    return generate_pb2.TokenizeRequest(text=req.text)


OpenCall = Callable[[generate_pb2.GenerateRequest, int], Iterator[generate_pb2.GenerateResponse]]


def stream(request: generate_pb2.GenerateRequest, open_call: OpenCall,
           prompt_ids: Callable[[], list[int]], max_resumes: int = MAX_RESUMES
           ) -> Iterator[generate_pb2.GenerateResponse]:
    """Messages of `request`, continued on another server when one dies mid-stream.
    open_call(request, attempt) streams one attempt (the caller picks its target from the
    attempt number); prompt_ids() tokenizes a text or chat prompt (once, when needed)."""
    r = Resumption(request, max_resumes)
    req, attempt, overlap = request, 0, True
    while True:
        try:
            for msg in open_call(req, attempt):
                if (out := r.accept(msg)) is not None:
                    yield out
            return
        except (grpc.RpcError, _Diverged) as e:
            if not r.resumable(e):
                raise
            overlap = overlap and not isinstance(e, _Diverged)
            attempt += 1
            req = r.next_request(prompt_ids, overlap)
            if req is None:
                yield r.finish_message()
                return


async def astream(request: generate_pb2.GenerateRequest, open_call, prompt_ids,
                  max_resumes: int = MAX_RESUMES) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """`stream` on asyncio: open_call returns an async iterator, prompt_ids is awaited."""
    r = Resumption(request, max_resumes)
    req, attempt, overlap = request, 0, True
    while True:
        try:
            async with contextlib.aclosing(open_call(req, attempt)) as msgs:
                async for msg in msgs:   # closed at once when the caller stops: cancels the call
                    if (out := r.accept(msg)) is not None:
                        yield out
            return
        except (grpc.RpcError, _Diverged) as e:
            if not r.resumable(e):
                raise
            overlap = overlap and not isinstance(e, _Diverged)
            attempt += 1
            ids = await prompt_ids() if not request.HasField("token_ids") and r.token_ids else []
            req = r.next_request(lambda: ids, overlap)
            if req is None:
                yield r.finish_message()
                return
