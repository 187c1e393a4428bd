"""Streams that survive a replica (client/resume.py) and prefix-affine routing
(client/routing.py): unit tests on fake streams, then three real scheduler + worker stacks
on CPU with a tiny Qwen3, one SIGKILLed mid-stream."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time

import grpc
import pytest

from client import resume
from client.client import AsyncClient, Client, SamplingParams
from client.routing import PrefixRouter
from nanoserve.v1 import generate_pb2
from services import start_scheduler, start_worker
from test_scale_out import kill_replica
from tiny_checkpoint import tiny_qwen3_dir


class Lost(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "Connection reset by peer"


def msg(ids, text, finish=None, usage=None):
    m = generate_pb2.GenerateResponse(token_ids=ids, text=text, logprobs=[0.0] * len(ids))
    if finish:
        m.finish_reason = finish
        m.usage.CopyFrom(usage)
    return m


def request(prompt, **sampling):
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt),
                                        sampling=generate_pb2.SamplingParams(**sampling))


def test_resume_recomputes_the_tail_whose_text_was_held_back():
    """The dead server held back "\\n" (a possible start of the stop "\\n\\n"): the new one
    recomputes the last tokens, the caller gets neither a token twice nor the text twice,
    and the stop straddling the cut ends the stream."""
    req = request([1, 2, 3], max_tokens=10, stop=["\n\n"])
    seen: list[generate_pb2.GenerateRequest] = []

    def open_call(r, attempt):
        seen.append(r)
        if attempt == 0:
            yield msg([9], "x")
            yield msg([10], "foo")       # token 10 is "foo\n": "\n" held back
            yield msg([11], "")          # still possibly the stop
            raise Lost()
        # prompt + [9]: 10 and 11 recomputed (not delivered again), then 12 completes the stop
        yield msg([10], "foo")
        yield msg([11], "")
        yield msg([12], "", generate_pb2.FINISH_REASON_STOP,
                  generate_pb2.Usage(prompt_tokens=4, completion_tokens=3))

    out = list(resume.stream(req, open_call, lambda: []))
    assert list(seen[1].token_ids.ids) == [1, 2, 3, 9] and seen[1].sampling.max_tokens == 9
    assert [t for m in out for t in m.token_ids] == [9, 10, 11, 12]
    assert "".join(m.text for m in out) == "xfoo"
    assert out[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
    assert out[-1].usage.prompt_tokens == 3 and out[-1].usage.completion_tokens == 4


def test_resume_aligns_recomputed_text_and_falls_back_when_it_diverges():
    req = request([1], max_tokens=6, temperature=0.0)

    def open_call(r, attempt):
        if attempt == 0:
            yield msg([5], "ab")
            yield msg([6], "cd")
            raise Lost()
        if attempt == 1:   # recomputes 6: "cd" again, then diverges
            yield msg([6, 7], "cdef")
            yield msg([8], "gh", generate_pb2.FINISH_REASON_LENGTH,
                      generate_pb2.Usage(prompt_tokens=2, completion_tokens=5))
    out = list(resume.stream(req, open_call, lambda: []))
    assert [t for m in out for t in m.token_ids] == [5, 6, 7, 8]
    assert "".join(m.text for m in out) == "abcdefgh"
    assert out[-1].usage.prompt_tokens == 1 and out[-1].usage.completion_tokens == 6

    def diverging(r, attempt):
        if attempt == 0:
            yield msg([5, 6], "abcd")
            raise Lost()
        if attempt == 1:
            yield msg([9], "zz")          # not the delivered 6: resumed again at the cut
            return
        assert list(r.token_ids.ids) == [1, 5, 6]
        yield msg([7], "ef", generate_pb2.FINISH_REASON_LENGTH,
                  generate_pb2.Usage(prompt_tokens=3, completion_tokens=1))
    out = list(resume.stream(req, diverging, lambda: []))
    assert [t for m in out for t in m.token_ids] == [5, 6, 7]


def test_not_resumed_where_it_cannot_continue():
    def dies(r, attempt):
        yield msg([5], "a")
        raise Lost()
    for req in (request([1], n=2), request([1], temperature=0.5, seed=1,
                                               structured=generate_pb2.StructuredOutput(regex="a+"))):
        with pytest.raises(Lost):
            list(resume.stream(req, dies, lambda: []))
    with pytest.raises(Lost):   # max_resumes reached
        list(resume.stream(request([1]), dies, lambda: [], max_resumes=2))

    def invalid(r, attempt):
        yield msg([5], "a")
        raise Bad()

    class Bad(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(Bad):
        list(resume.stream(request([1]), invalid, lambda: []))


def test_text_prompts_are_tokenized_for_the_resume():
    req = generate_pb2.GenerateRequest(text="hello", sampling=generate_pb2.SamplingParams(
        max_tokens=3))
    calls = []

    def open_call(r, attempt):
        calls.append(r)
        if attempt == 0:
            yield msg([5, 6], "xy")
            raise Lost()
        yield msg([5], "x")   # the last chunk with text is recomputed whole
        yield msg([6, 7], "yz", generate_pb2.FINISH_REASON_LENGTH,
                  generate_pb2.Usage(prompt_tokens=2, completion_tokens=3))
    out = list(resume.stream(req, open_call, lambda: [40, 41]))
    assert list(calls[1].token_ids.ids) == [40, 41] and calls[1].sampling.max_tokens == 3
    assert [t for m in out for t in m.token_ids] == [5, 6, 7]
    assert "".join(m.text for m in out) == "xyz"


def test_prefix_router_keeps_conversations_and_balances():
    router = PrefixRouter(3, slack=1)
    system = list(range(64))
    convs = [system + [1000 + c] * 32 for c in range(9)]
    homes = []
    for c in convs:
        homes.append(router.pick(request(c)))
    assert sorted(homes) == [0, 0, 0, 1, 1, 1, 2, 2, 2]   # spread by load, not the system prompt
    for i in range(3):
        router.inflight[i] = 0
    for c, home in zip(convs, homes):   # the next turn: the history + a new message
        i = router.pick(request(c + [7] * 40))
        router.done(i)
        assert i == home
    router.forget(homes[0])
    assert router.pick(request(convs[0] + [7] * 40), exclude={homes[0]}) != homes[0]


# ---- three real stacks ----------------------------------------------------------------

N_GREEDY, N_SEEDED, MAX_TOKENS = 20, 4, 40


def prompts(n, base):
    return [[(base + 7 * i + j) % 200 + 3 for j in range(12 + i % 5)] for i in range(n)]


@pytest.fixture(scope="module")
def three_stacks(tmp_path_factory):
    model = tiny_qwen3_dir(tmp_path_factory)
    stacks = []
    try:
        for _ in range(3):
            w = start_worker(model, extra=["--max-num-seqs", "32"])
            stacks.append((start_scheduler(model, [w.port], block_size=8), w))
        yield model, stacks
    finally:
        for s, w in stacks:
            s.stop()
            w.stop()


@pytest.mark.slow
def test_streams_survive_a_replica_sigkill(three_stacks):
    """20 greedy streams (sync client) and 4 seeded ones (asyncio client) spread over three
    replicas; one replica is SIGKILLed mid-stream: every stream finishes, token-identical
    to an uninterrupted run, no token repeated or dropped."""
    model, stacks = three_stacks
    targets = [f"127.0.0.1:{s.port}" for s, _ in stacks]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(N_SEEDED)]
    g_prompts, s_prompts = prompts(N_GREEDY, 0), prompts(N_SEEDED, 91)
    with Client(targets[0], timeout=120) as c:   # the reference: one replica, undisturbed
        want_g = [c.complete(p, greedy).token_ids for p in g_prompts]
        want_s = [c.complete(p, s).token_ids for p, s in zip(s_prompts, seeded)]

    progress = [0] * (N_GREEDY + N_SEEDED)
    victim = 1

    def run_sync(client, i):
        ids = []
        for chunk in client.generate(g_prompts[i], greedy):
            ids.extend(chunk.token_ids)
            progress[i] = len(ids)
            time.sleep(0.01)   # a reader slower than the server: streams stay open longer
        return ids

    async def run_async():
        async with AsyncClient(targets, timeout=120, routing="prefix") as ac:
            async def one(i):
                ids = []
                async for chunk in ac.generate(s_prompts[i], seeded[i]):
                    ids.extend(chunk.token_ids)
                    progress[N_GREEDY + i] = len(ids)
                    await asyncio.sleep(0.01)
                return ids
            return await asyncio.gather(*(one(i) for i in range(N_SEEDED)))

    with Client(targets, timeout=120, routing="prefix") as client:
        with cf.ThreadPoolExecutor(N_GREEDY + 1) as pool:
            seeded_run = pool.submit(asyncio.run, run_async())
            streams = [pool.submit(run_sync, client, i) for i in range(N_GREEDY)]
            deadline = time.monotonic() + 120
            while min(progress) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert max(progress) < MAX_TOKENS, "the streams ended before the kill"
            on_victim = client._replicas.router.inflight[victim]
            kill_replica(*stacks[victim])
            got_g = [f.result() for f in streams]
            got_s = seeded_run.result()
    assert on_victim > 0, "no stream was on the killed replica"
    assert got_g == want_g
    assert got_s == want_s


@pytest.mark.slow
def test_bench_multi_turn_compares_routing_policies(tmp_path, capsys):
    """client.bench --multi-turn --routing compare on null-worker replicas: the prefix-affine
    client keeps each conversation's history warm, as one replica serving all would."""
    from client import bench
    out = tmp_path / "mt.json"
    assert bench.main(["--multi-turn", "4", "--num-seqs", "6", "--null-worker", "--replicas", "2",
                       "--routing", "compare", "--step-ms", "1", "--system-prompt-len", "16",
                       "--min-input-len", "16", "--max-input-len", "24", "--min-output-len", "8",
                       "--max-output-len", "12", "--temperature", "0", "--scheduler-args",
                       "--block-size 8", "--json", str(out)]) == 0
    import json
    policies = json.loads(out.read_text())["policies"]
    cached = {p: r["cached"] for p, r in policies.items()}
    assert cached["prefix"] >= 0.9 * cached["single"] > 0
    assert cached["round_robin"] < cached["prefix"]
    assert "TTFT p50 ms" in capsys.readouterr().out


@pytest.mark.slow
def test_prefix_routing_follows_the_replicas_kv_events(tmp_path):
    """A prompt warmed on replica 1 by someone else: the prefix client, which never routed
    it, finds it there from replica 1's KV events."""
    import json

    from client.null_model import write_null_model
    from services import free_port, start_null_worker
    model = write_null_model(tmp_path / "m", vocab_size=1000)
    stacks, events = [], []
    try:
        for _ in range(2):
            w = start_null_worker(model, step_ms=1)
            port = free_port()
            cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": f"tcp://*:{port}"})
            stacks.append((start_scheduler(model, [w.port], block_size=4, extra=[
                "--kv-events-config", cfg]), w))
            events.append(f"tcp://127.0.0.1:{port}")
        targets = [f"127.0.0.1:{s.port}" for s, _ in stacks]
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        prompt = list(range(10, 50))
        with Client(targets, timeout=60, routing="prefix", kv_events=events) as client:
            index = client._replicas.router.kv_index
            time.sleep(0.5)   # the subscriptions reach the publishers
            with Client(targets[1], timeout=60) as other:
                other.complete(prompt, params)
            deadline = time.monotonic() + 20
            while index.matched(1, routing_hashes(prompt, 4)) < 9 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert index.matched(1, routing_hashes(prompt, 4)) == 10 and index.block_size == 4
            assert index.matched(0, routing_hashes(prompt, 4)) == 0
            for _ in range(3):   # equal load: only the events tell replica 1 apart
                last = list(client.generate(prompt + [7, 8], params))[-1]
                assert last.usage.cached_tokens >= 36
    finally:
        for s, w in stacks:
            s.stop()
            w.stop()


def routing_hashes(ids, bs):
    from client.routing import server_block_hashes
    from scheduler_service.block_manager import compute_hash
    hashes = server_block_hashes(ids, bs)
    h = None
    for i, x in enumerate(hashes):   # the client's copy of the scheduler's hash
        h = compute_hash(tuple(ids[i * bs:(i + 1) * bs]), h)
        assert x == h
    return hashes
