"""Fuzzing both services over real sockets: hypothesis-made GenerateRequests (every field,
extremes, wrong combinations), garbage message bodies for every method of both APIs, and
random bytes on the raw TCP ports. The only answers allowed are OK, INVALID_ARGUMENT and
RESOURCE_EXHAUSTED (never UNKNOWN or INTERNAL); nothing crashes; a good request streaming
all the while gets exactly the null worker's tokens.
"""
from __future__ import annotations

import collections
import json
import os
import socket
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from client.null_model import write_null_model
from nanoserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2
from services import start_null_worker, start_scheduler
from worker_service.null_worker import expected_tokens

pytestmark = pytest.mark.slow
VOCAB, MAX_LEN = 1000, 512
SECRET = "fuzz-secret"
AUTH = (("authorization", f"Bearer {SECRET}"),)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(derandomize=True, max_examples=int(os.environ.get("FUZZ_EXAMPLES", "120")), deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # test -> codes
GENERATION = ["Generate", "Complete", "Tokenize", "GetModelInfo", "GetStats"]
STREAMED = {"Generate"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_null_model(tmp_path_factory.mktemp("null_model"), vocab_size=VOCAB,
                            max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def stack(model_dir):
    """A scheduler over a null worker that wants the secret, and a good request streaming
    in a loop beside the fuzzing (checked at the end of the module)."""
    worker = start_null_worker(model_dir, step_ms=1, extra=["--secret", SECRET])
    sched = start_scheduler(model_dir, [worker.port], block_size=16,
                            extra=["--worker-secret", SECRET])
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    channel = grpc.insecure_channel(f"127.0.0.1:{sched.port}")
    good = _GoodTraffic(generate_pb2_grpc.GenerationStub(channel), eos)
    good.start()
    yield worker, sched, channel, good
    good.stop()
    channel.close()
    sched.stop()
    worker.stop()


class _GoodTraffic(threading.Thread):
    """Streams one known request after another; any deviation is recorded."""

    def __init__(self, stub, eos: int):
        super().__init__(daemon=True)
        self.stub, self.eos = stub, eos
        self.done = threading.Event()
        self.ok, self.errors = 0, []

    def run(self) -> None:
        prompt = [11, 12, 13]
        want = expected_tokens(prompt, 40, VOCAB, self.eos)
        req = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=generate_pb2.SamplingParams(max_tokens=40, ignore_eos=True))
        while not self.done.is_set():
            try:
                got = [t for m in self.stub.Generate(req, timeout=30) for t in m.token_ids]
            except grpc.RpcError as e:
                self.errors.append(f"{e.code()}: {e.details()}")
                continue
            if got != want:
                self.errors.append(f"tokens {got} != {want}")
            self.ok += 1

    def stop(self) -> None:
        self.done.set()
        self.join(60)


def _status(call_fn) -> grpc.StatusCode:
    try:
        call_fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def call_raw(channel: grpc.Channel, method: str, body: bytes, streamed: bool,
             metadata=()) -> grpc.StatusCode:
    """One call with an arbitrary body (no serializers); a stream is read to its first
    message, then cancelled (a valid request may generate for long)."""
    if streamed:
        def first():
            call = channel.unary_stream(method)(body, timeout=20, metadata=metadata)
            try:
                next(call, None)
            finally:
                call.cancel()
        return _status(first)
    return _status(lambda: channel.unary_unary(method)(body, timeout=20, metadata=metadata))


# ---------------------------------------------------------------------------- strategies
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
u32 = st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, MAX_LEN])
u64 = st.integers(0, 2**64 - 1)
i32 = st.integers(-2**31, 2**31 - 1)
text = st.text(max_size=80)


def opt(s):
    return st.none() | s


@st.composite
def sampling_params(draw) -> generate_pb2.SamplingParams:
    p = generate_pb2.SamplingParams(
        stop=draw(st.lists(st.text(max_size=8), max_size=20)),
        stop_token_ids=draw(st.lists(u32, max_size=5)),
        ignore_eos=draw(st.booleans()), logprobs=draw(st.booleans()))
    for name, s in [("temperature", f32), ("top_p", f32), ("top_k", i32), ("min_p", f32),
                    ("seed", u64), ("max_tokens", u32), ("n", u32),
                    ("repetition_penalty", f32), ("presence_penalty", f32),
                    ("frequency_penalty", f32), ("top_logprobs", u32)]:
        v = draw(opt(s))
        if v is not None:
            setattr(p, name, v)
    return p


@st.composite
def generate_requests(draw) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(request_id=draw(text),
                                       skip_special_tokens=draw(st.booleans()))
    kind = draw(st.sampled_from(["none", "text", "ids", "chat"]))
    if kind == "text":
        req.text = draw(st.text(max_size=300))
    elif kind == "ids":
        small = st.integers(0, VOCAB + 2)
        req.token_ids.ids.extend(draw(st.lists(small | u32, max_size=MAX_LEN + 8)))
    elif kind == "chat":
        role = st.sampled_from(["system", "user", "assistant", "tool", ""]) | text
        for r, c in draw(st.lists(st.tuples(role, text), max_size=4)):
            req.chat.messages.add(role=r, content=c)
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling_params()))
    return req


def mutated(messages):
    """Valid serialized messages with bytes flipped, cut or appended: near-misses."""
    @st.composite
    def build(draw):
        data = bytearray(draw(messages).SerializeToString())
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "cut", "append"]))
            if op == "flip" and data:
                i = draw(st.integers(0, len(data) - 1))
                data[i] ^= draw(st.integers(1, 255))
            elif op == "cut" and data:
                del data[draw(st.integers(0, len(data) - 1)):]
            else:
                data += draw(st.binary(min_size=1, max_size=8))
        return bytes(data)
    return build()


@st.composite
def tokenize_requests(draw) -> generate_pb2.TokenizeRequest:
    req = generate_pb2.TokenizeRequest()
    kind = draw(st.sampled_from(["none", "text", "chat"]))
    if kind == "text":
        req.text = draw(st.text(max_size=300))
    elif kind == "chat":
        role = st.sampled_from(["system", "user", "assistant", "tool", ""]) | text
        for r, c in draw(st.lists(st.tuples(role, text), max_size=4)):
            req.chat.messages.add(role=r, content=c)
    return req


garbage = st.binary(max_size=300) | mutated(generate_requests()) | mutated(tokenize_requests())


# ---------------------------------------------------------------------------- public API
def reached_both_outcomes(name: str) -> None:
    """The fuzzing of `name` made both valid and invalid requests (else it tested little)."""
    print(name, dict(SEEN[name]))
    assert SEEN[name]["OK"] > 0 and SEEN[name]["INVALID_ARGUMENT"] > 0, SEEN[name]


@FUZZ
@given(req=generate_requests())
def _fuzz_generate(stack, req):
    _, _, channel, _ = stack
    code = call_raw(channel, "/nanoserve.v1.Generation/Generate", req.SerializeToString(), True)
    SEEN["generate"][code.name] += 1
    assert code in ALLOWED, (code, req)


def test_fuzzed_generate_requests(stack):
    _fuzz_generate(stack=stack)
    reached_both_outcomes("generate")


@FUZZ
@given(req=tokenize_requests())
def test_fuzzed_tokenize_requests(stack, req):
    _, _, channel, _ = stack
    code = call_raw(channel, "/nanoserve.v1.Generation/Tokenize", req.SerializeToString(), False)
    SEEN["tokenize"][code.name] += 1
    assert code in ALLOWED, (code, req)


@FUZZ
@given(method=st.sampled_from(GENERATION), body=garbage)
@example(method="Generate", body=b"\xff")           # truncated varint: was UNKNOWN
@example(method="Complete", body=b"\x12\x02\xc3\x28")   # text field, invalid UTF-8: was UNKNOWN
@example(method="GetStats", body=b"\x0b")            # bad wire type: was UNKNOWN
def _fuzz_public_garbage(stack, method, body):
    _, _, channel, _ = stack
    code = call_raw(channel, f"/nanoserve.v1.Generation/{method}", body, method in STREAMED)
    SEEN["public garbage"][code.name] += 1
    assert code in ALLOWED, (code, method, body)


def test_garbage_bodies_on_the_public_api(stack):
    _fuzz_public_garbage(stack=stack)
    reached_both_outcomes("public garbage")


# ---------------------------------------------------------------------------- worker API
@pytest.fixture(scope="module")
def lone_worker(model_dir):
    """A null worker no scheduler uses: garbage may reset it at will."""
    worker = start_null_worker(model_dir, extra=["--secret", SECRET])
    channel = grpc.insecure_channel(f"127.0.0.1:{worker.port}")
    init = worker_pb2.InitRequest(num_kv_blocks=64, block_size=16).SerializeToString()
    assert call_raw(channel, "/nanoserve.v1.Worker/Init", init, False, AUTH) == grpc.StatusCode.OK
    yield worker, channel
    channel.close()
    worker.stop()


def step_raw(channel: grpc.Channel, bodies: list[bytes]) -> grpc.StatusCode:
    def run():
        for _ in channel.stream_stream("/nanoserve.v1.Worker/Step")(
                iter(bodies), timeout=20, metadata=AUTH):
            pass
    return _status(run)


i32s = st.lists(st.integers(-2, 70) | i32, max_size=12).map(
    lambda xs: b"".join(x.to_bytes(4, "little", signed=True) for x in xs))


@st.composite
def step_requests(draw) -> worker_pb2.StepRequest:
    req = worker_pb2.StepRequest(step_id=draw(u64), token_ids_i32=draw(i32s | st.binary(max_size=9)),
                                 drop_seq_ids=draw(st.lists(st.integers(0, 4) | u64, max_size=3)))
    for _ in range(draw(st.integers(0, 3))):
        req.seqs.add(seq_id=draw(st.integers(0, 4) | u64), num_tokens=draw(st.integers(0, 5) | u32),
                     start_pos=draw(st.integers(0, 20) | u32),
                     reset_block_table=draw(st.booleans()),
                     block_table_i32=draw(i32s | st.binary(max_size=9)),
                     sampling=worker_pb2.WorkerSampling(
                         temperature=draw(f32), top_p=draw(f32), top_k=draw(i32),
                         min_p=draw(f32), has_seed=draw(st.booleans()), seed=draw(u64),
                         logprobs=draw(st.booleans())),
                     sample=draw(st.booleans()))
    if draw(st.booleans()):
        req.decode.seq_ids_u64 = b"".join(x.to_bytes(8, "little") for x in
                                          draw(st.lists(st.integers(0, 4), max_size=4)))
        req.decode.token_ids_i32 = draw(i32s | st.binary(max_size=9))
        req.decode.new_blocks_i32 = draw(i32s | st.binary(max_size=9))
    return req


@FUZZ
@given(steps=st.lists(step_requests(), min_size=1, max_size=4))
def _fuzz_step_streams(lone_worker, steps):
    _, channel = lone_worker
    code = step_raw(channel, [s.SerializeToString() for s in steps])
    SEEN["steps"][code.name] += 1
    assert code in ALLOWED, (code, steps)


def test_fuzzed_step_streams(lone_worker):
    _fuzz_step_streams(lone_worker=lone_worker)
    reached_both_outcomes("steps")


@FUZZ
@given(method=st.sampled_from(["Info", "Init", "Health", "Step"]),
       body=st.binary(max_size=300) | mutated(step_requests()))
def test_garbage_bodies_on_the_worker_api(lone_worker, method, body):
    _, channel = lone_worker
    if method == "Step":
        code = step_raw(channel, [body])
    else:
        code = call_raw(channel, f"/nanoserve.v1.Worker/{method}", body, False, AUTH)
    assert code in ALLOWED, (code, method, body)


# ---------------------------------------------------------------------------- raw TCP
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@FUZZ
@given(blob=st.binary(min_size=1, max_size=2000), preface=st.booleans())
def test_random_bytes_on_raw_ports(stack, lone_worker, blob, preface):
    worker, sched, _, _ = stack
    for port in (sched.port, worker.port, lone_worker[0].port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall((H2_PREFACE if preface else b"") + blob)
            s.settimeout(0.05)
            try:
                s.recv(4096)
            except (socket.timeout, ConnectionError):
                pass


def test_services_survived_and_good_traffic_was_untouched(stack, lone_worker):
    """Last in this module, but not relying on it: every process alive, the concurrent good
    requests all exact (at least three of them), the worker still answering."""
    worker, sched, channel, good = stack
    deadline = time.monotonic() + 30
    while good.ok < 3 and not good.errors and time.monotonic() < deadline:
        time.sleep(0.1)
    good.stop()
    assert not good.errors, good.errors[:5]
    assert good.ok >= 3
    for p in (worker, sched, lone_worker[0]):
        assert p.popen.poll() is None, p.output()
    stats = generate_pb2_grpc.GenerationStub(channel).GetStats(generate_pb2.StatsRequest(), timeout=10)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
