"""Start the real services as separate processes on 127.0.0.1 for end-to-end tests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"listening on [\w.:]+:(\d+)")


@dataclass
class Proc:
    name: str
    args: list[str]
    popen: subprocess.Popen | None = None
    port: int = 0
    log: list[str] = field(default_factory=list)

    def start(self, timeout: float = 120.0) -> "Proc":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen([sys.executable, "-m", *self.args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = threading.Event()

        def pump():
            for line in self.popen.stdout:
                self.log.append(line)
                m = _LISTEN.search(line)
                if m and not found.is_set():
                    self.port = int(m.group(1))
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(timeout) or not self.port:
            self.stop()
            raise RuntimeError(f"{self.name} did not start:\n{self.output()}")
        return self

    def output(self) -> str:
        return "".join(self.log[-80:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return None if self.popen is None else self.popen.returncode
        self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


def start_worker(model_dir: Path, port: int = 0, kv_cache_gb: float = 0.05,
                 extra: list[str] = ()) -> Proc:
    return Proc("worker", ["worker_service", "--model", str(model_dir), "--device", "cpu",
                           "--port", str(port), "--kv-cache-gb", str(kv_cache_gb),
                           "--log-level", "WARNING", *extra]).start()


def start_scheduler(model_dir: Path, worker_ports: list[int], block_size: int = 8,
                    extra: list[str] = ()) -> Proc:
    workers = ",".join(f"127.0.0.1:{p}" for p in worker_ports)
    return Proc("scheduler", ["scheduler_service", "--model", str(model_dir), "--workers", workers,
                              "--port", "0", "--block-size", str(block_size),
                              "--log-level", "WARNING", *extra]).start()


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
