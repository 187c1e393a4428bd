"""`--kv-cache-dtype fp8` through the real services: the worker reports the fp8 cache and
about twice the blocks of the same memory, and greedy generation through the scheduler
equals Hugging Face's when HF's keys and values are rounded the same way."""
from __future__ import annotations

import grpc
import pytest
import torch
import transformers

from nanoserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from services import start_scheduler, start_worker
from test_e2e import hf_greedy
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
BLOCK = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=3)


def worker_info(port: int, block_size: int) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest(block_size=block_size),
                                                   timeout=30)


def test_fp8_worker_reports_twice_the_blocks(model_dir):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    values = config.num_key_value_heads * head_dim          # one token's K (or V) per layer
    elem = getattr(torch, str(config.dtype).removeprefix("torch.")).itemsize
    plain, fp8 = start_worker(model_dir), start_worker(model_dir, extra=["--kv-cache-dtype", "fp8"])
    try:
        a, b = worker_info(plain.port, BLOCK), worker_info(fp8.port, BLOCK)
    finally:
        plain.stop()
        fp8.stop()
    assert a.kv_cache_dtype == a.dtype and b.kv_cache_dtype == "fp8_e4m3"
    # same memory (--kv-cache-gb): fp8 stores 1 byte per value + one 4-byte scale per token
    expected = values * elem / (values + 4)
    assert abs(b.num_kv_blocks / a.num_kv_blocks - expected) < 0.01 * expected
    # (this tiny model has 32 values per token: the scale costs 11%; Qwen3-0.6B has 1,024,
    # so fp8 holds 1.99x the tokens of bf16 there)


def test_fp8_greedy_through_services_matches_hf_with_fp8_kv(model_dir, monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3

    from kernels.kv_quant import dequantize_ref, quantize_ref

    def fake_quant(x):   # HF's cache holds what our fp8 cache would return: rounded K/V
        rows = x[0].transpose(0, 1)
        return dequantize_ref(*quantize_ref(rows), x.dtype).transpose(0, 1)[None]

    eager = modeling_qwen3.eager_attention_forward
    monkeypatch.setattr(modeling_qwen3, "eager_attention_forward",
                        lambda m, q, k, v, *a, **kw: eager(m, q, fake_quant(k), fake_quant(v),
                                                           *a, **kw))
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    worker = start_worker(model_dir, extra=["--kv-cache-dtype", "fp8"])
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=BLOCK)
        assert "fp8_e4m3" in sched.output()
        prompts = [[5, 17, 33, 2, 91], list(range(40, 61)), [7] * 12]
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            for prompt in prompts:
                want = hf_greedy(hf, prompt, 20)
                got = [t for r in stub.Generate(generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=prompt), sampling=generate_pb2.SamplingParams(
                        max_tokens=20, temperature=0.0)), timeout=60) for t in r.token_ids]
                assert got == want, (prompt, got, want)
    finally:
        if sched:
            sched.stop()
        worker.stop()


def test_launch_gives_every_worker_the_kv_cache_dtype():
    from scheduler_service.launch import commands, parse_args
    *workers, sched = commands(parse_args(["--model", "m", "--tp", "2", "--kv-cache-dtype", "fp8"]))
    for cmd in workers:
        assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--kv-cache-dtype" not in sched
    assert all("--kv-cache-dtype" not in c for c in commands(parse_args(["--model", "m"])))
