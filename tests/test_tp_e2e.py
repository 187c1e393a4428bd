"""Tensor parallelism end to end: TP=2 worker processes over gloo behind the real scheduler.

Greedy output must be token-identical to TP=1 and to Hugging Face on the same weights,
including GQA with num_key_value_heads == TP size (one KV head per rank) and a tied,
odd-sized vocabulary (the last vocab shard is padded). The failure tests pin down the
contract of worker_service/distributed.py: a rank whose group breaks exits with
EXIT_GROUP_BROKEN, the scheduler reports unhealthy instead of hanging, and restarting
the group lets in-flight requests finish.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
import time

import grpc
import jsonschema
import pytest
import torch
import transformers
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import free_port, start_scheduler, start_tp_workers, start_worker, wait_until, worker_proc
from test_e2e import generate, hf_greedy, hf_greedy_ignore_eos
from tiny_checkpoint import tiny_qwen3_dir
from worker_service.distributed import EXIT_GROUP_BROKEN, TPConfigError, check_tp_config

pytestmark = [pytest.mark.slow, pytest.mark.alone]
BLOCK = 8
VOCAB = 389
CHECKPOINTS = {
    "gqa_kv_eq_tp": dict(num_heads=4, num_kv_heads=2, vocab_size=VOCAB, seed=11),
    "mha_tied": dict(num_heads=4, num_kv_heads=4, vocab_size=VOCAB, seed=12,
                     tie_word_embeddings=True),
    "moe_e5_top2": dict(num_heads=4, num_kv_heads=2, vocab_size=VOCAB, seed=13, num_layers=3,
                        moe=dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                                 moe_intermediate_size=32, mlp_only_layers=[1])),
}


def _stop_all(*procs) -> None:
    for p in procs:
        if p is not None:
            p.stop()


class Stack:
    """A scheduler in front of its workers; stub() talks to the scheduler."""

    def __init__(self, workers, scheduler):
        self.workers, self.scheduler = workers, scheduler
        self.channel = grpc.insecure_channel(f"127.0.0.1:{scheduler.port}")
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        _stop_all(self.scheduler, *self.workers)


def start_stack(model_dir, world_size: int, **tp) -> Stack:
    workers = (start_tp_workers(model_dir, world_size, **tp) if world_size > 1
               else [start_worker(model_dir)])
    try:
        sched = start_scheduler(model_dir, [w.port for w in workers], block_size=BLOCK,
                                extra=["--max-num-batched-tokens", "64", "--fast-forward",
                                       "--no-speculative-adaptive"])
    except BaseException:
        _stop_all(*workers)
        raise
    return Stack(workers, sched)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def stacks(request, tmp_path_factory):
    """(model_dir, TP=2 stack, TP=1 stack) on one checkpoint; ranks get different KV budgets."""
    model_dir = tiny_qwen3_dir(tmp_path_factory, **CHECKPOINTS[request.param])
    with cf.ThreadPoolExecutor(2) as pool:   # both stacks boot at once
        tp2 = pool.submit(start_stack, model_dir, 2, kv_cache_gb=[0.05, 0.04])
        tp1 = pool.submit(start_stack, model_dir, 1)
        stacks = [f.result() for f in (tp2, tp1)]   # (a failure leaks the other; rare)
    yield model_dir, CHECKPOINTS[request.param], *stacks
    for s in stacks:
        s.close()


def test_tp2_greedy_matches_tp1_and_hf(stacks):
    model_dir, _, tp2, tp1 = stacks
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 8, 9, 23, 70)]
    jobs = [(p, 16, {}) for p in prompts] + [(prompts[2], 40, {"ignore_eos": True})]
    with cf.ThreadPoolExecutor(2 * len(jobs)) as pool:   # concurrent: batched decode steps
        runs = {name: [pool.submit(generate, stack.stub, p, n, **kw) for p, n, kw in jobs]
                for name, stack in (("tp2", tp2), ("tp1", tp1))}
        out = {name: [f.result()[0] for f in futures] for name, futures in runs.items()}
    for i, (prompt, n, kw) in enumerate(jobs):
        ref = (hf_greedy_ignore_eos(hf, prompt, n) if kw else hf_greedy(hf, prompt, n))
        assert out["tp2"][i] == ref, f"TP=2 vs HF, prompt of {len(prompt)} tokens"
        assert out["tp1"][i] == ref, f"TP=1 vs HF, prompt of {len(prompt)} tokens"


def test_tp2_penalties_top_logprobs_and_n_match_tp1(stacks):
    """Only rank 0 samples, so only it keeps the penalty history: TP=2 must still agree."""
    _, _, tp2, tp1 = stacks
    sampling = generate_pb2.SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, n=2, repetition_penalty=1.5,
        frequency_penalty=0.5, logprobs=True, top_logprobs=3)
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 9, 5, 9, 5, 9, 17] * 3),
                                       sampling=sampling)
    a, b = (s.stub.Complete(req, timeout=120) for s in (tp2, tp1))
    assert len(a.choices) == len(b.choices) == 2
    for x, y in zip(a.choices, b.choices):
        assert list(x.token_ids) == list(y.token_ids) and len(x.token_ids) == 20
        assert [list(t.token_ids) for t in x.top_logprobs] == [list(t.token_ids) for t in y.top_logprobs]
        for t, u in zip(x.top_logprobs, y.top_logprobs):
            assert list(t.logprobs) == pytest.approx(list(u.logprobs), abs=1e-4)


def test_tp2_constrained_sampling_matches_tp1(stacks):
    """Only rank 0 keeps grammar state (it samples): seeded constrained completions under
    TP=2 are the TP=1 ones, and match the schema; both fast-forward the schema's keys (its
    forced tokens run as extra decode rows on every rank)."""
    _, _, tp2, tp1 = stacks
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5},
                                               "v": {"type": "array", "items": {"type": "integer"},
                                                     "maxItems": 3}},
              "required": ["k", "v"], "additionalProperties": False}
    sampling = generate_pb2.SamplingParams(temperature=1.0, seed=4, max_tokens=120, n=3,
                                           structured=generate_pb2.StructuredOutput(
                                               json_schema=json.dumps(schema)))
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 9, 5, 9, 17]),
                                       sampling=sampling, skip_special_tokens=True)
    stats = lambda s: s.stub.GetStats(generate_pb2.StatsRequest())  # noqa: E731
    before = stats(tp2).num_fast_forward_tokens
    a, b = (s.stub.Complete(req, timeout=120) for s in (tp2, tp1))
    assert [list(c.token_ids) for c in a.choices] == [list(c.token_ids) for c in b.choices]
    assert stats(tp2).num_fast_forward_tokens > before and stats(tp2).num_fast_forward_mismatches == 0
    for c in a.choices:
        assert c.finish_reason == generate_pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads(c.text), schema)


def test_tp2_predictions_match_tp1_and_hf(stacks):
    """Verify steps under TP=2: every rank runs the proposal rows and rewinds the same KV,
    rank 0 samples. Greedy with an exact and a corrupted prediction equals HF; seeded
    sampling with penalties and a prediction equals TP=1's."""
    model_dir, _, tp2, tp1 = stacks
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = [5, 9, 5, 9, 17, 30, 31]
    ref = hf_greedy_ignore_eos(hf, prompt, 40)
    stats = lambda s: s.stub.GetStats(generate_pb2.StatsRequest())  # noqa: E731
    before = stats(tp2).num_spec_accepted_tokens
    for prediction in (ref, ref[:10] + [3, 4] + ref[12:]):
        req = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), sampling=generate_pb2.SamplingParams(
                temperature=0.0, max_tokens=40, ignore_eos=True, prediction=generate_pb2.Prediction(
                    token_ids=generate_pb2.TokenIds(ids=prediction))))
        assert list(tp2.stub.Complete(req, timeout=120).token_ids) == ref
    assert stats(tp2).num_spec_accepted_tokens > before
    sampled = generate_pb2.SamplingParams(temperature=0.9, seed=8, max_tokens=40, ignore_eos=True,
                                          presence_penalty=0.8)
    plain = tp1.stub.Complete(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampled), timeout=120)
    sampled.prediction.token_ids.ids.extend(plain.token_ids)
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampled)
    a, b = (s.stub.Complete(req, timeout=120) for s in (tp2, tp1))
    assert list(a.token_ids) == list(b.token_ids) == list(plain.token_ids)
    assert a.usage.accepted_prediction_tokens > 0


def test_tp2_kv_capacity_is_per_rank_minimum(stacks):
    """Each rank holds half the KV heads, so a block costs half: twice the blocks of TP=1
    for the same budget; the group takes the smaller rank's (0.04 GiB) count."""
    _, ckpt, tp2, tp1 = stacks
    # K and V, each layer, head_dim 16, float32
    block_bytes = lambda kv_heads: 2 * ckpt.get("num_layers", 2) * BLOCK * kv_heads * 16 * 4
    blocks1 = tp1.stub.GetStats(generate_pb2.StatsRequest()).num_kv_blocks
    blocks2 = tp2.stub.GetStats(generate_pb2.StatsRequest()).num_kv_blocks
    assert blocks1 == int(0.05 * (1 << 30) // block_bytes(ckpt["num_kv_heads"]))
    assert blocks2 == int(0.04 * (1 << 30) // block_bytes(ckpt["num_kv_heads"] // 2))
    assert "TP=2" in tp2.scheduler.output()


def test_tp_ranks_time_the_join_apart_from_the_weights_load_it_overlaps(stacks):
    """Issue 49: a rank's start-up line counts the rendezvous (store, checks, process group)
    before the weights and, after them, only what is left of the group's set-up (NCCL's
    communicators and peer memory, built in a thread beside the weights load), before the
    first forward; the weights load is split (model build, shard copies, time waiting for
    the checkpoint's reads); the phases add up to the total."""
    tp2 = stacks[2]
    for w in tp2.workers:
        line = next(x for x in w.log if "start-up:" in x).strip()
        phases, total = line.split("start-up:")[1].strip().split("; total ")
        names = [part.rsplit(" ", 2)[0] for part in phases.split(", ")]
        seconds = [float(part.rsplit(" ", 2)[1]) for part in phases.split(", ")]
        order = [names.index(n) for n in ("imports", "rendezvous", "model build", "weights",
                                          "checkpoint reads waited", "group set-up left",
                                          "profile run")]
        assert order == sorted(order), line
        assert abs(sum(seconds) - float(total.removesuffix(" s"))) <= 0.05 * len(seconds), line


def start_greedy_stream(stub, prompt: list[int], max_tokens: int):
    """A greedy ignore-eos Generate stream that has produced its first tokens:
    (the stream, the ids received so far)."""
    stream = stub.Generate(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)),
        timeout=120)
    return stream, list(next(stream).token_ids)


def test_rank_killed_mid_generation_group_restart_finishes_request(tmp_path_factory):
    """SIGKILL rank 1 while a request decodes: rank 0's collective fails at once (gloo sees
    the closed socket), rank 0 exits EXIT_GROUP_BROKEN, the scheduler reports unhealthy
    (GetStats and grpc health) without hanging; restarting both ranks finishes the request."""
    model_dir = tiny_qwen3_dir(tmp_path_factory, **CHECKPOINTS["gqa_kv_eq_tp"])
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ports, dist_port = [free_port(), free_port()], free_port()
    stack = start_stack(model_dir, 2, ports=ports, dist_port=dist_port)
    try:
        stub = stack.stub
        health = health_pb2_grpc.HealthStub(stack.channel)
        check = lambda: health.Check(health_pb2.HealthCheckRequest(
            service="nanoserve.v1.Generation"), timeout=5).status
        prompt = list(range(10, 40))
        stream, ids = start_greedy_stream(stub, prompt, 300)
        rank0, rank1 = stack.workers
        rank1.stop(sig=9)
        assert rank0.wait_exit(20) == EXIT_GROUP_BROKEN, rank0.output()
        assert "tensor-parallel group broken" in rank0.output()
        assert wait_until(lambda: check() == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        assert not stub.GetStats(generate_pb2.StatsRequest(), timeout=5).workers_healthy
        stack.workers = start_tp_workers(model_dir, 2, ports=ports, dist_port=dist_port)
        for chunk in stream:
            ids.extend(chunk.token_ids)
        assert ids == hf_greedy_ignore_eos(hf, prompt, 300)
        assert wait_until(lambda: check() == health_pb2.HealthCheckResponse.SERVING, 10)
        assert stub.GetStats(generate_pb2.StatsRequest(), timeout=5).workers_healthy
    finally:
        stack.close()


def test_failed_rank_is_noticed_while_another_rank_is_stuck(tmp_path_factory):
    """Rank 0 frozen mid-generation (as if blocked in a collective that NCCL only abandons
    after its timeout) and rank 1 killed: the scheduler must learn of the failure from
    rank 1's broken stream at once, not wait on rank 0; after a group restart the
    request finishes as if nothing happened."""
    model_dir = tiny_qwen3_dir(tmp_path_factory, **CHECKPOINTS["gqa_kv_eq_tp"])
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ports, dist_port = [free_port(), free_port()], free_port()
    stack = start_stack(model_dir, 2, ports=ports, dist_port=dist_port)
    try:
        stub = stack.stub
        prompt = list(range(50, 70))
        stream, ids = start_greedy_stream(stub, prompt, 200)
        rank0, rank1 = stack.workers
        os.kill(rank0.popen.pid, signal.SIGSTOP)
        try:
            rank1.stop(sig=9)
            started = time.monotonic()
            assert wait_until(lambda: not stub.GetStats(generate_pb2.StatsRequest(),
                                                        timeout=5).workers_healthy, 10)
            assert time.monotonic() - started < 10
        finally:
            rank0.popen.kill()
            os.kill(rank0.popen.pid, signal.SIGCONT)
        rank0.wait_exit(20)
        stack.workers = start_tp_workers(model_dir, 2, ports=ports, dist_port=dist_port)
        for chunk in stream:
            ids.extend(chunk.token_ids)
        assert ids == hf_greedy_ignore_eos(hf, prompt, 200)
    finally:
        stack.close()


def test_idle_group_exits_as_a_whole_when_a_rank_is_replaced(tmp_path_factory):
    """No step in flight, so no collective can fail: a replacement rank 1 finds its rank
    taken at the rendezvous and tells the stale rank 0 to exit; with a new rank 0 the group
    re-forms. When rank 0 (the rendezvous store) goes, rank 1 follows on its own."""
    model_dir = tiny_qwen3_dir(tmp_path_factory, **CHECKPOINTS["gqa_kv_eq_tp"])
    dist_port = free_port()
    old0, old1 = start_tp_workers(model_dir, 2, dist_port=dist_port)
    new = []
    try:
        old1.stop(sig=9)
        new1 = worker_proc(model_dir, rank=1, world_size=2,
                           dist_init=f"tcp://127.0.0.1:{dist_port}").launch()
        new.append(new1)
        assert old0.wait_exit(20) == EXIT_GROUP_BROKEN, old0.output()
        assert "this group is stale" in old0.output()
        new0 = worker_proc(model_dir, rank=0, world_size=2,
                           dist_init=f"tcp://127.0.0.1:{dist_port}").launch()
        new.append(new0)
        new0.wait_listening(60)
        new1.wait_listening(60)
        new0.stop(sig=9)
        assert new1.wait_exit(20) == EXIT_GROUP_BROKEN, new1.output()
        assert "rank 0 is gone" in new1.output()
    finally:
        _stop_all(old0, old1, *new)


def test_init_is_collective_ranks_sent_one_by_one_break_the_group(tmp_path_factory):
    """Init meets every peer (worker.proto): rank 0's Init alone does not return, and when
    rank 1's never comes the group breaks at --dist-timeout, as NCCL's watchdog broke it on
    GPUs when the scheduler sent Init rank by rank. Sent together (the next group), both
    Inits finish."""
    from nanoserve.v1 import worker_pb2, worker_pb2_grpc
    model_dir = tiny_qwen3_dir(tmp_path_factory, **CHECKPOINTS["gqa_kv_eq_tp"])
    init = worker_pb2.InitRequest(num_kv_blocks=16, block_size=BLOCK)
    procs = start_tp_workers(model_dir, 2, extra=["--dist-timeout", "4"])
    try:
        stubs = [worker_pb2_grpc.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{p.port}"))
                 for p in procs]
        lone = stubs[0].Init.future(init, timeout=30)
        with pytest.raises(grpc.FutureTimeoutError):
            lone.result(timeout=2)            # waiting for rank 1 in the barrier
        assert procs[0].wait_exit(30) == EXIT_GROUP_BROKEN, procs[0].output()
        assert "Init failed on rank 0" in procs[0].output()
        assert lone.exception(timeout=10).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        _stop_all(*procs)
    procs = start_tp_workers(model_dir, 2, extra=["--dist-timeout", "4"])
    try:
        stubs = [worker_pb2_grpc.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{p.port}"))
                 for p in procs]
        both = [stub.Init.future(init, timeout=30) for stub in stubs]
        assert [f.result().num_kv_blocks for f in both] == [16, 16]
        assert all(stub.Health(worker_pb2.HealthRequest(), timeout=5).ready for stub in stubs)
    finally:
        _stop_all(*procs)


@pytest.mark.parametrize("config, world_size, fits, fragment", [
    (dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128), 4, 2,
     "exceeds num_key_value_heads=2: replicating KV heads across ranks is not supported"),
    (dict(num_attention_heads=4, intermediate_size=128), 8, 4, "exceeds num_key_value_heads=4"),
    (dict(num_attention_heads=6, num_key_value_heads=6, intermediate_size=96), 4, 2,
     "num_attention_heads=6 is not divisible by --world-size 4"),
    (dict(num_attention_heads=8, num_key_value_heads=6, intermediate_size=96), 4, 2,
     "num_key_value_heads=6 is not divisible"),
    (dict(num_attention_heads=8, num_key_value_heads=8, intermediate_size=100), 8, 4,
     "intermediate_size=100 is not divisible"),
])
def test_tp_preconditions(config, world_size, fits, fragment):
    with pytest.raises(TPConfigError, match=fragment):
        check_tp_config(config, world_size)
    check_tp_config(config, fits)


def test_worker_rejects_world_size_above_kv_heads(tmp_path_factory):
    model_dir = tiny_qwen3_dir(tmp_path_factory, **CHECKPOINTS["gqa_kv_eq_tp"])
    with pytest.raises(RuntimeError, match="replicating KV heads across ranks is not supported"):
        start_worker(model_dir, rank=0, world_size=4, dist_init=f"tcp://127.0.0.1:{free_port()}")


def test_ranks_with_different_world_sizes_refuse_to_start(tmp_path_factory):
    model_dir = tiny_qwen3_dir(tmp_path_factory, **CHECKPOINTS["mha_tied"])
    dist_init = f"tcp://127.0.0.1:{free_port()}"
    procs = [worker_proc(model_dir, rank=r, world_size=ws, dist_init=dist_init).launch()
             for r, ws in ((0, 2), (1, 4))]
    try:
        for p in procs:
            assert p.wait_exit(60) not in (None, 0), p.output()
            assert "has world_size 4" in p.output() or "has world_size 2" in p.output()
            assert "every rank must be started alike" in p.output()
    finally:
        _stop_all(*procs)
