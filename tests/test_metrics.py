"""Prometheus metrics scraped over HTTP from the real servers during and after a run.

The control plane (null worker, two frontends: the supervisor's /metrics must sum the
frontends' and the engine core's processes) and a tiny torch worker; every value is
checked against what the test itself sent or against the servers' own GetStats/Health.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.null_model import write_null_model
from nanoserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from services import free_port, start_null_worker, start_scheduler, start_worker
from worker_service.null_worker import expected_tokens
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
N_REQUESTS, MAX_TOKENS, BLOCK = 12, 40, 16


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from http://127.0.0.1:port/metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_until(port: int, predicate, timeout: float = 10.0) -> dict:
    """Scrape until predicate(samples) holds (the engine core syncs twice a second)."""
    deadline = time.monotonic() + timeout
    while not predicate(m := scrape(port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return m


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def eos_id(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["eos_token_id"]


def request(prompt: list[int], max_tokens: int = MAX_TOKENS) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_control_plane_metrics_over_http(tmp_path):
    model_dir = write_null_model(tmp_path / "null_model", vocab_size=1000,
                                 max_position_embeddings=512)
    worker = start_null_worker(model_dir, step_ms=20)
    metrics_port = free_port()
    sched = start_scheduler(model_dir, [worker.port], block_size=BLOCK,
                            extra=["--metrics-port", str(metrics_port), "--frontends", "2"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            shared = list(range(1, 3 * BLOCK + 1))   # 3 full blocks: prefix-cache hits
            with_prediction = request(shared + [7], 4)   # its answer: one verify step
            with_prediction.sampling.prediction.token_ids.ids.extend(
                expected_tokens(shared + [7], 4, 1000, eos_id(model_dir)))
            first = list(stub.Generate(with_prediction, timeout=60))[-1]
            assert first.usage.accepted_prediction_tokens == 2   # + the bonus token: 4
            prompts = [shared + [100 + i] * (i + 1) for i in range(N_REQUESTS)]
            started = threading.Event()

            def run(prompt):
                last = None
                for i, chunk in enumerate(stub.Generate(request(prompt), timeout=120)):
                    last = chunk
                    if i == 2:
                        started.set()
                return last

            with cf.ThreadPoolExecutor(N_REQUESTS) as pool:
                results = [pool.submit(run, p) for p in prompts]
                assert started.wait(60)
                m = scrape_until(metrics_port, lambda m: value(m, "nanoserve_kv_blocks_used") > 0)
                lasts = [f.result() for f in results]
            assert value(m, "nanoserve_kv_blocks_used") > 0, "KV blocks in use during the run"
            assert value(m, "nanoserve_sequences_running") + value(m, "nanoserve_sequences_waiting") > 0
            with pytest.raises(grpc.RpcError) as bad:
                stub.Complete(request([]), timeout=10)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            stats = stub.GetStats(generate_pb2.StatsRequest(), timeout=10)   # idle from now on
            m = scrape_until(metrics_port, lambda m: value(m, "nanoserve_decode_steps_total")
                             == stats.num_decode_steps)
        n = N_REQUESTS + 1
        assert value(m, "nanoserve_requests_total", finish_reason="length", code="OK") == n
        assert value(m, "nanoserve_requests_total", finish_reason="error",
                     code="INVALID_ARGUMENT") == 1
        for hist in ("nanoserve_time_to_first_token_seconds", "nanoserve_request_duration_seconds",
                     "nanoserve_inter_token_latency_seconds", "nanoserve_request_queue_time_seconds"):
            assert value(m, hist + "_count") == n, hist
            assert value(m, hist + "_bucket", le="+Inf") == n, hist
        # 20 ms steps: no token gap, no request shorter than the emulated device time
        assert value(m, "nanoserve_inter_token_latency_seconds_sum") / n >= 0.015
        assert value(m, "nanoserve_request_duration_seconds_sum") >= \
            value(m, "nanoserve_time_to_first_token_seconds_sum")
        assert value(m, "nanoserve_generation_tokens_total") == 4 + N_REQUESTS * MAX_TOKENS
        assert value(m, "nanoserve_prompt_tokens_total") == len(shared) + 1 + sum(map(len, prompts))
        cached = first.usage.cached_tokens + sum(l.usage.cached_tokens for l in lasts)
        assert cached >= N_REQUESTS * 3 * BLOCK - 3 * BLOCK   # all but the racing first few hit
        assert value(m, "nanoserve_prefix_cache_hit_tokens_total") == cached
        assert value(m, "nanoserve_kv_blocks_total") == stats.num_kv_blocks > 0
        assert value(m, "nanoserve_kv_blocks_used") == 0
        assert value(m, "nanoserve_sequences_running") == value(m, "nanoserve_sequences_waiting") == 0
        assert value(m, "nanoserve_workers_healthy") == 1
        assert value(m, "nanoserve_preemptions_total") == stats.num_preemptions
        assert value(m, "nanoserve_decode_steps_total") == stats.num_decode_steps > 0
        assert value(m, "nanoserve_spec_accepted_tokens_total") == stats.num_spec_accepted_tokens \
            == 2 <= value(m, "nanoserve_spec_proposed_tokens_total") == stats.num_spec_proposed_tokens
        assert value(m, "nanoserve_spec_verify_steps_total") == stats.num_verify_steps > 0
        assert value(m, "nanoserve_spec_accepted_per_verify_count") == stats.num_spec_runs
        assert value(m, "nanoserve_spec_accepted_per_verify_sum") == 2
        assert value(m, "nanoserve_decode_step_seconds_total", phase="gpu") == pytest.approx(
            stats.decode_gpu_ms / 1e3, rel=1e-6)
        assert value(m, "nanoserve_decode_step_seconds_total", phase="wall") >= \
            value(m, "nanoserve_decode_step_seconds_total", phase="gpu") * 0.9
    finally:
        sched.stop()
        worker.stop()


def test_worker_metrics_over_http(tmp_path_factory):
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, seed=31)
    metrics_port = free_port()
    worker = start_worker(model_dir, extra=["--metrics-port", str(metrics_port)])
    sched = start_scheduler(model_dir, [worker.port], block_size=8)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            with cf.ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: stub.Complete(request([5 + i] * 9, 12), timeout=120),
                              range(4)))
            blocks = stub.GetStats(generate_pb2.StatsRequest(), timeout=10).num_kv_blocks
        with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as wch:
            steps = worker_pb2_grpc.WorkerStub(wch).Health(worker_pb2.HealthRequest(), timeout=5).steps
        m = scrape(metrics_port)
        assert steps >= 12
        assert value(m, "nanoserve_worker_step_seconds_count", rank="0") == steps
        assert value(m, "nanoserve_worker_gpu_seconds_count", rank="0") == steps
        assert value(m, "nanoserve_worker_step_seconds_sum", rank="0") > 0
        assert value(m, "nanoserve_worker_kv_blocks", rank="0") == blocks > 0
        assert value(m, "nanoserve_worker_kv_capacity_tokens", rank="0") == blocks * 8
        assert value(m, "nanoserve_worker_step_failures_total", rank="0") == 0
    finally:
        sched.stop()
        worker.stop()


def test_grafana_dashboard_queries_only_metrics_that_exist():
    """scheduler_service/grafana_dashboard.json is valid JSON and each series it queries is one the
    servers export (a renamed metric would otherwise leave a silently empty panel)."""
    import json
    import re

    from prometheus_client import REGISTRY

    import scheduler_service.metrics  # noqa: F401 - registers the control plane's metrics
    import worker_service.metrics  # noqa: F401
    from services import ROOT
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    exported = {f.name + s for f in REGISTRY.collect() if f.name.startswith("nanoserve_")
                for s in suffixes[f.type]}
    dash = json.loads((ROOT / "scheduler_service" / "grafana_dashboard.json").read_text())
    used = {name for panel in dash["panels"] for t in panel["targets"]
            for name in re.findall(r"nanoserve_\w+", t["expr"])}
    assert used and used <= exported, sorted(used - exported)
