"""The control plane's processes over real sockets, driven by a null worker (no model, no torch).

The null worker's ids are a known function of each prompt (null_worker.expected_tokens),
so every token that reaches a client can be checked, through preemption, overlap and
restarts. The supervisor's children are found through /proc and named (ns-engine-core,
ns-frontend-N), so tests can kill exactly the one they mean.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.null_model import write_null_model
from nanoserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from services import alive, named_children, start_null_worker, start_scheduler, wait_until
from worker_service.null_worker import expected_tokens

pytestmark = pytest.mark.slow
VOCAB, MAX_LEN = 1000, 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_null_model(tmp_path_factory.mktemp("null_model"), vocab_size=VOCAB,
                            max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def eos(model_dir):
    import json
    return json.loads((model_dir / "config.json").read_text())["eos_token_id"]


def request(prompt, max_tokens, **sampling):
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))


def worker_health(port: int) -> worker_pb2.HealthResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=5)


def test_every_token_arrives_through_preemption_and_packed_decode(model_dir, eos):
    """Small KV cache (preemption by recompute), block size 16 (decode appends blocks),
    24 concurrent streams: each stream's ids are exactly the null worker's."""
    worker = start_null_worker(model_dir, step_ms=1, extra=["--null-kv-blocks", "40"])
    sched = start_scheduler(model_dir, [worker.port], block_size=16)
    try:
        rng = random.Random(1)
        reqs = [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))], rng.randint(1, 120))
                for _ in range(24)]
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)

            def run(prompt, n):
                ids, last = [], None
                for chunk in stub.Generate(request(prompt, n, temperature=0.8), timeout=120):
                    ids += chunk.token_ids
                    last = chunk
                return ids, last

            with cf.ThreadPoolExecutor(len(reqs)) as pool:
                results = list(pool.map(lambda r: run(*r), reqs))
            for (prompt, n), (ids, last) in zip(reqs, results):
                assert ids == expected_tokens(prompt, n, VOCAB, eos)
                assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
                assert last.usage.completion_tokens == n and last.usage.prompt_tokens == len(prompt)
            stats = stub.GetStats(generate_pb2.StatsRequest(), timeout=10)
            assert stats.num_preemptions > 0, "the KV cache was meant to run out"
            assert wait_until(lambda: stub.GetStats(generate_pb2.StatsRequest()).num_free_kv_blocks
                              == stats.num_kv_blocks, timeout=10)
    finally:
        sched.stop()
        worker.stop()


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_keeps_two_steps_in_flight(model_dir, overlap):
    """With overlap the next step reaches the worker while the previous one still runs
    (almost every step); without it, never."""
    worker = start_null_worker(model_dir, step_ms=5)
    sched = start_scheduler(model_dir, [worker.port], block_size=16,
                            extra=[] if overlap else ["--no-overlap"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            with cf.ThreadPoolExecutor(4) as pool:
                done = list(pool.map(lambda i: stub.Complete(request([i + 1] * 20, 100), timeout=60),
                                     range(4)))
        assert all(len(r.token_ids) == 100 for r in done)
        h = worker_health(worker.port)
        assert h.steps >= 100
        if overlap:
            assert h.steps_overlapped >= 0.9 * h.steps, (h.steps_overlapped, h.steps)
        else:
            assert h.steps_overlapped == 0, (h.steps_overlapped, h.steps)
    finally:
        sched.stop()
        worker.stop()


@pytest.fixture()
def stack(model_dir):
    worker = start_null_worker(model_dir, step_ms=2)
    sched = start_scheduler(model_dir, [worker.port], block_size=16,
                            extra=["--log-level", "INFO"])
    yield worker, sched
    sched.stop()
    worker.stop()


class Stream:
    """A Generate call drained on a thread; keeps ids and the error, if any."""

    def __init__(self, stub, prompt, n):
        self.ids: list[int] = []
        self.error: grpc.RpcError | None = None
        self.call = stub.Generate(request(prompt, n), timeout=60)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for chunk in self.call:
                self.ids += chunk.token_ids
        except grpc.RpcError as e:
            self.error = e


def test_engine_core_killed_streams_in_flight_resume_and_finish_exact(stack, eos):
    """The frontends keep every request's prompt, sampling and tokens; once the restarted
    core answers they add the unfinished ones again and decoding goes on: no error, no
    token lost or repeated (the null worker's ids follow from the last token and its
    position, so a stream resumed anywhere else would show). n = 2 siblings resume too."""
    worker, sched = stack
    core = named_children(sched.popen.pid)["ns-engine-core"]
    with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        prompts = [[1, 2, 3], [40, 41], [7], [300, 301, 302, 303]]
        streams = [Stream(stub, p, 400) for p in prompts]
        pair = stub.Generate(request([55, 56], 300, n=2), timeout=60)
        pair_ids: dict[int, list[int]] = {0: [], 1: []}
        pair_thread = threading.Thread(target=lambda: [pair_ids[m.index].extend(m.token_ids)
                                                        for m in pair], daemon=True)
        pair_thread.start()
        assert wait_until(lambda: all(len(s.ids) > 5 for s in streams), timeout=20)
        before = len(streams[0].ids)
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        assert wait_until(lambda: len(streams[0].ids) > before + 1, timeout=30), sched.output()
        print(f"engine core SIGKILL -> next token: {time.monotonic() - killed:.2f}s")
        for s, p in zip(streams, prompts):
            s.thread.join(30)
            assert s.error is None, s.error
            assert s.ids == expected_tokens(p, 400, VOCAB, eos)
        pair_thread.join(30)
        assert pair_ids[0] == pair_ids[1] == expected_tokens([55, 56], 300, VOCAB, eos)
        # A new core, and it serves new requests too.
        assert named_children(sched.popen.pid).get("ns-engine-core") not in (None, core)
        out = stub.Complete(request([7, 8], 20), timeout=30)
        assert list(out.token_ids) == expected_tokens([7, 8], 20, VOCAB, eos)
        stats = stub.GetStats(generate_pb2.StatsRequest(), timeout=10)
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert "engine core exited" in sched.output()


def test_frontend_killed_is_restarted_on_the_same_port_and_its_requests_aborted(stack, eos):
    worker, sched = stack
    frontend = named_children(sched.popen.pid)["ns-frontend-0"]
    with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
        stream = Stream(generate_pb2_grpc.GenerationStub(ch), [4, 5], 450)
        assert wait_until(lambda: len(stream.ids) > 5, timeout=20)
        os.kill(frontend, signal.SIGKILL)
        stream.thread.join(10)
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
    # Aborted as soon as the supervisor saw it die, not when a new frontend says HELLO.
    assert wait_until(lambda: "frontend 0 died: aborted its 1 requests" in sched.output(),
                      timeout=10), sched.output()
    assert wait_until(lambda: named_children(sched.popen.pid).get("ns-frontend-0") not in
                      (None, frontend), timeout=30), sched.output()
    with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        grpc.channel_ready_future(ch).result(timeout=30)
        out = stub.Complete(request([9], 10), timeout=30)
        assert list(out.token_ids) == expected_tokens([9], 10, VOCAB, eos)
        # The dead frontend's stream was aborted in the core: nothing left running.
        assert wait_until(lambda: stub.GetStats(generate_pb2.StatsRequest()).num_running == 0,
                          timeout=10)
        stats = stub.GetStats(generate_pb2.StatsRequest())
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_core_dying_while_a_frontend_restarts_is_restarted_at_once(stack, eos):
    """A frontend is ready only once the engine core answers it; if the core dies while a
    frontend restarts, the supervisor must restart the core now, not after the frontend's
    60 s connect timeout (the chaos test's minute without tokens). The core is stopped
    (SIGSTOP) so the new frontend is surely waiting on it, then killed."""
    worker, sched = stack
    kids = named_children(sched.popen.pid)
    core, frontend = kids["ns-engine-core"], kids["ns-frontend-0"]
    os.kill(core, signal.SIGSTOP)
    try:
        os.kill(frontend, signal.SIGKILL)
        assert wait_until(lambda: named_children(sched.popen.pid).get("ns-frontend-0") not in
                          (None, frontend), timeout=30), sched.output()
        time.sleep(1.0)   # the new frontend now waits for the stopped core's answer
    finally:
        os.kill(core, signal.SIGKILL)
    killed = time.monotonic()

    def serves() -> bool:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
                out = generate_pb2_grpc.GenerationStub(ch).Complete(request([9], 10), timeout=5)
            return list(out.token_ids) == expected_tokens([9], 10, VOCAB, eos)
        except grpc.RpcError:
            return False
    assert wait_until(serves, timeout=30), sched.output()
    print(f"engine core SIGKILL during a frontend restart -> serving: "
          f"{time.monotonic() - killed:.1f}s")
    assert "the engine core died while it started" in sched.output()


def test_sigterm_stops_every_process_and_sigkill_leaves_no_orphans(model_dir):
    worker = start_null_worker(model_dir, step_ms=1)
    try:
        for sig, expected in ((signal.SIGTERM, 0), (signal.SIGKILL, -signal.SIGKILL)):
            before = set(Path(tempfile.gettempdir()).glob("nanoserve-*"))
            sched = start_scheduler(model_dir, [worker.port], block_size=16)
            kids = named_children(sched.popen.pid)
            assert {"ns-engine-core", "ns-frontend-0"} <= set(kids), kids
            # its IPC directory: the new one holding the engine's socket (other processes'
            # temporary directories, e.g. a null stack's model, may appear meanwhile)
            ipc_dirs = {d for d in set(Path(tempfile.gettempdir()).glob("nanoserve-*")) - before
                        if (d / "engine").exists()}
            assert len(ipc_dirs) == 1, ipc_dirs
            sched.popen.send_signal(sig)
            assert sched.wait_exit(timeout=20) == expected, sched.output()
            assert wait_until(lambda: not any(alive(p) for p in kids.values()), timeout=15), kids
            if sig == signal.SIGTERM:
                assert not next(iter(ipc_dirs)).exists()
    finally:
        worker.stop()


def established(pid: int, port: int) -> int:
    """TCP connections to local `port` whose socket is open in process pid."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].split(":")[1], 16) == port and f[3] == "01" and f[9] in inodes:
                count += 1
    return count


def test_two_frontends_share_one_port(model_dir, eos):
    worker = start_null_worker(model_dir, step_ms=1)
    sched = start_scheduler(model_dir, [worker.port], block_size=16, extra=["--frontends", "2"])
    channels = []
    try:
        kids = named_children(sched.popen.pid)
        assert {"ns-frontend-0", "ns-frontend-1"} <= set(kids)
        # Separate connections (grpc would otherwise share one between identical channels).
        channels = [grpc.insecure_channel(f"127.0.0.1:{sched.port}",
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(16)]
        for i, ch in enumerate(channels):
            out = generate_pb2_grpc.GenerationStub(ch).Complete(request([i + 1], 8), timeout=30)
            assert list(out.token_ids) == expected_tokens([i + 1], 8, VOCAB, eos)
        per_frontend = [established(kids[f"ns-frontend-{i}"], sched.port) for i in range(2)]
        assert sum(per_frontend) == 16 and min(per_frontend) > 0, per_frontend
    finally:
        for ch in channels:
            ch.close()
        sched.stop()
        worker.stop()


def test_frontends_start_beside_the_core_and_serve_once_the_worker_is_up(model_dir, eos):
    """The frontends do their imports and load the tokenizer while the core waits for the
    workers (a model's load: seconds to minutes), so the port serves as soon as the core
    has the workers, not a frontend's start-up (~1 s each) later. Before the worker is up
    they are running, the port is closed; once it is, a request completes."""
    from services import Proc, free_port
    worker_port, port = free_port(), free_port()
    sched = Proc("scheduler", ["scheduler_service", "--model", str(model_dir), "--workers",
                               f"127.0.0.1:{worker_port}", "--port", str(port), "--frontends",
                               "2", "--block-size", "16", "--log-level", "WARNING"]).launch()
    worker = None
    try:
        assert wait_until(lambda: {"ns-engine-core", "ns-frontend-0", "ns-frontend-1"}
                          <= set(named_children(sched.popen.pid)), timeout=60)
        time.sleep(1.0)   # well past a frontend's start-up: still waiting for the core
        assert not sched.port and sched.popen.poll() is None
        worker = start_null_worker(model_dir, step_ms=1, port=worker_port)
        sched.wait_listening(60)
        assert sched.port == port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            out = generate_pb2_grpc.GenerationStub(ch).Complete(request([5, 6], 8), timeout=30)
        assert list(out.token_ids) == expected_tokens([5, 6], 8, VOCAB, eos)
    finally:
        sched.stop()
        if worker is not None:
            worker.stop()


@pytest.mark.parametrize("cpus, given, expected", [(2, None, 1), (8, None, 2), (64, None, 2),
                                                   (2, "3", 3), (64, "1", 1)])
def test_frontends_default_to_two_on_hosts_with_cores(monkeypatch, tmp_path, cpus, given, expected):
    """--frontends 0 (the default): a second frontend only where cores allow it."""
    from scheduler_service.__main__ import parse_args
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    argv = ["--model", str(tmp_path), "--workers", "127.0.0.1:1"]
    assert parse_args(argv + (["--frontends", given] if given else [])).frontends == expected
    with pytest.raises(SystemExit):
        parse_args(argv + ["--frontends", "-1"])


def test_worker_refusing_a_step_fails_it_and_a_reset_stream_is_a_lost_worker():
    """The worker's own errors carry "step N: ..." (INVALID_ARGUMENT, INTERNAL): its
    requests fail. gRPC's INTERNAL from a stream reset when the worker died mid-answer
    (the chaos test met "Internal error from Core") is a lost worker: re-prefill."""
    from scheduler_service.worker_client import step_refused
    code = grpc.StatusCode
    assert step_refused(code.INVALID_ARGUMENT, "step 3: token id out of range")
    assert step_refused(code.INTERNAL, "step 7: RuntimeError: CUDA error")
    assert not step_refused(code.INTERNAL, "Internal error from Core")
    assert not step_refused(code.INTERNAL, "Received RST_STREAM with error code 2")
    assert not step_refused(code.UNAVAILABLE, "Socket closed")


def test_a_worker_that_is_down_is_retried_about_four_times_a_second():
    """The scheduler keeps asking a worker that does not answer (still loading, restarting)
    at most ~0.25 s apart (worker_client.RECONNECT_BACKOFF_MS), so a worker back after a
    long reload is picked up within a fraction of a second. A listener that drops every
    connection counts the tries: gRPC's default backoff (1 s, then x1.6, up to 2 minutes)
    makes 3 in 4 s, a 1 s cap 6 or 7, this 10 or more."""
    import asyncio
    import socket

    from nanoserve.worker_group import WorkerGroupError
    from scheduler_service.worker_client import WorkerGroup

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    tries, stop = [], threading.Event()

    def drop_all() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            tries.append(time.monotonic())
            conn.close()

    threading.Thread(target=drop_all, daemon=True).start()

    async def connect() -> None:
        group = WorkerGroup([f"127.0.0.1:{listener.getsockname()[1]}"], connect_timeout=4.0)
        try:
            with pytest.raises(WorkerGroupError):
                await group.connect(block_size=8)
        finally:
            await group.close()

    try:
        asyncio.run(connect())
    finally:
        stop.set()
        listener.close()
    assert len(tries) >= 10, f"{len(tries)} connection attempts in 4 s"
    assert max(b - a for a, b in zip(tries, tries[1:])) < 0.6
