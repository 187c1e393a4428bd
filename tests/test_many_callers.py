"""One deployment, many callers, through the real services on a null worker (CPU): priority
order and preemption (full batch, full KV cache) with outputs unchanged, deadlines before
prefill, API keys with quotas (429 / RESOURCE_EXHAUSTED), SIGHUP reload with streams
running, fair shares between keys."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import threading
import time

import grpc
import pytest

from client.null_model import write_null_model
from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import free_port, start_null_worker, start_scheduler, wait_until
from worker_service.null_worker import expected_tokens

pytestmark = [pytest.mark.slow, pytest.mark.alone]
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
    blocker = stub.Generate(request([1, 2, 3], 1500, priority=-1), timeout=60)
    head = next(blocker)
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
    assert len(ids_of([head, *rest])) == 1500


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
    assert stats.num_preemptions >= stats.num_priority_preemptions >= 1
    assert took < 5, f"the high-priority request waited {took:.1f}s"


def test_deadline_that_cannot_be_met_is_dropped_before_prefill(serve):
    """One seat, 100 ms steps: a request whose 1 s deadline would pass within a step of
    reaching the head of the queue is dropped there (our DEADLINE_EXCEEDED, before gRPC's
    own), never prefilled."""
    stub, _ = serve(step_ms=100, extra=["--max-num-seqs", "1"])
    blocker = stub.Generate(request([1], 30), timeout=60)
    got = 0
    for chunk in blocker:   # the scheduler learns how long a step takes
        got += len(chunk.token_ids)
        if got >= 10:
            break
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request([2], 5), timeout=1.0))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "before it could start" in e.value.details()
    stats = stub.GetStats(generate_pb2.StatsRequest(), timeout=10)
    assert stats.num_deadline_drops == 1 and stats.num_waiting == 0
    blocker.cancel()


# ---- API keys ---------------------------------------------------------------------------

KEYS = [
    {"name": "team-a", "key": "sk-team-a-0001", "max_concurrent": 2, "load_adapters": True},
    {"name": "team-b", "key": "sk-team-b-0002", "tokens_per_minute": 100},
    {"name": "bulk", "key": "sk-bulk-00003", "highest_priority": 5, "default_priority": 10},
]


def bearer(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def http(port: int, path: str, key: str | None, body: dict) -> tuple[int, dict, dict]:
    """POST JSON; (status, headers, body)."""
    import urllib.error
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            data = json.loads(raw)
        except ValueError:
            data = {"text": raw.decode()}
        return e.code, dict(e.headers), data


def test_keys_limits_and_permissions(serve, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    root = tmp_path / "adapters"
    root.mkdir()
    stub, sched = serve(extra=["--api-keys", str(keys), "--api-key", "legacy-key-0",
                               "--http-port", "0", "--adapter-root", str(root)])
    port = sched.http_port
    # who: no key / a wrong key -> UNAUTHENTICATED, 401; the single --api-key still works
    for md in ((), bearer("sk-nobody-0000")):
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(request([1], 2), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert http(port, "/v1/completions", None, {"prompt": [1], "max_tokens": 1})[0] == 401
    assert len(stub.Complete(request([1], 2), metadata=bearer("legacy-key-0"),
                             timeout=10).token_ids) == 2
    # team-a: two requests in flight at most (across the whole deployment)
    a = bearer("sk-team-a-0001")
    streams = [stub.Generate(request([5 + i], 400), metadata=a, timeout=60) for i in range(2)]
    for s in streams:
        next(s)
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(request([9], 2), metadata=a, timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(e.value.trailing_metadata())["retry-after"] == "1"
    assert "team-a" in e.value.details()
    status, headers, body = http(port, "/v1/completions", "sk-team-a-0001",
                                 {"prompt": [1], "max_tokens": 1})
    assert status == 429 and headers["Retry-After"] == "1"
    assert body["error"]["type"] == "rate_limit_error"
    for s in streams:
        s.cancel()

    def admitted() -> bool:   # the cancels reach the scheduler a moment later: until then 429
        try:
            return bool(stub.Complete(request([9], 1), metadata=a, timeout=10).token_ids)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return False
    assert wait_until(admitted, timeout=10)
    # team-b: 100 tokens a minute, charged as prompt + max_tokens
    b = bearer("sk-team-b-0002")
    assert len(stub.Complete(request([1] * 10, 50), metadata=b, timeout=10).token_ids) == 50
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(request([1] * 10, 50), metadata=b, timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 50 <= int(dict(e.value.trailing_metadata())["retry-after"]) <= 60
    status, headers, _ = http(port, "/v1/completions", "sk-team-b-0002",
                              {"prompt": [1] * 10, "max_tokens": 50})
    assert status == 429 and 50 <= int(headers["Retry-After"]) <= 60
    assert len(stub.Complete(request([1] * 10, 30), metadata=b, timeout=10).token_ids) == 30
    # bulk: its default priority is 10; it may not ask for less than 5, nor load adapters
    bulk = bearer("sk-bulk-00003")
    assert stub.Complete(request([1], 1, priority=5), metadata=bulk, timeout=10).token_ids
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(request([1], 1, priority=0), metadata=bulk, timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert http(port, "/v1/completions", "sk-bulk-00003",
                {"prompt": [1], "max_tokens": 1, "priority": 4})[0] == 403
    assert http(port, "/v1/completions", "sk-bulk-00003",
                {"prompt": [1], "max_tokens": 1})[0] == 200
    status, _, body = http(port, "/v1/load_lora_adapter", "sk-bulk-00003",
                           {"lora_name": "x", "lora_path": "x"})
    assert status == 403 and "load_adapters" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        stub.LoadAdapter(generate_pb2.LoadAdapterRequest(name="x", path="x"), metadata=bulk,
                         timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # team-a may: the request goes on to the workers (the null worker has no LoRA slots)
    status, _, body = http(port, "/v1/load_lora_adapter", "sk-team-a-0001",
                           {"lora_name": "x", "lora_path": "x"})
    assert status != 403 and "load_adapters" not in json.dumps(body)


def test_sighup_reloads_keys_without_dropping_streams(serve, tmp_path, eos):
    import signal
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS[:1]))
    stub, sched = serve(step_ms=3, extra=["--api-keys", str(keys), "--frontends", "2"])
    a = bearer("sk-team-a-0001")
    stream = stub.Generate(request([3], 300), metadata=a, timeout=60)
    first = next(stream)
    keys.write_text(json.dumps([{"name": "team-d", "key": "sk-team-d-0004",
                                 "max_concurrent": 1}]))
    sched.popen.send_signal(signal.SIGHUP)

    def refused_a() -> bool:   # by both frontends: a new connection each, 4 times
        for _ in range(4):
            with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
                try:
                    generate_pb2_grpc.GenerationStub(ch).Complete(request([1], 1), metadata=a,
                                                                  timeout=5)
                    return False
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                        return False
        return True
    assert wait_until(refused_a, timeout=10)
    d = bearer("sk-team-d-0004")
    assert stub.Complete(request([1], 1), metadata=d, timeout=10).token_ids
    # a file that does not parse keeps the keys
    keys.write_text("{not json")
    sched.popen.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert stub.Complete(request([1], 1), metadata=d, timeout=10).token_ids
    assert sched.popen.poll() is None
    rest = list(stream)   # the stream of the key that is gone ran to its end
    assert ids_of([first, *rest]) == expected_tokens([3], 300, VOCAB, eos)
    assert "not reloaded" in sched.output(None)


def test_concurrency_limit_holds_across_frontends(serve, tmp_path):
    """Two frontends, a new connection per request (each may land on either): the key's
    limit of 2 is the deployment's, not each frontend's."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS[:1]))
    _, sched = serve(extra=["--api-keys", str(keys), "--frontends", "2"])
    a = bearer("sk-team-a-0001")
    channels = [grpc.insecure_channel(f"127.0.0.1:{sched.port}") for _ in range(6)]
    try:
        stubs = [generate_pb2_grpc.GenerationStub(ch) for ch in channels]
        streams = [stubs[i].Generate(request([5 + i], 2000), metadata=a, timeout=60)
                   for i in range(2)]
        for st in streams:
            next(st)
        for stub in stubs[2:]:
            with pytest.raises(grpc.RpcError) as e:
                stub.Complete(request([9], 2), metadata=a, timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for st in streams:
            st.cancel()
    finally:
        for ch in channels:
            ch.close()


def test_fair_shares_between_two_saturating_keys(serve, tmp_path):
    """Key a keeps 24 requests in flight, key b 8, on 8 seats: first come first served
    would give a 3 tokens for every one of b's; fair shares give each half (within 10%).
    With b gone quiet, a alone keeps all 8 seats."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"name": "a", "key": "sk-fair-aaaa"},
                                {"name": "b", "key": "sk-fair-bbbb"}]))
    metrics_port = free_port()
    stub, _ = serve(step_ms=2, extra=["--api-keys", str(keys), "--max-num-seqs", "8",
                                      "--metrics-port", str(metrics_port)])
    tokens = {"a": 0, "b": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def loop(name: str) -> None:
        md = bearer(f"sk-fair-{name * 4}")
        while not stop.is_set():
            n = len(stub.Complete(request([7], 16), metadata=md, timeout=60).token_ids)
            with lock:
                tokens[name] += n

    with cf.ThreadPoolExecutor(32) as pool:
        futs = [pool.submit(loop, "a") for _ in range(24)] + \
               [pool.submit(loop, "b") for _ in range(8)]
        time.sleep(2)   # warm up
        with lock:
            start = dict(tokens)
        time.sleep(8)
        with lock:
            got = {k: tokens[k] - start[k] for k in tokens}
        stop.set()
        for f in futs:
            f.result()
    share = got["a"] / (got["a"] + got["b"])
    print(f"fair shares: tokens a={got['a']} b={got['b']} (a's share {share:.3f})")
    assert abs(got["a"] - got["b"]) <= 0.1 * max(got.values()), got
    # per caller in the metrics: requests, tokens, TTFT and queue time by key and priority
    from test_metrics import scrape_until, value

    def counted(m) -> bool:
        return sum(value(m, "nanoserve_caller_tokens_total", key=k, priority="0",
                         kind="generation") for k in "ab") == sum(tokens.values())
    m = scrape_until(metrics_port, counted)
    assert counted(m)
    for k in "ab":
        n = value(m, "nanoserve_caller_requests_total", key=k, priority="0",
                  finish_reason="length", code="OK")
        assert n > 0 and value(m, "nanoserve_caller_time_to_first_token_seconds_count",
                               key=k, priority="0") == n
        assert value(m, "nanoserve_caller_queue_time_seconds_count", key=k, priority="0") == n


def test_bench_mixed_mode_on_the_null_worker(tmp_path):
    """client.bench --mixed: the interactive stream's TTFT under the flood, with priorities
    and as one class (where it queues behind the flood)."""
    from client import bench
    out = tmp_path / "mixed.json"
    assert bench.main(["--null-worker", "--step-ms", "2", "--mixed", "--num-seqs", "48",
                       "--min-input-len", "20", "--max-input-len", "100", "--min-output-len",
                       "100", "--max-output-len", "200", "--interactive-requests", "8",
                       "--interactive-input-len", "32", "--interactive-output-len", "16",
                       "--interactive-concurrency", "2", "--no-progress",
                       "--scheduler-args", "--max-num-seqs 16 --frontends 1",
                       "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["idle"]["requests"] == 8 and r["flood"]["output_tok_per_s"] > 0
    for phase in ("priority", "fcfs"):
        assert r[phase]["requests"] > 0 and r[phase]["flood_failed"] == 0
    assert r["priority"]["ttft_ms"]["p99"] < r["fcfs"]["ttft_ms"]["p99"]


def test_bench_mixed_mode_beside_an_embedding_flood(tmp_path):
    """client.bench --mixed --flood-kind embed (issue 67): the interactive stream alone and
    beside a flood of Embed requests, on a null worker and scheduler serving generate,embed;
    the flood's embeddings/s alone and beside."""
    from client import bench
    out = tmp_path / "mixed_embed.json"
    assert bench.main(["--null-worker", "--step-ms", "2", "--mixed", "--flood-kind", "embed",
                       "--num-seqs", "64", "--embed-len", "64", "--embed-batch", "4",
                       "--embed-concurrency", "4", "--interactive-requests", "8",
                       "--interactive-input-len", "32", "--interactive-output-len", "16",
                       "--interactive-concurrency", "2", "--no-progress",
                       "--scheduler-args", "--max-num-seqs 16 --frontends 1",
                       "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["flood_kind"] == "embed" and r["idle"]["requests"] == 8
    assert r["idle"]["itl_ms"]["p99"] > 0
    assert r["flood"]["embeddings_per_s"] > 0 and r["flood"]["failed"] == 0
    for phase in ("priority", "fcfs"):
        p = r[phase]
        assert p["requests"] > 0 and p["failed"] == p["flood_failed"] == 0
        assert p["itl_ms"]["p99"] > 0 and p["itl_p99_vs_idle"] > 0
        assert p["flood_embeddings_per_s"] > 0 and p["flood_vs_alone"] > 0


@contextlib.contextmanager
def tiny_model_services(tmp_path_factory, *scheduler_flags: str):
    """A tiny Qwen3 on a CPU worker behind a scheduler (8-token blocks, one frontend) with
    these flags: a stub to it, everything stopped after."""
    from services import start_worker
    from tiny_checkpoint import tiny_qwen3_dir
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=3)
    worker = start_worker(model_dir)
    sched = start_scheduler(model_dir, [worker.port], block_size=8,
                            extra=["--frontends", "1", *scheduler_flags])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            yield generate_pb2_grpc.GenerationStub(ch)
    finally:
        sched.stop()
        worker.stop()


def test_preempted_outputs_equal_on_a_real_model(tmp_path_factory):
    """A tiny Qwen3 on a CPU worker: low-priority requests (greedy, and seeded sampling)
    preempted by high-priority ones give the tokens they give when nobody preempts them."""
    with tiny_model_services(tmp_path_factory, "--max-num-seqs", "2") as stub:
        def low(i: int, priority: int | None = 5) -> generate_pb2.GenerateRequest:
            req = request([11 + i, 7, 3 * i + 1], 48, priority=priority)
            if i:   # the second one samples, seeded
                req.sampling.temperature, req.sampling.seed = 0.9, 1234
            return req

        alone = [ids_of(stub.Generate(low(i), timeout=120)) for i in range(2)]
        streams = [stub.Generate(low(i), timeout=120) for i in range(2)]
        heads = [next(s) for s in streams]
        highs = [ids_of(stub.Generate(request([50 + j, 2], 4, priority=0), timeout=120))
                 for j in range(3)]
        got = [ids_of([h, *s]) for h, s in zip(heads, streams)]
        stats = stub.GetStats(generate_pb2.StatsRequest(), timeout=10)
    assert all(len(h) == 4 for h in highs)
    assert stats.num_preemptions >= 1
    assert got == alone


def test_background_prompts_beside_decodes_on_a_real_model(tmp_path_factory):
    """--max-background-prefill-tokens on a tiny Qwen3 CPU worker: low-priority prompts go
    in 8 tokens a step beside a high-priority stream's decode rows (mixed steps, counted in
    GetStats), and every output, greedy and seeded, equals the one it gives alone."""
    with tiny_model_services(tmp_path_factory, "--max-background-prefill-tokens", "8") as stub:
        def low(i: int) -> generate_pb2.GenerateRequest:
            req = request([11 + i, 7, 3 * i + 1] * 10, 12, priority=5)   # 30 tokens
            if i == 1:   # seeded sampling
                req.sampling.temperature, req.sampling.seed = 0.9, 1234
            return req

        high = request([50, 2, 9], 160, priority=0)
        alone = [ids_of(stub.Generate(low(i), timeout=120)) for i in range(3)]
        high_alone = ids_of(stub.Generate(high, timeout=120))
        before = stub.GetStats(generate_pb2.StatsRequest(), timeout=10).num_mixed_steps
        stream = stub.Generate(high, timeout=120)
        head = next(stream)
        with cf.ThreadPoolExecutor(3) as pool:
            beside = list(pool.map(lambda i: ids_of(stub.Generate(low(i), timeout=120)),
                                   range(3)))
        got_high = ids_of([head, *stream])
        mixed = stub.GetStats(generate_pb2.StatsRequest(), timeout=10).num_mixed_steps
    assert beside == alone and got_high == high_alone
    assert mixed - before >= 3   # (30-token prompts, 8 tokens a step)
