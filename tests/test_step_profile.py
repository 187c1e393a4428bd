"""The worker's --profile-steps: the device's time over the traced steps, the flag's checks,
and a real worker that traces steps of a served request and keeps serving."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from services import served, start_worker, wait_until
from test_e2e import generate
from tiny_checkpoint import tiny_qwen3_dir
from worker_service.__main__ import parse_args
from worker_service.step_profile import device_span

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


@dataclass
class Span:
    start: float
    end: float


@dataclass
class Event:
    name: str
    device_type: object
    time_range: Span


def test_device_span_merges_overlaps_and_splits_copies_from_kernels():
    events = [Event("gemv", CUDA, Span(0, 10)), Event("attn", CUDA, Span(5, 12)),   # overlap
              Event("Memcpy HtoD", CUDA, Span(20, 24)),
              Event("Memset", CUDA, Span(22, 23)),                                  # inside it
              Event("norm", CUDA, Span(30, 40)),
              Event("launch", CPU, Span(-50, 100))]                                 # host: not counted
    d = device_span(events, steps=2)
    assert d.span_us == 40 and d.kernels == 3
    assert d.kernel_us == 12 + 10 and d.copy_us == 4
    assert d.idle_us == 40 - 22 - 4
    d.host_us = 100.0
    line = d.line()
    assert "wall 0.050 ms a step" in line and "kernels 0.011 ms" in line, line
    assert "copies 0.002" in line and "device idle 35.0% of the span" in line, line


def test_device_span_of_no_device_events_is_empty():
    d = device_span([Event("launch", CPU, Span(0, 5))], steps=3)
    assert d.span_us == d.kernel_us == d.copy_us == d.idle_us == 0


@pytest.mark.parametrize("bad", ["3:2", "0:4", "4", "a:b"])
def test_profile_steps_flag_refuses_a_bad_range(bad, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--profile-steps", bad])
    assert "--profile-steps" in capsys.readouterr().err
    assert parse_args(["--model", "m", "--profile-steps", "2:9"]).profile_steps == (2, 9)


def test_null_worker_refuses_profile_steps():
    from worker_service.__main__ import main
    with pytest.raises(SystemExit, match="--null worker computes none"):
        main(["--null", "--profile-steps", "1:2"])


@pytest.mark.slow
def test_worker_traces_the_steps_asked_for_and_keeps_serving(tmp_path_factory, tmp_path):
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=3)
    out = tmp_path / "prof"
    worker = start_worker(model_dir, extra=["--profile-steps", "2:4", "--profile-dir", str(out),
                                            "--log-level", "INFO"])
    trace = out / "worker-rank0-steps-2-4.json"
    with served(model_dir, [worker]) as stub:
        ids, _ = generate(stub, [5, 6, 7, 8], 6, ignore_eos=True)
        assert len(ids) == 6
        assert wait_until(trace.exists, timeout=30), worker.output()
        assert wait_until(lambda: "profiled steps 2-4" in worker.output(None), timeout=10)
        line = next(x for x in worker.output(None).splitlines() if "profiled steps 2-4" in x)
        assert "3 steps: wall" in line and "device idle" in line, line
        assert json.loads(trace.read_text())["traceEvents"]
        again, _ = generate(stub, [5, 6, 7, 8], 6, ignore_eos=True)   # the stream resumed
        assert again == ids
