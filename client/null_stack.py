"""A null worker and the real control plane as local processes, for control-plane benchmarks.

`with NullStack(step_ms=7) as s: ...` writes a null model directory (client/null_model.py),
starts `python -m worker_service --null` and `python -m scheduler_service` on free
loopback ports, and stops both on exit. No torch, no GPU: what it measures is the
scheduler's cost alone, on whatever machine runs it.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from client.null_model import write_null_model
from client.proc_cpu import tree_cpu_s

_LISTEN = re.compile(r"listening on [\w.:]+:(\d+)")


class NullStack:
    def __init__(self, step_ms: float = 7.0, max_model_len: int = 4096,
                 scheduler_args: list[str] = (), timeout: float = 120.0,
                 tokenizer_dir: str | None = None, worker_args: list[str] = ()):
        self.tokenizer_dir = tokenizer_dir
        self.worker_args = list(worker_args)   # e.g. --task embed
        self.step_ms = step_ms
        self.max_model_len = max_model_len
        self.scheduler_args = list(scheduler_args)
        self.timeout = timeout
        self.procs: list[subprocess.Popen] = []
        self.logs: list[list[str]] = []
        self.target = ""

    def __enter__(self) -> "NullStack":
        self._tmp = tempfile.TemporaryDirectory(prefix="nanoserve-null-model-")
        model = str(write_null_model(Path(self._tmp.name), tokenizer_dir=self.tokenizer_dir))
        try:
            worker = self._start([
                "worker_service", "--null", "--model", model, "--step-ms", str(self.step_ms),
                "--port", "0", "--log-level", "WARNING", *self.worker_args])
            port = self._start([
                "scheduler_service", "--model", model, "--workers", f"127.0.0.1:{worker}",
                "--port", "0", "--max-model-len", str(self.max_model_len),
                "--log-level", "WARNING", *self.scheduler_args])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.target = f"127.0.0.1:{port}"
        return self

    def _start(self, args: list[str]) -> int:
        """Start `python -m ARGS`; its port once it prints 'listening on ...:PORT'."""
        proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        log: list[str] = []
        self.logs.append(log)
        found = threading.Event()
        port = []

        def pump() -> None:
            for line in proc.stdout:
                log.append(line)
                m = _LISTEN.search(line)
                if m and not found.is_set():
                    port.append(int(m.group(1)))
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(self.timeout) or not port:
            raise RuntimeError(f"{args[0]} did not start:\n{''.join(log[-40:])}")
        return port[0]

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of the null worker and of each control-plane process
        (engine-core, frontend-N; "scheduler" is its supervisor and helpers)."""
        worker, scheduler = self.procs
        return tree_cpu_s({"null worker": worker.pid, "scheduler": scheduler.pid})

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):   # scheduler first, then the worker
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._tmp.cleanup()
