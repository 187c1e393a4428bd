"""client/ against an in-process fake server (an echo GenerationServicer defined here).

The fake "generates" the prompt back one character per token (token id = code point),
so every output is predictable; the real server is exercised by the end-to-end tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client import (AsyncClient, Client, Completion, GenerationChunk, ModelInfo, NanoserveError,
                    SamplingParams, Stats, Usage)
from nanoserve.v1 import generate_pb2, generate_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


class EchoServicer(generate_pb2_grpc.GenerationServicer):
    """Echoes the prompt, honouring max_tokens and stop strings; special prompts:
    "" -> INVALID_ARGUMENT, "hang" -> sleeps (deadlines), "slow..." -> endless stream."""

    def __init__(self) -> None:
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.cancelled = threading.Event()

    def _prompt_text(self, req: generate_pb2.GenerateRequest, context) -> str:
        kind = req.WhichOneof("input")
        if kind == "text":
            text = req.text
        elif kind == "token_ids":
            text = "".join(chr(i) for i in req.token_ids.ids)
        elif kind == "chat":
            text = "".join(f"{m.role}:{m.content}|" for m in req.chat.messages)
        else:
            text = ""
        if not text:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        return text

    def _responses(self, req, context):
        self.requests.append(req)
        text = self._prompt_text(req, context)
        if text == "hang":  # until the deadline passes (or 5 s)
            for _ in range(500):
                if not context.is_active():
                    return
                time.sleep(0.01)
        if text.startswith("slow"):
            # Fires when the RPC ends; this stream never ends by itself, so only a
            # cancellation (client left the loop) can end it.
            context.add_callback(self.cancelled.set)
            for i in range(1000):
                if not context.is_active():
                    return
                yield generate_pb2.GenerateResponse(request_id="slow", token_ids=[46], text=".")
                time.sleep(0.01)
        sp = req.sampling
        finish = generate_pb2.FINISH_REASON_STOP
        for s in sp.stop:
            if s in text:
                text = text[:text.index(s)]
        if sp.HasField("max_tokens") and sp.max_tokens < len(text):
            text, finish = text[:sp.max_tokens], generate_pb2.FINISH_REASON_LENGTH
        rid = req.request_id or "req-1"
        prompt_tokens = len(self._prompt_text(req, context))
        for i, ch in enumerate(text):
            last = i == len(text) - 1
            yield generate_pb2.GenerateResponse(
                request_id=rid, token_ids=[ord(ch)], text=ch,
                logprobs=[-0.5] if sp.logprobs else [],
                finish_reason=finish if last else generate_pb2.FINISH_REASON_UNSPECIFIED,
                usage=generate_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(text),
                                         cached_tokens=1) if last else None)

    def Generate(self, request, context):
        yield from self._responses(request, context)

    def Complete(self, request, context):
        out = generate_pb2.CompleteResponse()
        for r in self._responses(request, context):
            out.request_id = r.request_id
            out.token_ids.extend(r.token_ids)
            out.text += r.text
            out.logprobs.extend(r.logprobs)
            out.finish_reason = r.finish_reason
            if r.HasField("usage"):
                out.usage.CopyFrom(r.usage)
        return out

    def Tokenize(self, request, context):
        if request.WhichOneof("input") == "chat":
            text = "".join(f"{m.role}:{m.content}|" for m in request.chat.messages)
        else:
            text = request.text
        return generate_pb2.TokenizeResponse(token_ids=[ord(c) for c in text])

    def GetModelInfo(self, request, context):
        return generate_pb2.ModelInfo(model="echo", vocab_size=0x110000, max_model_len=4096,
                                      eos_token_id=0, tensor_parallel_size=1, block_size=256,
                                      num_kv_blocks=100)

    def GetStats(self, request, context):
        return generate_pb2.Stats(num_steps=7, num_generated_tokens=42, workers_healthy=True)


@pytest.fixture(scope="module")
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = EchoServicer()
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, srv)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", servicer
    srv.stop(grace=None)


# ---------------------------------------------------------------------------- sync
def test_sampling_params_to_proto():
    empty = SamplingParams().to_proto()
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens"):
        assert not empty.HasField(name)  # None = server default, not 0
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.25, seed=2**40,
                       max_tokens=9, stop=["x"], stop_token_ids=[1, 2], ignore_eos=True,
                       logprobs=True).to_proto()
    assert p.HasField("temperature") and p.temperature == 0.0  # greedy survives the wire
    assert (p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (0.5, 3, 0.25, 2**40, 9)
    assert list(p.stop) == ["x"] and list(p.stop_token_ids) == [1, 2] and p.ignore_eos and p.logprobs


def test_generate_streams_and_maps_fields(server):
    target, servicer = server
    with Client(target) as c:
        chunks = list(c.generate("héllo", SamplingParams(logprobs=True), request_id="abc"))
    assert "".join(ch.text for ch in chunks) == "héllo"
    assert all(isinstance(ch, GenerationChunk) for ch in chunks) and len(chunks) == 5
    assert [t for ch in chunks for t in ch.token_ids] == [ord(x) for x in "héllo"]
    assert chunks[0].request_id == "abc" and chunks[0].logprobs == [-0.5]
    assert [ch.finish_reason for ch in chunks] == [None] * 4 + ["stop"]
    assert chunks[-1].usage == Usage(prompt_tokens=5, completion_tokens=5, cached_tokens=1)
    assert chunks[0].usage is None
    assert servicer.requests[-1].WhichOneof("input") == "text"


def test_prompt_forms_pick_the_oneof(server):
    target, servicer = server
    with Client(target) as c:
        assert c.complete([104, 105]).text == "hi"
        assert servicer.requests[-1].WhichOneof("input") == "token_ids"
        chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        assert c.complete(chat).text == "system:s|user:u|"
        assert servicer.requests[-1].WhichOneof("input") == "chat"
        with pytest.raises(TypeError):
            c.generate(3.5)  # type: ignore[arg-type]  # raised at the call, not on next()
        with pytest.raises(TypeError):
            c.complete([{"content": "no role"}])


def test_complete_length_stop_and_no_stream(server):
    target, servicer = server
    with Client(target) as c:
        done = c.complete("abcdef", SamplingParams(max_tokens=3, temperature=0))
        assert isinstance(done, Completion)
        assert (done.text, done.token_ids, done.finish_reason) == ("abc", [97, 98, 99], "length")
        assert done.usage.completion_tokens == 3
        sp = servicer.requests[-1].sampling
        assert sp.HasField("temperature") and sp.temperature == 0 and not sp.HasField("top_p")
        assert c.complete("abc STOP def", SamplingParams(stop=["STOP"])).text == "abc "
        (one,) = list(c.generate("xyz", stream=False))
        assert (one.text, one.finish_reason) == ("xyz", "stop")


def test_errors_keep_the_status_code(server):
    target, _ = server
    with Client(target) as c:
        with pytest.raises(NanoserveError) as e:
            list(c.generate(""))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.message == "prompt is empty" and "INVALID_ARGUMENT" in str(e.value)
        with pytest.raises(NanoserveError) as e:
            c.complete([])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(NanoserveError) as e:
            c.complete("hang", timeout=0.2)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with Client(target, timeout=0.2) as c:  # the client-wide default deadline
        with pytest.raises(NanoserveError) as e:
            list(c.generate("hang"))
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with Client("127.0.0.1:1", timeout=2) as c:
        with pytest.raises(NanoserveError) as e:
            c.health()
        assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_leaving_the_stream_cancels_the_request(server):
    target, servicer = server
    servicer.cancelled.clear()
    with Client(target) as c:
        stream = c.generate("slow")
        assert next(stream).text == "."
        stream.close()
        assert servicer.cancelled.wait(5)


def test_unary_calls(server):
    target, _ = server
    with Client(target) as c:
        assert c.tokenize("hi") == [104, 105]
        assert c.tokenize([{"role": "user", "content": "x"}]) == [ord(x) for x in "user:x|"]
        info = c.model_info()
        assert isinstance(info, ModelInfo) and info.model == "echo" and info.block_size == 256
        stats = c.stats()
        assert isinstance(stats, Stats) and stats.num_steps == 7 and stats.workers_healthy
        assert c.health() == "SERVING"
        with pytest.raises(NanoserveError) as e:
            c.health("no.such.Service")
        assert e.value.code == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------------------- asyncio
def test_async_client(server):
    target, servicer = server

    async def main() -> None:
        async with AsyncClient(target) as c:
            chunks = [ch async for ch in c.generate("日本😀", SamplingParams(max_tokens=2))]
            assert "".join(ch.text for ch in chunks) == "日本"
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.prompt_tokens == 3
            (one,) = [ch async for ch in c.generate([104, 105], stream=False)]
            assert one.text == "hi"
            done = await c.complete([{"role": "user", "content": "q"}])
            assert done.text == "user:q|" and done.finish_reason == "stop"
            assert await c.tokenize("ab") == [97, 98]
            assert (await c.model_info()).max_model_len == 4096
            assert (await c.stats()).num_generated_tokens == 42
            assert await c.health() == "SERVING"
            with pytest.raises(NanoserveError) as e:
                async for _ in c.generate(""):
                    pass
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(NanoserveError) as e:
                await c.complete("hang", timeout=0.2)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            servicer.cancelled.clear()
            stream = c.generate("slow")
            async for _ in stream:
                break
            await stream.aclose()
        assert await asyncio.to_thread(servicer.cancelled.wait, 5)

    asyncio.run(main())


# ---------------------------------------------------------------------------- CLI
def cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "client", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=30, input=stdin,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8", **(env or {})})


def test_cli_generate(server):
    target, servicer = server
    r = cli("--target", target, "generate", "héllo wörld", "--max-tokens", "5", "--temperature",
            "0.5", "--top-k", "4", "--seed", "1", "--stop", "x", "--stop", "y", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "héllo\n"
    assert "finish_reason=length" in r.stderr and "completion_tokens=5" in r.stderr
    sp = servicer.requests[-1].sampling
    assert (sp.max_tokens, sp.top_k, sp.seed, list(sp.stop), sp.ignore_eos) == (5, 4, 1, ["x", "y"],
                                                                              True)
    assert abs(sp.temperature - 0.5) < 1e-6 and not sp.HasField("top_p")


def test_cli_generate_json_chat_and_env_target(server):
    target, servicer = server
    r = cli("generate", "q", "--chat", "--system", "s", "--json", "--logprobs",
            env={"NANOSERVE_TARGET": target})
    assert r.returncode == 0, r.stderr
    chunks = [json.loads(line) for line in r.stdout.splitlines()]
    assert "".join(c["text"] for c in chunks) == "system:s|user:q|"
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["usage"]["cached_tokens"] == 1
    assert chunks[0]["logprobs"] == [-0.5]
    assert [(m.role, m.content) for m in servicer.requests[-1].chat.messages] == [("system", "s"),
                                                                                  ("user", "q")]
    r = cli("generate", "-", "--ids", "--no-stream", "--target", target, stdin="104, 105")
    assert (r.returncode, r.stdout) == (0, "hi\n"), r.stderr


def test_cli_errors_and_other_commands(server):
    target, _ = server
    r = cli("--target", target, "generate", "")
    assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "prompt is empty" in r.stderr
    r = cli("--target", target, "--timeout", "0.3", "generate", "hang")
    assert r.returncode == 1 and "DEADLINE_EXCEEDED" in r.stderr
    r = cli("--target", target, "health")
    assert (r.returncode, r.stdout.strip()) == (0, "SERVING")
    r = cli("info", "--target", target)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["model_info"]["model"] == "echo" and info["stats"]["num_steps"] == 7
    r = cli("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "NANOSERVE_TARGET" in r.stdout


def test_free_ports_sit_below_the_ephemeral_range_and_never_repeat():
    """Ports handed to a launcher up front: outside the range the kernel gives outgoing
    connections (so none can take them first), each with the next 7 bindable, no two the
    same (client/ports.py)."""
    import socket

    from client.ports import _BLOCK, _ephemeral_low, free_port
    low = _ephemeral_low()
    ports = [free_port() for _ in range(40)]
    blocks = [set(range(p, p + _BLOCK)) for p in ports]
    assert all(p + _BLOCK <= low for p in ports)
    assert len(set().union(*blocks)) == 40 * _BLOCK          # no overlap between blocks
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))                          # free indeed
