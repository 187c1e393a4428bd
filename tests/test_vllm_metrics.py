"""The load signals routers read from vLLM (the Gateway API Inference Extension's endpoint
picker: queue depth, KV utilisation, LoRA affinity), served by the real control plane
under vLLM's names beside nanoserve's own."""
from __future__ import annotations

import threading

import pytest

from client.client import Client, SamplingParams
from client.null_model import write_null_model
from services import free_port, start_null_worker, start_scheduler
from test_metrics import scrape, scrape_until, value

pytestmark = pytest.mark.slow


def test_vllm_named_load_metrics(tmp_path):
    model = write_null_model(tmp_path / "served-model", vocab_size=1000)
    worker = start_null_worker(model, step_ms=20)
    port = free_port()
    sched = start_scheduler(model, [worker.port], block_size=4,
                            extra=["--metrics-port", str(port), "--max-num-seqs", "2"])
    try:
        with Client(f"127.0.0.1:{sched.port}", timeout=120) as c:
            params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            threads = [threading.Thread(target=c.complete, args=(list(range(i, i + 20)), params))
                       for i in range(5)]
            for t in threads:
                t.start()
            label = {"model_name": "served-model"}
            # one sync sets the gauges one after another: wait for a scrape that saw all
            # of them (a CI run once read running 2 beside a cache usage of 0)
            m = scrape_until(port, lambda m: value(m, "vllm:num_requests_waiting", **label) >= 1
                             and value(m, "vllm:gpu_cache_usage_perc", **label) > 0)
            assert value(m, "vllm:num_requests_waiting", **label) >= 1   # 5 sent, 2 run at once
            assert value(m, "vllm:num_requests_running", **label) == 2
            assert 0 < value(m, "vllm:gpu_cache_usage_perc", **label) <= 1
            assert value(m, "vllm:kv_cache_usage_perc", **label) == \
                value(m, "vllm:gpu_cache_usage_perc", **label)
            (info,) = [k for k in m if k[0] == "vllm:lora_requests_info"]
            assert dict(info[1]) == {"max_lora": "0", "running_lora_adapters": "",
                                     "waiting_lora_adapters": ""}
            for t in threads:
                t.join()
            m = scrape_until(port, lambda m: value(m, "vllm:num_requests_running", **label) == 0)
            assert value(m, "vllm:num_requests_waiting", **label) == 0
            assert value(m, "vllm:kv_cache_usage_perc", **label) == 0
            assert value(m, "nanoserve_sequences_running") == 0   # its own names stay
    finally:
        sched.stop()
        worker.stop()


def test_lora_info_names_adapters():
    """The picker's LoRA affinity reads adapter names off the labels."""
    from types import SimpleNamespace as NS

    from prometheus_client import generate_latest

    from scheduler_service.block_manager import BlockManager
    from scheduler_service.metrics import EngineCoreMetrics

    def seq(a):
        return NS(sampling=NS(adapter_id=a))
    sched = NS(waiting=[seq(2), seq(0)], running=[seq(1), seq(2), seq(1)])
    EngineCoreMetrics("m").sync_vllm(sched, BlockManager(4, 4), 4, {1: "sql", 2: "chat"})
    text = generate_latest().decode()
    assert ('vllm:lora_requests_info{max_lora="4",running_lora_adapters="chat,sql",'
            'waiting_lora_adapters="chat"}') in text
    assert 'vllm:num_requests_running{model_name="m"} 3.0' in text
