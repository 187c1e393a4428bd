"""One deployment, many callers, through the real services on a null worker (CPU): priority
order and preemption (full batch, full KV cache) with outputs unchanged, deadlines before
prefill, API keys with quotas (429 / RESOURCE_EXHAUSTED), SIGHUP reload with streams
running, fair shares between keys."""
from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time

import grpc
import pytest

from client.null_model import write_null_model
from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import start_null_worker, start_scheduler, wait_until
from worker_service.null_worker import expected_tokens

pytestmark = pytest.mark.slow
VOCAB, MAX_LEN = 1000, 4096


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_null_model(tmp_path_factory.mktemp("null"), vocab_size=VOCAB,
                            max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def eos(model_dir):
    return json.loads((model_dir / "config.json").read_text())["eos_token_id"]


def request(prompt, max_tokens, priority=None, **kw) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                             temperature=0), **kw)
    if priority is not None:
        req.priority = priority
    return req


def ids_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture
def serve(model_dir):
    """serve(step_ms, kv_blocks, *scheduler flags) -> (stub, scheduler Proc); all stopped
    at the end."""
    procs, channels = [], []

    def start(step_ms=2.0, kv_blocks=4096, extra=(), metadata_key=None):
        worker = start_null_worker(model_dir, step_ms=step_ms,
                                   extra=["--null-kv-blocks", str(kv_blocks)])
        procs.append(worker)
        sched = start_scheduler(model_dir, [worker.port], block_size=16,
                                extra=["--frontends", "1", *extra])
        procs.append(sched)
        ch = grpc.insecure_channel(f"127.0.0.1:{sched.port}")
        channels.append(ch)
        return generate_pb2_grpc.GenerationStub(ch), sched

    yield start
    for ch in channels:
        ch.close()
    for p in reversed(procs):
        p.stop()


def test_priority_orders_the_queue(serve, eos):
    """One seat: a running request, then three queued with priorities 3, 1, 2 (a higher
    priority is never preempted by the lower ones): they finish 1, 2, 3."""
    stub, _ = serve(extra=["--max-num-seqs", "1"])
    blocker = stub.Generate(request([1, 2, 3], 60, priority=-1), timeout=60)
    next(blocker)
    finished: list[int] = []
    lock = threading.Lock()

    def run(p):
        chunks = list(stub.Generate(request([10 + p], 5, priority=p), timeout=60))
        assert ids_of(chunks) == expected_tokens([10 + p], 5, VOCAB, eos)
        with lock:
            finished.append(p)

    with cf.ThreadPoolExecutor(3) as pool:
        futs = []
        for p in (3, 1, 2):
            futs.append(pool.submit(run, p))
            assert wait_until(lambda: stub.GetStats(generate_pb2.StatsRequest()).num_waiting
                              == len(futs), timeout=10)
        rest = list(blocker)
        for f in futs:
            f.result()
    assert finished == [1, 2, 3]
    assert stub.GetStats(generate_pb2.StatsRequest()).num_preemptions == 0
    assert len(ids_of(rest)) == 59


@pytest.mark.parametrize("full", ["batch", "kv"])
def test_high_priority_preempts_and_low_outputs_are_unchanged(serve, eos, full):
    """The batch (2 seats) or the KV cache (2 sequences' worth) is full of low-priority
    streams: a high-priority request runs at once; the low ones are preempted, recomputed
    and finish with exactly the tokens they would have had."""
    if full == "batch":
        stub, _ = serve(extra=["--max-num-seqs", "2"])
    else:   # 16-token blocks: each low one grows to 63 blocks, 126 of 130
        stub, _ = serve(step_ms=4, kv_blocks=130, extra=["--max-num-seqs", "8"])
    lows = [[100 + i] * 8 for i in range(2)]
    streams = [stub.Generate(request(p, 1000, priority=5), timeout=120) for p in lows]
    firsts = [next(s) for s in streams]
    high_prompt = [7] * 40
    if full == "kv":   # the high one needs 36 blocks: more than are free
        assert wait_until(lambda: stub.GetStats(generate_pb2.StatsRequest()).num_free_kv_blocks
                          <= 30, timeout=60, interval=0.01)
        high_prompt = [7] * 560
    t0 = time.monotonic()
    high = list(stub.Generate(request(high_prompt, 5, priority=0), timeout=60))
    took = time.monotonic() - t0
    assert ids_of(high) == expected_tokens(high_prompt, 5, VOCAB, eos)
    with cf.ThreadPoolExecutor(2) as pool:
        rests = list(pool.map(list, streams))
    for p, first, rest in zip(lows, firsts, rests):
        assert ids_of([first, *rest]) == expected_tokens(p, 1000, VOCAB, eos)
    stats = stub.GetStats(generate_pb2.StatsRequest())
    assert stats.num_preemptions >= 1
    assert took < 5, f"the high-priority request waited {took:.1f}s"


def test_deadline_that_cannot_be_met_is_dropped_before_prefill(serve):
    stub, _ = serve(extra=["--max-num-seqs", "1"])
    blocker = stub.Generate(request([1], 200), timeout=60)
    next(blocker)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request([2], 5), timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # dropped in the queue: it never ran, and nothing is left of it
    assert wait_until(lambda: stub.GetStats(generate_pb2.StatsRequest()).num_waiting == 0,
                      timeout=10)
    list(blocker)
