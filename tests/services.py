"""Start the real services as separate processes on 127.0.0.1 for end-to-end tests."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from client.ports import free_port  # noqa: F401 - tests import it from here
from client.proc_cpu import children, comm  # noqa: F401 - children: tests import it from here

ROOT = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"listening on [\w.:]+:(\d+)")
_HTTP = re.compile(r"OpenAI HTTP API on [\w.:]+:(\d+)")
_LAUNCHED: list["Proc"] = []   # every process a test started: stop_all() at session end


@dataclass
class Proc:
    name: str
    args: list[str]
    popen: subprocess.Popen | None = None
    port: int = 0
    http_port: int = 0     # the scheduler's OpenAI HTTP API, when it serves one
    log: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)   # on top of os.environ
    _found: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self, timeout: float = 120.0) -> "Proc":
        return self.launch().wait_listening(timeout)

    def launch(self) -> "Proc":
        """Start the process without waiting: TP ranks only listen once all have started."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.popen = subprocess.Popen([sys.executable, "-m", *self.args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _LAUNCHED.append(self)
        found = self._found = threading.Event()

        def pump():
            for line in self.popen.stdout:
                self.log.append(line)
                m = _LISTEN.search(line)
                if m and not found.is_set():
                    if h := _HTTP.search(line):
                        self.http_port = int(h.group(1))
                    self.port = int(m.group(1))
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        return self

    def wait_listening(self, timeout: float = 120.0) -> "Proc":
        """Block until the process prints its port; RuntimeError with its output if it dies."""
        if not self._found.wait(timeout) or not self.port:
            self.stop()
            raise RuntimeError(f"{self.name} did not start:\n{self.output()}")
        return self

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status, or None if still running after timeout."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def output(self, last: int | None = 80) -> str:
        """The last `last` lines printed (None: all of them)."""
        return "".join(self.log if last is None else self.log[-last:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return None if self.popen is None else self.popen.returncode
        self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


def stop_all() -> list[str]:
    """Stop every process a test started and left running (a test that failed before its
    own cleanup); returns their names."""
    left = [p for p in _LAUNCHED if p.popen is not None and p.popen.poll() is None]
    for p in left:
        p.stop(timeout=5.0)
    return [p.name for p in left]


def worker_proc(model_dir: Path, port: int = 0, kv_cache_gb: float = 0.05, extra: list[str] = (),
                *, rank: int = 0, world_size: int = 1, dist_init: str | None = None,
                env: dict[str, str] | None = None) -> Proc:
    """A worker Proc, not started yet (see start_worker / start_tp_workers)."""
    args = ["worker_service", "--model", str(model_dir), "--device", "cpu", "--port", str(port),
            "--kv-cache-gb", str(kv_cache_gb), "--log-level", "WARNING"]
    if world_size > 1 or rank:
        args += ["--rank", str(rank), "--world-size", str(world_size)]
    if dist_init:
        args += ["--dist-init", dist_init]
    return Proc(f"worker rank {rank}/{world_size}", [*args, *extra], env=dict(env or {}))


def start_worker(model_dir: Path, port: int = 0, kv_cache_gb: float = 0.05,
                 extra: list[str] = (), **tp) -> Proc:
    """One worker (world size 1 unless given rank/world_size/dist_init), started."""
    return worker_proc(model_dir, port, kv_cache_gb, extra, **tp).start()


def start_tp_workers(model_dir: Path, world_size: int, ports: list[int] | None = None,
                     dist_port: int | None = None, kv_cache_gb: float | list[float] = 0.05,
                     extra: list[str] = (), threads_per_rank: int = 1,
                     timeout: float = 120.0) -> list[Proc]:
    """All ranks of one TP group, launched together (each listens only once all have met).

    kv_cache_gb may differ per rank (a list). One intra-op thread per rank by default: CI
    machines have few cores, and oversubscribed ranks crawl at every collective."""
    dist_init = f"tcp://127.0.0.1:{dist_port or free_port()}"
    ports = ports or [0] * world_size
    kv = kv_cache_gb if isinstance(kv_cache_gb, list) else [kv_cache_gb] * world_size
    procs = [worker_proc(model_dir, ports[r], kv[r], extra, rank=r, world_size=world_size,
                         dist_init=dist_init, env={"OMP_NUM_THREADS": str(threads_per_rank)}).launch()
             for r in range(world_size)]
    try:
        for p in procs:
            p.wait_listening(timeout)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def start_null_worker(model_dir: Path | None = None, step_ms: float = 0.0, port: int = 0,
                      extra: list[str] = ()) -> Proc:
    """A worker that computes nothing (worker_service/null_worker.py), started."""
    args = ["worker_service", "--null", "--step-ms", str(step_ms), "--port", str(port),
            "--log-level", "WARNING"]
    if model_dir is not None:
        args += ["--model", str(model_dir)]
    return Proc("null worker", [*args, *extra]).start()


def named_children(pid: int) -> dict[str, int]:
    """Child processes of pid by name (the control plane names its own: ns-engine-core,
    ns-frontend-N)."""
    return {name: c for c in children(pid) if (name := comm(c))}


def rss_bytes(pid: int) -> int:
    """Resident set size of pid (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS for {pid}")


def alive(pid: int) -> bool:
    """pid exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def start_scheduler(model_dir: Path, worker_ports: list[int], block_size: int = 8,
                    extra: list[str] = ()) -> Proc:
    workers = ",".join(f"127.0.0.1:{p}" for p in worker_ports)
    return Proc("scheduler", ["scheduler_service", "--model", str(model_dir), "--workers", workers,
                              "--port", "0", "--block-size", str(block_size),
                              "--log-level", "WARNING", *extra]).start()


@contextlib.contextmanager
def served(model_dir: Path, workers: list[Proc], block_size: int = 8, extra: list[str] = ()):
    """A scheduler on loopback in front of `workers` (started; the list may be changed on
    the way, e.g. a worker restarted) for the duration: the Generation stub. Every process
    is stopped at the end."""
    import grpc
    from nanoserve.v1 import generate_pb2_grpc
    sched = None
    try:
        sched = start_scheduler(model_dir, [w.port for w in workers], block_size=block_size,
                                extra=extra)
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as channel:
            yield generate_pb2_grpc.GenerationStub(channel)
    finally:
        if sched:
            sched.stop()
        for w in workers:
            w.stop()


@contextlib.contextmanager
def generation_stub(model_dir: Path, block_size: int = 8, extra: list[str] = (),
                    worker_extra: list[str] = ()):
    """A real worker and scheduler on loopback for the duration: the Generation stub."""
    with served(model_dir, [start_worker(model_dir, extra=worker_extra)], block_size,
                extra) as stub:
        yield stub


# What the scheduler logs when kill() took each victim down.
KILLED_LOG = {"worker": "worker group failed", "engine-core": "engine core exited"}


def kill(victim: str, sched: Proc, worker: Proc, model_dir: Path) -> Proc:
    """SIGKILL mid-traffic: the worker (a new one starts on its port, as a supervisor would
    start it) or the scheduler's engine core (its supervisor restarts it). Returns the
    worker to stop at the end."""
    if victim == "worker":
        port = worker.port
        worker.stop(sig=9)
        return start_worker(model_dir, port=port)
    os.kill(named_children(sched.popen.pid)["ns-engine-core"], signal.SIGKILL)
    return worker


def engine_idle(stub) -> bool:
    """A scheduler's GenerationStub reports nothing running or waiting and every KV block
    free: what every test that ends traffic waits for."""
    from nanoserve.v1 import generate_pb2
    s = stub.GetStats(generate_pb2.StatsRequest(), timeout=10)
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_kv_blocks == s.num_kv_blocks


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
