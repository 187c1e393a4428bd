"""--profile-steps A:B: a torch profiler trace of the worker's own Step stream, as the
deployed path runs it (vLLM's VLLM_TORCH_PROFILER_DIR, SGLang's /start_profile).

Why: a served step costs its kernels plus whatever the device waits for between them
(the host's launches, copies, the next step's arrival). Only a trace of the served steps
tells these apart: at batch 1 a Qwen3-0.6B step's event window is ~0.25 ms longer than
its graph replayed alone (tests/gpu/RESULTS.md), in process and through gRPC alike.

Steps are counted from the worker's start (each step of a grouped Step message counts).
The profiler starts as step A is launched and stops once step B's device work is done
(one host sync, then the stream resumes); the trace goes to
DIR/worker-rank{R}-steps-{A}-{B}.json (chrome://tracing, Perfetto) and one log line
says how the span of those steps divides: kernels, copies, and the device idle.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger("nanoserve.worker")


@dataclass
class DeviceSpan:
    """What the device did over the profiled steps, in microseconds."""
    steps: int
    span_us: float = 0.0       # first device event's start -> last one's end
    kernel_us: float = 0.0     # kernels, overlaps merged
    copy_us: float = 0.0       # memcpy / memset, overlaps merged
    kernels: int = 0
    host_us: float = 0.0       # wall time from step A's launch to step B's end

    @property
    def idle_us(self) -> float:
        return max(self.span_us - self.kernel_us - self.copy_us, 0.0)

    def line(self) -> str:
        n = max(self.steps, 1)
        idle = 100.0 * self.idle_us / self.span_us if self.span_us else 0.0
        return (f"{self.steps} steps: wall {self.host_us / n / 1e3:.3f} ms a step, device span "
                f"{self.span_us / n / 1e3:.3f}; kernels {self.kernel_us / n / 1e3:.3f} ms "
                f"({self.kernels / n:.0f} a step), copies {self.copy_us / n / 1e3:.3f}, "
                f"device idle {idle:.1f}% of the span")


def device_span(events, steps: int) -> DeviceSpan:
    """Merge the device-side events' intervals (a kernel inside a copy's interval, or two
    streams' overlapping work, counts once)."""
    out = DeviceSpan(steps)
    spans: dict[str, list[tuple[float, float]]] = {"kernel": [], "copy": []}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = "copy" if e.name.startswith(("Memcpy", "Memset")) else "kernel"
        spans[kind].append((e.time_range.start, e.time_range.end))
    every = spans["kernel"] + spans["copy"]
    if not every:
        return out
    out.span_us = max(b for _, b in every) - min(a for a, _ in every)
    out.kernels = len(spans["kernel"])
    out.kernel_us = _union(spans["kernel"])
    out.copy_us = max(_union(every) - out.kernel_us, 0.0)
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass
class StepProfile:
    """Starts and stops the profiler around steps first..last of the launch thread."""
    first: int
    last: int
    out_dir: str
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _prof: torch.profiler.profile | None = None
    _t0: float = 0.0

    def before(self, step: int) -> None:
        """Called as step number `step` is about to launch."""
        if step != self.first or self._prof is not None:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def after(self, step: int) -> None:
        """Called once step number `step` is launched: at `last`, wait for it and write."""
        if step != self.last or self._prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        host_us = (time.perf_counter() - self._t0) * 1e6
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir,
                            f"worker-rank{self.rank}-steps-{self.first}-{self.last}.json")
        prof.export_chrome_trace(path)
        span = device_span(prof.events(), self.last - self.first + 1)
        span.host_us = host_us
        log.info("profiled steps %d-%d (%s): %s", self.first, self.last, path, span.line())
