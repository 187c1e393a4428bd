"""Soak: the real control plane (supervisor, engine core, frontend) over a null worker,
three rounds of 300 concurrent streams: ~30% cancelled by the client at a random point,
~20% given deadlines short enough that many expire mid-stream, the rest checked token by
token against the null worker. After every round nothing is running or waiting and every
KV block is free; the engine core's and the frontend's RSS may not grow by more than
RSS_BOUND between the end of round 1 and the end of round 3: 600 requests apart, so a
leak of more than ~14 KiB per request fails (seen: +-2 MiB of noise).
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import grpc
import grpc.aio
import pytest

from client.null_model import write_null_model
from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import (engine_idle, named_children, rss_bytes, start_null_worker, start_scheduler,
                      wait_until)
from worker_service.null_worker import expected_tokens

pytestmark = [pytest.mark.slow, pytest.mark.alone]
VOCAB, MAX_LEN = 1000, 512
STREAMS, ROUNDS = 300, 3
RSS_BOUND = 8 << 20   # bytes, per process, round 1 -> round 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_null_model(tmp_path_factory.mktemp("null_model"), vocab_size=VOCAB,
                            max_position_embeddings=MAX_LEN)


async def one_stream(stub, rng: random.Random, eos: int, predict: bool = False) -> tuple[str, str]:
    """(kind, outcome): kind in complete / cancel / deadline; outcome "ok", "ok, expired"
    (deadline exceeded after a correct prefix) or what went wrong. predict: send a
    prediction (the answer, the answer with a stretch replaced, or none)."""
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 48))]
    n = rng.randint(4, 64)
    want = expected_tokens(prompt, n, VOCAB, eos)
    stop_id = want[rng.randrange(n)] if rng.random() < 0.3 else None
    if stop_id is not None:   # ends STOP at its first occurrence, the id kept
        want = want[:want.index(stop_id) + 1]
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(
            max_tokens=n, ignore_eos=True, temperature=rng.choice([0.0, 0.7, 1.0]),
            stop_token_ids=[stop_id] if stop_id is not None else []))
    if predict and rng.random() < 0.7:
        guess = expected_tokens(prompt, n, VOCAB, eos)
        if rng.random() < 0.5:
            at = rng.randrange(n)
            guess[at:at + 5] = [rng.randrange(VOCAB) for _ in range(5)]
        req.sampling.prediction.token_ids.ids.extend(guess)
    u = rng.random()
    kind = "cancel" if u < 0.3 else "deadline" if u < 0.5 else "complete"
    timeout = rng.uniform(0.02, 1.0) if kind == "deadline" else 120
    cancel_after = rng.randint(0, max(len(want) - 1, 0))
    call = stub.Generate(req, timeout=timeout)
    got, reason = [], None
    try:
        if kind == "cancel" and cancel_after == 0:
            await asyncio.sleep(rng.uniform(0, 0.05))
            call.cancel()
            return kind, "ok"
        async for msg in call:
            got += msg.token_ids
            reason = msg.finish_reason or reason
            if kind == "cancel" and len(got) >= cancel_after:
                call.cancel()
                return kind, "ok"
    except grpc.aio.AioRpcError as e:
        if kind == "deadline" and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return kind, "ok, expired" if got == want[:len(got)] else f"wrong prefix {got}"
        return kind, f"{e.code().name}: {e.details()}"
    want_reason = (generate_pb2.FINISH_REASON_STOP if stop_id is not None
                   else generate_pb2.FINISH_REASON_LENGTH)
    if got != want or reason != want_reason:
        return kind, f"got {got} ({reason}), want {want} ({want_reason})"
    return kind, "ok"


async def one_round(port: int, seed: int, eos: int, streams: int = STREAMS,
                    predict: bool = False) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        rngs = [random.Random(rng.random()) for _ in range(streams)]
        return await asyncio.gather(*(one_stream(stub, r, eos, predict) for r in rngs))


def test_soak_cancellations_deadlines_and_memory(model_dir):
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    # 64 blocks of 16 tokens hold a small part of a round: preemption happens too.
    worker = start_null_worker(model_dir, step_ms=2, extra=["--null-kv-blocks", "64"])
    sched = start_scheduler(model_dir, [worker.port], block_size=16)
    try:
        kids = named_children(sched.popen.pid)
        procs = {name: kids[name] for name in ("ns-engine-core", "ns-frontend-0")}
        channel = grpc.insecure_channel(f"127.0.0.1:{sched.port}")
        stub = generate_pb2_grpc.GenerationStub(channel)

        def stats():
            return stub.GetStats(generate_pb2.StatsRequest(), timeout=10)

        def idle() -> bool:
            s = stats()
            return (s.num_running == 0 and s.num_waiting == 0
                    and s.num_free_kv_blocks == s.num_kv_blocks)

        rss = []
        for r in range(ROUNDS):
            t0 = time.monotonic()
            results = asyncio.run(one_round(sched.port, seed=r, eos=eos))
            bad = [(k, o) for k, o in results if not o.startswith("ok")]
            assert not bad, bad[:5]
            kinds = {k: sum(1 for kk, _ in results if kk == k) for k in ("complete", "cancel", "deadline")}
            kinds["expired"] = sum(1 for _, o in results if o == "ok, expired")
            assert kinds["complete"] >= STREAMS * 0.4 and kinds["cancel"] >= STREAMS * 0.2 \
                and kinds["deadline"] >= STREAMS * 0.1 and kinds["expired"] > 0, kinds
            # Cancellations and expired deadlines reach the core shortly after the client
            # gives up: then nothing may be left behind.
            assert wait_until(idle, timeout=15), stats()
            rss.append({name: rss_bytes(pid) for name, pid in procs.items()})
            print(f"round {r}: {time.monotonic() - t0:.1f}s {kinds} rss "
                  f"{ {n: v >> 20 for n, v in rss[-1].items()} } MiB "
                  f"preemptions {stats().num_preemptions}")
        assert stats().num_preemptions > 0   # the small KV cache was exercised
        for name in procs:
            growth = rss[-1][name] - rss[0][name]
            assert growth <= RSS_BOUND, (name, [r[name] >> 20 for r in rss])
        assert sched.popen.poll() is None and worker.popen.poll() is None
        assert named_children(sched.popen.pid) == kids   # no restarts along the way
        channel.close()
    finally:
        sched.stop()
        worker.stop()


def test_soak_while_speculating(model_dir):
    """The same mix with n-gram speculation and predictions on most requests (exact, or with
    a stretch replaced), speculation allowed at any batch size, a KV cache small enough to
    preempt: every completed stream is exact, and after each round nothing is left in use."""
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    worker = start_null_worker(model_dir, step_ms=2, extra=["--null-kv-blocks", "48"])
    sched = start_scheduler(model_dir, [worker.port], block_size=16, extra=[
        "--speculative", "ngram", "--speculative-max-batch", "1000", "--ngram-min", "1"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            for r in range(2):
                results = asyncio.run(one_round(sched.port, seed=100 + r, eos=eos, streams=150,
                                                predict=True))
                bad = [(k, o) for k, o in results if not o.startswith("ok")]
                assert not bad, bad[:5]
                assert wait_until(lambda: engine_idle(stub), timeout=15), \
                    stub.GetStats(generate_pb2.StatsRequest(), timeout=10)
            s = stub.GetStats(generate_pb2.StatsRequest(), timeout=10)
            assert s.num_spec_accepted_tokens > 0 and s.num_preemptions > 0, s
    finally:
        sched.stop()
        worker.stop()
