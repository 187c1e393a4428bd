"""n completions, penalties and top_logprobs through the real control plane, driven by a
null worker: every token of every completion is predictable (null_worker.expected_tokens),
through preemption and overlap, and the null worker's made-up alternatives come back
row-aligned with the ids they belong to."""
from __future__ import annotations

import concurrent.futures as cf
import random

import grpc
import pytest

from client.null_model import write_null_model
from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import start_null_worker, start_scheduler, wait_until
from worker_service.null_worker import expected_tokens

pytestmark = pytest.mark.slow
VOCAB, MAX_LEN = 1000, 512


def test_n_completions_through_preemption_with_penalties_and_top_logprobs(tmp_path):
    model_dir = write_null_model(tmp_path, vocab_size=VOCAB, max_position_embeddings=MAX_LEN)
    import json
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    worker = start_null_worker(model_dir, step_ms=1, extra=["--null-kv-blocks", "40"])
    sched = start_scheduler(model_dir, [worker.port], block_size=16)
    try:
        rng = random.Random(2)
        reqs = [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))], rng.randint(1, 80),
                 rng.randint(1, 4)) for _ in range(10)]
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)

            def run(prompt, max_tokens, n):
                sampling = generate_pb2.SamplingParams(
                    max_tokens=max_tokens, ignore_eos=True, n=n, temperature=0.8, seed=1,
                    repetition_penalty=1.2, frequency_penalty=0.5, logprobs=True, top_logprobs=3)
                req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt),
                                                   sampling=sampling)
                return list(stub.Generate(req, timeout=120))

            with cf.ThreadPoolExecutor(len(reqs)) as pool:
                results = list(pool.map(lambda r: run(*r), reqs))
            for (prompt, max_tokens, n), chunks in zip(reqs, results):
                expected = expected_tokens(prompt, max_tokens, VOCAB, eos)
                for i in range(n):
                    mine = [c for c in chunks if c.index == i]
                    ids = [t for c in mine for t in c.token_ids]
                    top = [t for c in mine for t in c.top_logprobs]
                    assert ids == expected, f"completion {i} of {n}"
                    assert [list(t.token_ids) for t in top] == [
                        [(x + j) % VOCAB for j in range(3)] for x in ids]
                    assert all(list(t.logprobs) == [0.0, -1.0, -2.0] for t in top)
                    assert mine[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
                assert {c.index for c in chunks} == set(range(n))
                assert chunks[-1].usage.completion_tokens == n * max_tokens
                assert sum(c.HasField("usage") for c in chunks) == 1
            stats = stub.GetStats(generate_pb2.StatsRequest(), timeout=10)
            assert stats.num_preemptions > 0, "the KV cache was meant to run out"
            assert wait_until(lambda: stub.GetStats(generate_pb2.StatsRequest()).num_free_kv_blocks
                              == stats.num_kv_blocks, timeout=10)
    finally:
        sched.stop()
        worker.stop()
