"""The OpenAI-compatible HTTP API, driven by the official `openai` client against real services.

Two stacks over real sockets: a tiny random Qwen3 on a real torch worker, where every
HTTP answer is compared token for token with the gRPC API's answer to the same request
(the independent reference: the path the gRPC tests check against Hugging Face), and a
null worker (no model) behind two frontends sharing the HTTP port, with an API key and a
request deadline, for auth, errors, deadlines and client disconnects, where speed matters.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from client.null_model import write_null_model
from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import children, engine_idle, start_null_worker, start_scheduler, start_worker, wait_until
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
BLOCK = 8
KEY = "sk-test-key"
TIMEOUT = 3.0          # the null stack's --http-request-timeout
STEP_MS = 5            # the null worker's step time: 600 tokens take ~3 s > TIMEOUT


# ---------------------------------------------------------------------------- stacks
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(openai client, gRPC stub, model id) on a tiny Qwen3 with a real torch worker."""
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=3)
    worker = start_worker(model_dir)
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=BLOCK,
                                extra=["--http-port", "0", "--served-model-name", "tiny"])
        channel = grpc.insecure_channel(f"127.0.0.1:{sched.port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{sched.http_port}/v1",
                               api_key="unused", max_retries=0, timeout=60)
        yield client, generate_pb2_grpc.GenerationStub(channel), "tiny"
        channel.close()
    finally:
        if sched:
            sched.stop()
        worker.stop()


@contextlib.contextmanager
def null_stack(tmp_path_factory):
    """(scheduler Proc, openai client, gRPC stub, model id): null worker, two frontends."""
    model_dir = write_null_model(tmp_path_factory.mktemp("null_model"), vocab_size=1000,
                                 max_position_embeddings=1024)
    worker = start_null_worker(model_dir, step_ms=STEP_MS)
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=16, extra=[
            "--http-port", "0", "--frontends", "2", "--api-key", KEY,
            "--http-request-timeout", str(TIMEOUT), "--max-waiting", "6"])
        # --api-key guards the gRPC API too: the stub sends the same bearer token
        channel = grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{sched.port}"),
                                         _Bearer(KEY))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{sched.http_port}/v1", api_key=KEY,
                               max_retries=0, timeout=30)
        yield sched, client, generate_pb2_grpc.GenerationStub(channel), model_dir.name
        channel.close()
    finally:
        if sched:
            sched.stop()
        worker.stop()


@pytest.fixture(scope="module")
def null(tmp_path_factory):
    with null_stack(tmp_path_factory) as stack:
        yield stack


class _Bearer(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, key: str):
        self.metadata = [("authorization", f"Bearer {key}")]

    def intercept_unary_unary(self, continuation, details, request):
        details = details._replace(metadata=list(details.metadata or []) + self.metadata)
        return continuation(details, request)


def grpc_complete(stub, prompt, **sampling) -> generate_pb2.CompleteResponse:
    if isinstance(prompt, str):
        req = generate_pb2.GenerateRequest(text=prompt)
    else:
        req = generate_pb2.GenerateRequest(chat=generate_pb2.Chat(
            messages=[generate_pb2.ChatMessage(**m) for m in prompt]))
    req.sampling.CopyFrom(generate_pb2.SamplingParams(**sampling))
    req.skip_special_tokens = True
    return stub.Complete(req, timeout=60)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]


# ---------------------------------------------------------------------------- tiny model
def test_models_lists_the_served_name(tiny):
    client, _, model = tiny
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model


def test_completion_matches_grpc_token_for_token(tiny):
    client, stub, model = tiny
    ref = grpc_complete(stub, "Numbers 0123", temperature=0, max_tokens=12, ignore_eos=True,
                        logprobs=True)
    r = client.completions.create(model=model, prompt="Numbers 0123", temperature=0,
                                  max_tokens=12, logprobs=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == ref.text and c.finish_reason == "length"
    assert r.usage.completion_tokens == 12 == len(ref.token_ids)
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    assert c.logprobs.token_logprobs == pytest.approx(list(ref.logprobs), abs=1e-5)
    assert "".join(c.logprobs.tokens) == ref.text
    # Token ids as the prompt: the same answer.
    r2 = client.completions.create(model=model, prompt=[5, 6, 7], temperature=0, max_tokens=4)
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]),
                                       sampling=generate_pb2.SamplingParams(temperature=0,
                                                                            max_tokens=4),
                                       skip_special_tokens=True)
    assert r2.choices[0].text == stub.Complete(req, timeout=60).text


def test_logit_bias_matches_grpc(tiny):
    """OpenAI's {"id": bias} map reaches the sampler as the gRPC API's logit_bias does."""
    client, stub, model = tiny
    bias = {17: 3.0, 250: -2.0, 33: 2.5}
    plain = grpc_complete(stub, "Numbers 0123", temperature=0, max_tokens=16, ignore_eos=True)
    ref = grpc_complete(stub, "Numbers 0123", temperature=0, max_tokens=16, ignore_eos=True,
                        logit_bias=bias)
    assert list(ref.token_ids) != list(plain.token_ids)   # the bias changes the answer
    r = client.completions.create(model=model, prompt="Numbers 0123", temperature=0,
                                  max_tokens=16, logit_bias={str(t): b for t, b in bias.items()},
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, seed=3,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == grpc_complete(
        stub, CHAT, max_tokens=5, seed=3, ignore_eos=True, logit_bias={42: 100.0}).text


def test_min_tokens_matches_grpc(tiny):
    """vLLM's min_tokens extra: a stop id greedy emits second cannot end the answer early."""
    client, stub, model = tiny
    plain = grpc_complete(stub, "Numbers 0123", temperature=0, max_tokens=16, ignore_eos=True)
    stops = [plain.token_ids[1]]
    ref = grpc_complete(stub, "Numbers 0123", temperature=0, max_tokens=16, ignore_eos=True,
                        stop_token_ids=stops, min_tokens=5)
    assert len(ref.token_ids) > 5 and stops[0] not in ref.token_ids[:5]
    extra = {"ignore_eos": True, "stop_token_ids": stops, "min_tokens": 5}
    r = client.completions.create(model=model, prompt="Numbers 0123", temperature=0,
                                  max_tokens=16, extra_body=extra)
    assert r.choices[0].text == ref.text


def test_chat_streaming_and_not_match_grpc(tiny):
    client, stub, model = tiny
    ref = grpc_complete(stub, CHAT, temperature=0, max_tokens=10)
    whole = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                           max_tokens=10)
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                                 max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens == ref.usage.completion_tokens
    # Text content parts render like a plain string.
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    assert client.chat.completions.create(model=model, messages=parts, temperature=0,
                                          max_tokens=10).choices[0].message.content == ref.text


def test_stop_and_max_tokens(tiny):
    client, stub, model = tiny
    full = grpc_complete(stub, "Once upon", temperature=0, max_tokens=16, ignore_eos=True).text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), full
    r = client.completions.create(model=model, prompt="Once upon", temperature=0, max_tokens=16,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    chat = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                          max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3


def test_seed_and_n(tiny):
    """Seeded sampling is reproducible and equals gRPC's; choice j of n uses seed + j."""
    client, stub, model = tiny
    refs = [grpc_complete(stub, "Once upon", temperature=1.0, seed=7 + j, max_tokens=8,
                          ignore_eos=True).text for j in range(3)]
    assert len(set(refs)) > 1, "different seeds should sample differently"
    r = client.completions.create(model=model, prompt="Once upon", temperature=1.0, seed=7,
                                  max_tokens=8, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == refs
    assert r.usage.completion_tokens == 24
    again = client.completions.create(model=model, prompt="Once upon", temperature=1.0, seed=7,
                                      max_tokens=8, extra_body={"ignore_eos": True})
    assert again.choices[0].text == refs[0]
    # Streamed n: each index gets its own text, interleaved.
    texts = {}
    for ch in client.completions.create(model=model, prompt="Once upon", temperature=1.0, seed=7,
                                        max_tokens=8, n=2, stream=True,
                                        extra_body={"ignore_eos": True}):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: refs[0], 1: refs[1]}


def test_usage_reports_cached_prompt_tokens(tiny):
    client, _, model = tiny
    prompt = "Numbers 0123456789, dates 2024-06-01, code: def f(x): return x * 2 " * 2
    first = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=2)
    second = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 2 * BLOCK
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0 and cached < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text


def test_bad_requests_are_400_in_openai_shape(tiny):
    client, _, model = tiny
    bad = [dict(prompt="x", temperature=-1), dict(prompt="x", top_p=0), dict(prompt="x", n=0),
           dict(prompt="", max_tokens=1), dict(prompt="x", max_tokens=0),
           dict(prompt="x " * 600), dict(prompt=[10_000]), dict(prompt="x", echo=True),
           dict(prompt="x", logit_bias={"abc": 1}), dict(prompt="x", logit_bias={"5": "up"}),
           dict(prompt="x", logit_bias={"10000": 1}), dict(prompt="x", logit_bias={"5": 101}),
           dict(prompt="x", logit_bias={"99999999999": 1}),
           dict(prompt="x", extra_body={"min_tokens": -1}),
           dict(prompt="x", max_tokens=2, extra_body={"min_tokens": 3})]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, **kw)
        assert e.value.status_code == 400
        assert e.value.body["type"] == "invalid_request_error", kw
        assert e.value.body["code"] == "invalid_argument" and e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[])
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    for kw, fragment in [(dict(tools=[tool], tool_choice="required"), "nope"),
                         (dict(tools=[tool], tool_choice={"type": "function",
                                                          "function": {"name": "g"}}), "'g'"),
                         (dict(tool_choice="required"), "tools"),
                         (dict(response_format={"type": "xml"}), "xml"),
                         (dict(extra_body={"guided_regex": "[a-", "guided_choice": ["a"]}), "one"),
                         (dict(extra_body={"guided_regex": "[a-"}), "regex")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=CHAT, **kw)
        assert fragment in e.value.body["message"], kw
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert "gpt-4" in e.value.body["message"]
    # Not JSON at all.
    req = urllib.request.Request(f"{client.base_url}completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["type"] == \
        "invalid_request_error"
    # Unknown routes answer in the same shape.
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{client.base_url}audio/speech", data=b"{}", timeout=10)
    assert e.value.code == 404 and json.loads(e.value.read())["error"]["message"]
    # Embeddings on a generation deployment: 400 with the reason (issue 67).
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{client.base_url}embeddings", data=b'{"input": "x"}', timeout=10)
    assert e.value.code == 400 and "--task embed" in json.loads(e.value.read())["error"]["message"]
    # None of that harmed the server.
    assert client.completions.create(model=model, prompt="x", max_tokens=1).choices[0].text \
        is not None


# ---------------------------------------------------------------------------- null worker
def listeners(port: int) -> int:
    """Sockets listening on 127.0.0.1:port (Linux /proc/net/tcp, state 0A)."""
    want = f"0100007F:{port:04X}"
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for r in rows if r.split()[1] == want and r.split()[3] == "0A")


def all_frontends_healthy(port: int, tries: int = 24) -> bool:
    """/health answers 200 on `tries` fresh connections in a row: the kernel spreads them over
    the frontends' listeners, so one still waiting for the engine core is missed with
    probability 2**-tries (two frontends)."""
    for _ in range(tries):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
    return True


def test_both_frontends_serve_http_and_api_key_is_required_except_health(null):
    sched, client, _, model = null
    assert listeners(sched.http_port) == 2, "one HTTP listener per frontend (SO_REUSEPORT)"
    base = f"http://127.0.0.1:{sched.http_port}"
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        c.models.list()
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    with pytest.raises(urllib.error.HTTPError) as e:   # no Authorization header at all
        urllib.request.urlopen(f"{base}/v1/models", timeout=5)
    assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "unauthenticated"
    with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    assert client.models.list().data[0].id == model


def test_deadline_is_504_and_frees_the_request(null):
    sched, client, stub, model = null
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=900,
                                  extra_body={"ignore_eos": True})
    assert e.value.status_code == 504 and e.value.body["type"] == "timeout"
    assert TIMEOUT - 0.5 < time.monotonic() - t0 < TIMEOUT + 5
    assert wait_until(lambda: engine_idle(stub), timeout=10)
    # Streaming: the deadline ends the stream with an error event.
    with pytest.raises(openai.APIError) as e:
        for _ in client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=900,
                                           stream=True, extra_body={"ignore_eos": True}):
            pass
    assert "longer than" in str(e.value)
    assert wait_until(lambda: engine_idle(stub), timeout=10)


def test_client_disconnect_mid_stream_aborts_in_the_engine(null):
    sched, client, stub, model = null
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=900,
                                            stream=True, extra_body={"ignore_eos": True})
    got = 0
    for _ in stream:
        got += 1
        if got == 5:
            break
    assert stub.GetStats(generate_pb2.StatsRequest(), timeout=5).num_running == 1
    stream.close()   # drops the connection
    t0 = time.monotonic()
    assert wait_until(lambda: engine_idle(stub), timeout=3), stub.GetStats(generate_pb2.StatsRequest())
    assert time.monotonic() - t0 < 2.0   # long before the 900 tokens (~4.5 s) would be done
    # A non-streaming request has nothing to write until the end: the handler is cancelled
    # the moment its connection drops (the client gives up after 0.5 s of ~2.5 s).
    impatient = client.with_options(timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=model, prompt=[7, 8], max_tokens=500,
                                     extra_body={"ignore_eos": True})
    t0 = time.monotonic()
    assert wait_until(lambda: engine_idle(stub), timeout=3)
    assert time.monotonic() - t0 < 1.0


def test_full_queue_is_429(null):
    sched, client, stub, model = null
    streams = []
    try:
        for i in range(6):
            streams.append(client.completions.create(
                model=model, prompt=[i + 1, 2], max_tokens=300, stream=True,
                extra_body={"ignore_eos": True}))
        for s in streams:
            next(iter(s))
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=model, prompt=[9, 9], max_tokens=1)
        assert e.value.status_code == 429 and e.value.body["type"] == "rate_limit_error"
    finally:
        for s in streams:
            s.close()
    assert wait_until(lambda: engine_idle(stub), timeout=5)
    assert client.completions.create(model=model, prompt=[9, 9], max_tokens=2).usage \
        .completion_tokens == 2


def test_engine_core_down_is_503_then_recovers(null):
    sched, client, stub, model = null
    core = next(c for c in children(sched.popen.pid)
                if Path(f"/proc/{c}/comm").read_text().strip() == "ns-engine-core")
    os.kill(core, signal.SIGKILL)
    statuses = set()
    deadline = time.monotonic() + 20
    quick = client.with_options(timeout=0.5)   # one sent before the frontend noticed waits
    while time.monotonic() < deadline:         # for the new core (then resumes): go on
        try:
            quick.completions.create(model=model, prompt=[4, 5], max_tokens=2)
            if 503 in statuses:
                break
        except openai.APITimeoutError:
            pass
        except openai.APIStatusError as e:
            statuses.add(e.status_code)
            assert e.status_code == 503 and e.body["type"] == "service_unavailable"
        time.sleep(0.05)
    assert statuses == {503}
    # Each frontend reconnects on its own: the one that answered may be back before the
    # other. Tests after this one need both (SO_REUSEPORT spreads connections over them).
    assert wait_until(lambda: all_frontends_healthy(sched.http_port), timeout=20)
    assert client.completions.create(model=model, prompt=[4, 5], max_tokens=2).usage \
        .completion_tokens == 2


def test_launch_passes_the_http_port():
    from scheduler_service.launch import commands, parse_args
    sched = commands(parse_args(["--model", "m", "--http-port", "8000"]))[-1]
    assert sched[sched.index("--http-port") + 1] == "8000"
    assert "--http-port" not in commands(parse_args(["--model", "m"]))[-1]


def test_sigterm_drains_http_streams(tmp_path_factory):
    """A stream in flight finishes, the server exits 0 (a stack of its own: it stops it)."""
    with null_stack(tmp_path_factory) as (sched, client, stub, model):
        _sigterm_drains(sched, client, model)


def _sigterm_drains(sched, client, model) -> None:
    stream = client.completions.create(model=model, prompt=[3, 4], max_tokens=200, stream=True,
                                       logprobs=0, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    sched.popen.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].logprobs.tokens) for c in [first, *rest]) == 200
    assert sched.wait_exit(timeout=20) == 0, sched.output()
