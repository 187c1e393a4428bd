"""Service lifecycle on real processes: graceful SIGTERM, grace expiry, reflection, CLI, load shedding.

One worker for the module; each test starts its own scheduler (shutdown tests consume
theirs). The checkpoint allows 4096 positions so that a stream can outlive the moment
a test acts on it: the tiny model makes a few hundred tokens a second on CPU.
"""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import ROOT, start_scheduler, start_worker, wait_until
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
VOCAB = 389
PROMPT = [5, 17, 42, 99, 123]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=3,
                          max_position_embeddings=4096)


@pytest.fixture(scope="module")
def worker(model_dir):
    w = start_worker(model_dir)
    yield w
    w.stop()


@contextlib.contextmanager
def scheduler(model_dir, worker, *extra):
    """A scheduler on the module's worker; logs at INFO so the test can see the shutdown start."""
    sched = start_scheduler(model_dir, [worker.port], extra=["--log-level", "INFO", *extra])
    channel = grpc.insecure_channel(f"127.0.0.1:{sched.port}")
    try:
        yield sched, channel, generate_pb2_grpc.GenerationStub(channel)
    finally:
        channel.close()
        sched.stop(timeout=5)   # a no-op when the test already made it exit; SIGKILL after 5 s


def request(max_tokens: int, prompt=PROMPT) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


class StreamReader:
    """Drains a Generate stream in a thread, time-stamping each chunk; keeps the error if any."""

    def __init__(self, call):
        self.call = call
        self.chunks: list[tuple[float, generate_pb2.GenerateResponse]] = []
        self.error: grpc.RpcError | None = None
        self.ended_at: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            for chunk in self.call:
                self.chunks.append((time.monotonic(), chunk))
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def token_ids(self) -> list[int]:
        return [t for _, c in self.chunks for t in c.token_ids]


def sigterm_and_wait_for_drain(sched) -> tuple[float, float]:
    """SIGTERM the scheduler; return when the signal went and when its log showed the drain."""
    sent = time.monotonic()
    sched.popen.send_signal(signal.SIGTERM)
    assert wait_until(lambda: any("shutting down" in line for line in sched.log), timeout=10), \
        f"no shutdown log line after SIGTERM:\n{sched.output()}"
    return sent, time.monotonic()


def test_sigterm_drains_in_flight_stream_refuses_new_requests_and_exits_0(model_dir, worker):
    max_tokens = 800   # ~3 s here: far longer than the shutdown takes to start, far below the grace
    with scheduler(model_dir, worker, "--shutdown-grace", "20") as (sched, channel, stub):
        reference = list(stub.Complete(request(40), timeout=30).token_ids)
        assert len(reference) == 40
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service="nanoserve.v1.Generation"),
                             timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

        reader = StreamReader(stub.Generate(request(max_tokens), timeout=60))
        assert wait_until(lambda: reader.chunks, timeout=10), "stream produced nothing"
        assert stub.GetStats(generate_pb2.StatsRequest()).num_running == 1
        sigterm_sent, drain_began = sigterm_and_wait_for_drain(sched)

        # Health watchers are told before the port goes away. (A new Check cannot see it: the
        # listening socket is closed as soon as the drain starts.) End the watch ourselves,
        # it is an in-flight call too.
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()

        # New requests fail, on the old channel and on a new one.
        for ch in (channel, grpc.insecure_channel(f"127.0.0.1:{sched.port}")):
            with pytest.raises(grpc.RpcError) as err:
                generate_pb2_grpc.GenerationStub(ch).Complete(request(4), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value

        # The in-flight stream finishes normally, inside the grace period.
        assert reader.join(timeout=30), "stream still running 30 s after SIGTERM"
        assert reader.error is None, f"in-flight stream failed during the drain: {reader.error!r}"
        assert reader.ended_at > sigterm_sent, "the stream was over before SIGTERM: make it longer"
        assert any(t > drain_began for t, _ in reader.chunks), "no token arrived during the drain"
        ids = reader.token_ids
        last = reader.chunks[-1][1]
        assert len(ids) == max_tokens
        assert ids[:40] == reference
        assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == max_tokens
        assert last.usage.prompt_tokens == len(PROMPT)
        assert all(c.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for _, c in reader.chunks[:-1])

        # Nothing left in flight: exit now, not when the 20 s grace runs out.
        assert sched.wait_exit(timeout=8) == 0, f"exit status {sched.popen.poll()}:\n{sched.output()}"
        assert time.monotonic() - reader.ended_at < 8


def test_grace_expiry_ends_long_stream_and_exits_0(model_dir, worker):
    max_tokens = 3500   # ~15 s of generation: cannot finish within a 1 s grace
    with scheduler(model_dir, worker, "--shutdown-grace", "1") as (sched, channel, stub):
        reader = StreamReader(stub.Generate(request(max_tokens), timeout=60))
        assert wait_until(lambda: reader.chunks, timeout=10), "stream produced nothing"
        sigterm_sent, _ = sigterm_and_wait_for_drain(sched)
        assert reader.join(timeout=6), "stream not ended 6 s after SIGTERM with a 1 s grace"
        assert reader.ended_at - sigterm_sent > 0.5, "the stream ended long before the grace ran out"
        # Cut short: an error, and never a chunk that claims the completion finished.
        assert reader.error is not None, "stream ended without an error: it looks complete but is not"
        assert reader.error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), reader.error
        assert 0 < len(reader.token_ids) < max_tokens
        assert all(c.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for _, c in reader.chunks)
        assert sched.wait_exit(timeout=5) == 0, f"exit status {sched.popen.poll()}:\n{sched.output()}"


def test_open_health_watch_does_not_hold_up_shutdown(model_dir, worker):
    """gRPC health-checking clients keep a Watch open; it must not make every SIGTERM wait
    the whole grace period when no generation is running."""
    with scheduler(model_dir, worker, "--shutdown-grace", "8") as (sched, channel, stub):
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                           timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        sent, _ = sigterm_and_wait_for_drain(sched)
        assert sched.wait_exit(timeout=4) == 0, f"exit status {sched.popen.poll()}:\n{sched.output()}"
        assert time.monotonic() - sent < 4, "an idle server waited for the grace period"
        watch.cancel()


def _reflect(channel, **req) -> reflection_pb2.ServerReflectionResponse:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**req)]),
                                               timeout=10))
    assert len(responses) == 1
    return responses[0]


def test_server_reflection_lists_services_and_describes_generate(model_dir, worker):
    with scheduler(model_dir, worker) as (sched, channel, stub):
        listed = _reflect(channel, list_services="")
        names = {s.name for s in listed.list_services_response.service}
        assert {"nanoserve.v1.Generation", "grpc.health.v1.Health"} <= names, names

        resp = _reflect(channel, file_containing_symbol="nanoserve.v1.Generation")
        assert resp.WhichOneof("message_response") == "file_descriptor_response", resp
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in resp.file_descriptor_response.file_descriptor_proto]
        services = {f"{f.package}.{s.name}": s for f in files for s in f.service}
        methods = {m.name: m for m in services["nanoserve.v1.Generation"].method}
        assert {"Generate", "Complete", "GetModelInfo"} <= set(methods), set(methods)
        gen = methods["Generate"]
        assert gen.server_streaming and not gen.client_streaming
        assert gen.input_type == ".nanoserve.v1.GenerateRequest"
        assert gen.output_type == ".nanoserve.v1.GenerateResponse"

        missing = _reflect(channel, file_containing_symbol="nanoserve.v1.NoSuchService")
        assert missing.WhichOneof("message_response") == "error_response"
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_cli_against_real_server(model_dir, worker):
    with scheduler(model_dir, worker) as (sched, channel, stub):
        target = ["--target", f"127.0.0.1:{sched.port}"]
        expected = stub.Complete(generate_pb2.GenerateRequest(
            text="hello", sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=8)),
            timeout=30)

        out = cli("generate", "hello", "--max-tokens", "8", "--temperature", "0", *target)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip(), "no text printed"
        assert out.stdout == expected.text + "\n"
        assert f"completion_tokens={len(expected.token_ids)}" in out.stderr

        out = cli("generate", "hello", "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
                  "--json", *target)
        assert out.returncode == 0, out.stderr
        chunks = [json.loads(line) for line in out.stdout.splitlines()]
        assert chunks and chunks[-1]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 8
        assert sum(len(c["token_ids"]) for c in chunks) == 8

        out = cli("health", *target)
        assert (out.returncode, out.stdout.strip()) == (0, "SERVING"), out.stderr

        out = cli("info", *target)
        assert out.returncode == 0, out.stderr
        info = json.loads(out.stdout)
        assert info["model_info"]["vocab_size"] == VOCAB
        assert info["stats"]["workers_healthy"] is True

        out = cli("generate", "hello", "--temperature", "-1", *target)
        assert out.returncode != 0
        assert "INVALID_ARGUMENT" in out.stderr and "temperature" in out.stderr, out.stderr


def test_max_waiting_sheds_load_and_recovers(model_dir, worker):
    with scheduler(model_dir, worker, "--max-waiting", "2") as (sched, channel, stub):
        calls = [stub.Generate(request(3000, PROMPT + [i]), timeout=60) for i in range(2)]
        for call in calls:
            assert next(call).token_ids   # both admitted and running
        stats = stub.GetStats(generate_pb2.StatsRequest())
        assert stats.num_running + stats.num_waiting == 2

        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(request(4), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many" in err.value.details()

        for call in calls:
            call.cancel()
        assert wait_until(lambda: (s := stub.GetStats(generate_pb2.StatsRequest())).num_running
                          + s.num_waiting == 0, timeout=10), "cancelled streams still held"
        out = stub.Complete(request(4), timeout=30)
        assert len(out.token_ids) == 4 and out.finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_worker_logs_where_its_start_up_went(worker):
    """One line per worker start names each start-up phase with its seconds and their total
    (issue 49: where a cold start goes), before the worker says it listens."""
    log = worker.log
    at = next(i for i, line in enumerate(log) if "start-up:" in line)
    assert at < next(i for i, line in enumerate(log) if "listening on" in line)
    phases, total = log[at].split("start-up:")[1].strip().split("; total ")
    seconds = {}
    for part in phases.split(", "):
        name, value, unit = part.rsplit(" ", 2)
        assert unit == "s"
        seconds[name] = float(value)
    assert {"attention backend", "weights", "profile run"} <= set(seconds), seconds
    assert total.endswith(" s")
    assert abs(sum(seconds.values()) - float(total[:-2])) <= 0.05 * len(seconds) + 1e-9
