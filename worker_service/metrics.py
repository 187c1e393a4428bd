"""Prometheus metrics of one worker process (one TP rank), on its own `--metrics-port`.

Recorded once per step (two histogram observes and nothing per token) and at Init; the
control plane has its own endpoint (scheduler_service/metrics.py). Every series carries
the rank, so one dashboard query covers a TP group.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

_STEP = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2,
         0.5, 1.0, 2.0, 5.0)

STEP_SECONDS = Histogram("nanoserve_worker_step_seconds",
                         "Step time on the worker: request taken up to answer ready",
                         ["rank"], buckets=_STEP)
GPU_SECONDS = Histogram("nanoserve_worker_gpu_seconds",
                        "Device time of a step (CUDA events; the emulated time on --null)",
                        ["rank"], buckets=_STEP)
STEP_FAILURES = Counter("nanoserve_worker_step_failures", "Steps answered with an error",
                        ["rank"])
KV_BLOCKS = Gauge("nanoserve_worker_kv_blocks", "KV cache blocks allocated by the last Init",
                  ["rank"])
HOST_KV_BYTES = Counter("nanoserve_worker_host_kv_bytes",
                        "KV bytes copied between the device and the host tier, by direction "
                        "(to_host: saved; to_device: restored for a prefix hit)",
                        ["rank", "direction"])
HOST_KV_SECONDS = Counter("nanoserve_worker_host_kv_copy_seconds",
                          "Time the host tier's copies took on the device's copy stream (both "
                          "directions; CUDA events, counted once they completed)", ["rank"])
KV_CAPACITY_TOKENS = Gauge("nanoserve_worker_kv_capacity_tokens",
                           "Tokens the allocated KV cache holds (blocks x block size)", ["rank"])


class WorkerMetrics:
    """The series of one rank, bound once so a step pays two observes."""

    def __init__(self, rank: int = 0):
        r = str(rank)
        self.step, self.gpu = STEP_SECONDS.labels(r), GPU_SECONDS.labels(r)
        self.failures = STEP_FAILURES.labels(r)
        self.kv_blocks, self.kv_tokens = KV_BLOCKS.labels(r), KV_CAPACITY_TOKENS.labels(r)
        self.to_host, self.to_device = (HOST_KV_BYTES.labels(r, d) for d in ("to_host", "to_device"))
        self.host_kv_seconds = HOST_KV_SECONDS.labels(r)

    def transferred(self, ops: bytes, block_bytes: int) -> None:
        """A step's host-tier copies (StepRequest.kv_transfers_i32: (kind, a, b) triples)."""
        kinds = ops[::12]   # each triple's first int32, little-endian: 0 or 1
        saved = kinds.count(0)
        self.to_host.inc(saved * block_bytes)
        self.to_device.inc((len(kinds) - saved) * block_bytes)

    def stepped(self, step_ms: float, gpu_ms: float) -> None:
        self.step.observe(step_ms / 1e3)
        self.gpu.observe(gpu_ms / 1e3)

    def initialized(self, num_blocks: int, block_size: int) -> None:
        self.kv_blocks.set(num_blocks)
        self.kv_tokens.set(num_blocks * block_size)


def serve(port: int, host: str) -> None:
    """/metrics on host:port, from a background thread."""
    start_http_server(port, addr=host)
