"""The benchmark client, for real on a tiny checkpoint: through gRPC and in-process.

Each mode runs `python -m client.bench` as its own process (the command users run) on
a tiny workload. With ignore_eos every request must produce exactly its max_tokens, so
the output token count is an exact check that nothing was lost or double counted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.bench import (DecodeBreakdown, Trace, WorkloadConfig, arrival_offsets,
                          default_client_procs, for_run, make_workload, percentiles)
from services import ROOT, start_scheduler, start_worker
from tiny_checkpoint import tiny_qwen3_dir

TINY = ["--num-seqs", "6", "--min-input-len", "5", "--max-input-len", "20",
        "--min-output-len", "5", "--max-output-len", "15", "--warmup", "2", "--seed", "7"]
TINY_WORKLOAD = WorkloadConfig(num_seqs=6, min_input_len=5, max_input_len=20,
                               min_output_len=5, max_output_len=15, seed=7)
VOCAB = 389
MAX_POS = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=5,
                          max_position_embeddings=MAX_POS)


@pytest.fixture(scope="module")
def scheduler_port(model_dir):
    worker = start_worker(model_dir)
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=8)
        yield sched.port
    finally:
        if sched:
            sched.stop()
        worker.stop()


def run_bench(args: list[str], json_path: Path, env: dict | None = None,
              check_no_torch: bool = False, workload: bool = True) -> dict:
    """python -m client.bench ARGS --json PATH; returns the JSON report.

    check_no_torch: run main() under `python -c` and fail if torch got imported.
    workload: the generation workload ran (its printed figures and progress bar checked)."""
    full = [*args, "--json", str(json_path)]
    if check_no_torch:
        code = ("import sys, client.bench as b; rc = b.main(sys.argv[1:]); "
                "sys.exit(rc or (7 if 'torch' in sys.modules else 0))")
        cmd = [sys.executable, "-c", code, *full]
    else:
        cmd = [sys.executable, "-m", "client.bench", *full]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    if workload:
        assert "output tok/s" in proc.stdout and "per decode step" in proc.stdout
        assert "tok" in proc.stderr   # the progress bar
    return json.loads(json_path.read_text())


def check_report(report: dict, mode: str) -> None:
    expected = make_workload(TINY_WORKLOAD, VOCAB, MAX_POS)
    r = report["results"]
    assert report["mode"] == mode
    assert {"command", "config", "workload", "model", "device", "results"} <= report.keys()
    assert "client.bench" in report["command"]
    assert r["failed"] == 0
    assert r["output_tokens"] == r["expected_output_tokens"] == sum(q.max_tokens for q in expected)
    assert r["prompt_tokens"] == sum(len(q.prompt_ids) for q in expected)
    assert r["num_requests"] == 6
    assert r["wall_s"] > 0 and r["output_tok_per_s"] > 0
    assert r["total_tok_per_s"] > r["output_tok_per_s"]
    # every streamed message carries at least one token, and no more than a request has
    assert 1 <= r["tokens_per_message"] <= max(q.max_tokens for q in expected)
    for key in ("ttft_ms", "itl_ms"):
        p = r[key]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"], (key, p)
    d = r["decode"]
    assert d["steps"] > 0 and d["mean_batch"] >= 1
    assert d["idle_ms_per_step"] >= 0 and 0 <= d["idle_pct"] <= 100
    assert set(d["per_step_ms"]) == {"wall", "schedule", "rpc", "worker", "gpu", "postprocess",
                                     "idle"}
    assert all(v >= 0 for v in d["per_step_ms"].values())
    assert all(v >= 0 for v in d["totals_ms"].values())
    # Every measured decode step gives a measured request a token (the first one comes
    # from prefill), so warm-up steps leaking into the diff would likely break this.
    assert d["steps"] <= r["output_tokens"] - r["num_requests"]


@pytest.mark.slow
def test_bench_score_times_requests_and_shows_the_query_computed_once(tmp_path):
    """--score (issue 67) on a null worker and the real control plane, no torch in the client:
    one query x 4 documents of 16 tokens through Score, latency and the prefix cache's share.
    The 4 documents arrive together and would fit one prefill step: the scheduler admits the
    first and defers the others a step (they share blocks it computes), so every document
    finds the system prompt's blocks (the warm-up computed them), and the query's own blocks
    are computed by the first document alone (not by every document of the step, as before)."""
    r = run_bench(["--null-worker", "--step-ms", "1", "--score", "--score-docs", "4",
                   "--score-len", "16", "--score-query-len", "8", "--runs", "2", "--warmup", "1",
                   "--scheduler-args", "--block-size 8 --frontends 1"],
                  tmp_path / "score.json", check_no_torch=True, workload=False)
    assert r["task"] == "score" and r["documents"] == 4 and len(r["runs"]) == 2
    assert 8 <= r["tokens_per_document"] <= 16 and 1 <= r["query_tokens"] <= 8
    lat = r["latency_ms"]
    assert 0 < lat["min"] <= lat["median"] <= lat["max"] and r["documents_per_s"]["median"] > 0
    assert r["cached_tokens"] > 0 and r["computed_tokens"] > 0
    assert r["prompt_tokens"] == r["cached_tokens"] + r["computed_tokens"]
    assert 0 < r["shared_by_every_request_tokens"] < r["shared_prefix_tokens"]
    assert r["query_block_tokens"] > 0 and r["query_computed_times"]["max"] == 1
    every = r["shared_by_every_request_tokens"] // 8 * 8
    for run in r["runs"]:   # each document: the common blocks; all but the first: the query's
        assert run["cached_tokens"] == 4 * every + 3 * r["query_block_tokens"]


def test_score_documents_sharing_a_step_compute_the_query_once():
    """A Score request whose documents reach the scheduler together, while another step is
    in flight (null worker, 300 ms a step), so they wait for one prefill step together: the
    first document computes the query's blocks and the others wait a step for them rather
    than each computing them beside it (they did before: --max-num-seqs 1 hid it above).
    Every document finds the system prompt's blocks (a request before computed them)."""
    import asyncio

    from client.client import AsyncClient
    from client.embed_bench import _score, _shared_prefix
    from client.null_stack import NullStack

    docs = [f"{w} paged attention keeps keys and values in blocks" for w in
            ("alpha", "bravo", "charlie", "delta")]
    query = "which one of these keeps the keys and values of every token in fixed blocks"

    async def measure(target: str) -> tuple[int, int, int]:
        async with AsyncClient(target, timeout=30) as c:
            within, across = await _shared_prefix(c, query, docs)
            await _score(c, "a first query warms the system prompt", docs[:1])
            busy = asyncio.ensure_future(_score(c, "a query keeping the worker busy", docs[:1]))
            await asyncio.sleep(0.1)   # its step is in flight: the next request's documents
            _, usage = await _score(c, query, docs)   # queue up behind it, together
            await busy
            return within, across, usage.cached_tokens

    bs = 8
    with NullStack(step_ms=300, scheduler_args=["--block-size", str(bs), "--frontends", "1",
                                                "--task", "score", "--score-tokens", "y,n"],
                   worker_args=["--task", "score"]) as stack:
        within, across, cached = asyncio.run(measure(stack.target))
    every, query_blocks = across // bs * bs, within // bs * bs - across // bs * bs
    assert every > 0 and query_blocks >= 2 * bs
    assert cached == 4 * every + 3 * query_blocks


@pytest.mark.slow
def test_runs_after_the_first_reuse_no_prompt() -> None:
    """Repeated runs keep the lengths but never the ids of the run before: the prefix cache
    must not serve a second run's prefill (nano-vllm runs each time with an empty cache)."""
    base = make_workload(WorkloadConfig(json_schema='{"type": "array"}', constrained_fraction=0.5),
                         151936, 4096)
    assert for_run(base, 0, 151936) is base
    assert sum(r.json_schema is not None for r in base) == len(base) // 2   # the format stays
    runs = [for_run(base, k, 151936) for k in range(1, 5)]
    for run in runs:
        assert [len(r.prompt_ids) for r in run] == [len(r.prompt_ids) for r in base]
        assert [r.max_tokens for r in run] == [r.max_tokens for r in base]
        assert [r.json_schema for r in run] == [r.json_schema for r in base]
        assert all(0 <= t <= 10000 for r in run for t in r.prompt_ids)
    firsts = [tuple(tuple(r.prompt_ids[:16]) for r in run) for run in [base, *runs]]
    assert len(set(firsts)) == 5
    def blocks(run):   # its prompts' full 16-token blocks
        return {tuple(r.prompt_ids[i:i + 16]) for r in run
                for i in range(0, len(r.prompt_ids) - 15, 16)}

    for a, b in zip([base, *runs], runs):   # not one block shared between consecutive runs
        assert not blocks(a) & blocks(b)


def test_bench_grpc(scheduler_port, tmp_path):
    report = run_bench(["--target", f"127.0.0.1:{scheduler_port}", "--connections", "2", *TINY],
                       tmp_path / "g.json", check_no_torch=True)
    check_report(report, "grpc")
    assert report["model_info"]["vocab_size"] == VOCAB
    assert report["config"]["connections"] == 2
    assert report["config"]["client_procs"] == default_client_procs()   # resolved, recorded
    cpu = report["results"]["cpu"]   # against a server it did not start: only its own CPU
    assert set(cpu["seconds"]) == {"bench client"} and cpu["seconds"]["bench client"] > 0
    assert cpu["control_plane_us_per_token"] is None


def test_bench_null_worker_says_where_the_cpu_went(tmp_path):
    """--null-worker starts the real control plane over a null worker and reports each
    process's CPU over every run: the engine core and frontend by the names they give
    themselves, and the control plane's CPU per output token from exactly those."""
    # ~10k tokens a run: enough work for every process to pass a clock tick (10 ms)
    report = run_bench(["--null-worker", "--step-ms", "0", "--runs", "2", "--num-seqs", "128",
                        "--min-input-len", "20", "--max-input-len", "60", "--min-output-len",
                        "50", "--max-output-len", "100", "--warmup", "2"],
                       tmp_path / "n.json", check_no_torch=True)
    assert report["mode"] == "null-worker" and report["step_ms"] == 0
    for run in report["runs"]:
        assert run["failed"] == 0 and run["output_tokens"] == run["expected_output_tokens"]
        cpu = run["cpu"]
        seconds = cpu["seconds"]
        assert {"engine-core", "frontend-0", "scheduler", "null worker", "bench client"} == set(seconds)
        assert all(v >= 0 for v in seconds.values())
        # every token passed through the engine core and a frontend, and the bench read it
        assert min(seconds["engine-core"], seconds["frontend-0"], seconds["bench client"]) > 0
        control = seconds["engine-core"] + seconds["frontend-0"] + seconds["scheduler"]
        assert cpu["control_plane_us_per_token"] == pytest.approx(
            control / run["output_tokens"] * 1e6)
        assert cpu["cores"] >= 1 and cpu["wall_s"] == run["wall_s"]
        assert cpu["host_speed"] > 0
    for name in ("ctl CPU us/tok", "host M loop/s"):
        spread = report["spread"][name]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]


def test_bench_grpc_from_client_processes(scheduler_port, tmp_path):
    """--client-procs 2: the requests go out from two processes on one schedule (online
    here, so the arrival offsets matter) and their traces come back whole: every token of
    every request counted once, stamps on one clock (TTFT and ITL >= 0)."""
    report = run_bench(["--target", f"127.0.0.1:{scheduler_port}", "--client-procs", "2",
                        "--request-rate", "5", "--runs", "2", *TINY], tmp_path / "p.json",
                       check_no_torch=True)
    check_report(report, "grpc")
    assert report["config"]["client_procs"] == 2
    for run in report["runs"]:
        assert run["failed"] == 0 and run["output_tokens"] == run["expected_output_tokens"]
        assert run["ttft_ms"]["p50"] >= 0 and run["itl_ms"]["p50"] >= 0
        # six requests at 5/s arrive over 0.65 s (all at once they take ~0.1 s here)
        assert run["wall_s"] >= max(arrival_offsets(6, 5, 7))


@pytest.mark.parametrize("cores,procs", [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (128, 4)])
def test_default_client_procs_one_per_four_cores(monkeypatch, cores, procs):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_client_procs() == procs


def test_connections_spread_requests_round_robin(monkeypatch):
    """--connections N opens N channels and deals the requests out in turn (a channel is
    one connection, pinned to one frontend process by the server)."""
    import asyncio

    import client.client as cc
    from client.bench import _run_grpc_async, build_parser

    opened: list["FakeChannel"] = []

    class FakeChannel:
        def __init__(self, target, **kwargs):
            self.prompts: list[list[int]] = []
            opened.append(self)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return None

        async def model_info(self):
            return cc.ModelInfo(model="fake", vocab_size=VOCAB, max_model_len=MAX_POS)

        async def stats(self):
            return cc.Stats()

        async def generate(self, prompt, params, **kw):
            self.prompts.append(list(prompt))
            for _ in range(params.max_tokens):
                yield cc.GenerationChunk(request_id="r", token_ids=[1], text="", logprobs=[])

    monkeypatch.setattr(cc, "AsyncClient", FakeChannel)
    args = build_parser().parse_args(["--target", "x:1", "--connections", "3", "--warmup", "0",
                                      "--no-progress"])
    cfg = WorkloadConfig(num_seqs=7, min_input_len=5, max_input_len=20, min_output_len=5,
                         max_output_len=15)
    outcomes, workload = asyncio.run(_run_grpc_async(args, cfg))
    assert len(opened) == 3
    assert [len(c.prompts) for c in opened] == [3, 2, 2]
    assert [p for i in range(3) for p in opened[i].prompts] == \
        [r.prompt_ids for i in range(3) for r in workload[i::3]]
    assert sum(t.num_tokens for t in outcomes[0].traces) == sum(r.max_tokens for r in workload)


@pytest.mark.slow
def test_bench_in_process(model_dir, tmp_path):
    # One OpenMP thread: on a small CI box, spinning OpenMP threads fight the engine
    # thread for cores and make a tiny model's steps 10x slower and erratic.
    report = run_bench(["--in-process", "--model", str(model_dir), "--device", "cpu",
                        "--block-size", "8", "--kv-cache-gb", "0.05", "--request-rate", "200",
                        *TINY], tmp_path / "ip.json", env={"OMP_NUM_THREADS": "1"})
    check_report(report, "in-process")
    assert report["workload"]["request_rate"] == 200
    assert report["device"].startswith("cpu")
    assert report["results"]["decode"]["gpu_timed"] is False


@pytest.mark.slow
def test_bench_constrained_in_process_and_null_worker(model_dir, tmp_path):
    """--json-schema: half the requests constrained, through the real runner's masks and
    through the null worker's; lengths are those of the free run (the schema never ends)."""
    schema = ["--json-schema", str(ROOT / "client" / "bench_schema.json"),
              "--constrained-fraction", "0.5"]
    report = run_bench(["--in-process", "--model", str(model_dir), "--device", "cpu",
                        "--block-size", "8", "--kv-cache-gb", "0.05", *TINY, *schema],
                       tmp_path / "ip.json", env={"OMP_NUM_THREADS": "1"})
    check_report(report, "in-process")
    assert report["workload"]["json_schema"] and report["workload"]["constrained_fraction"] == 0.5
    report = run_bench(["--null-worker", "--step-ms", "0", "--num-seqs", "32", "--warmup", "0",
                        "--min-input-len", "20", "--max-input-len", "40", "--min-output-len",
                        "20", "--max-output-len", "60", *schema], tmp_path / "n.json",
                       check_no_torch=True)
    run = report["runs"][0]
    assert run["failed"] == 0 and run["output_tokens"] == run["expected_output_tokens"]


def test_constrained_fraction_spreads_evenly():
    cfg = WorkloadConfig(num_seqs=10, min_input_len=5, max_input_len=6, min_output_len=5,
                         max_output_len=6, json_schema='{"type": "array"}', constrained_fraction=0.3)
    marked = [r.json_schema is not None for r in make_workload(cfg, VOCAB, MAX_POS)]
    assert sum(marked) == 3 and marked == [False, False, False, True, False, False, True,
                                           False, False, True]


# ---- pure helpers -----------------------------------------------------------------

def test_reference_workload_matches_nano_vllm():
    """Seed 0 at the default sizes is nano-vllm's bench.py workload: 133,966 output tokens."""
    reqs = make_workload(WorkloadConfig(), vocab_size=151936, max_model_len=4096)
    assert len(reqs) == 256
    assert sum(r.max_tokens for r in reqs) == 133966
    assert all(100 <= len(r.prompt_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in reqs)
    assert max(t for r in reqs for t in r.prompt_ids) <= 10000


def test_tiny_vocab_and_context_caps():
    reqs = make_workload(WorkloadConfig(num_seqs=20, min_input_len=30, max_input_len=40,
                                        min_output_len=50, max_output_len=60), 100, 64)
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_ids)
    assert all(len(r.prompt_ids) + r.max_tokens <= 64 for r in reqs)


def test_percentiles_and_itl():
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["p50"] == 2.5 and p["p90"] == pytest.approx(3.7) and p["mean"] == 2.5
    assert percentiles([])["p50"] is None
    t = Trace(submit=0.0, chunks=[(1.0, 1), (1.5, 1), (2.5, 2)])
    assert t.ttft() == 1.0 and t.itls() == [0.5, 0.5, 0.5] and t.num_tokens == 4


def test_arrivals_and_breakdown():
    assert arrival_offsets(3, 0, 0) == [0.0, 0.0, 0.0]
    offs = arrival_offsets(2000, 100.0, 0)
    assert offs == sorted(offs) and 15 < offs[-1] < 25        # ~2000 / 100 req/s
    before = dict.fromkeys(["num_decode_steps", "num_decode_seqs", "decode_wall_ms",
                            "decode_schedule_ms", "decode_rpc_ms", "decode_worker_ms",
                            "decode_gpu_ms", "decode_postprocess_ms",
                            "num_fast_forward_tokens"], 0)
    after = dict(before, num_decode_steps=10, num_decode_seqs=40, decode_wall_ms=100.0,
                 decode_gpu_ms=80.0, decode_rpc_ms=90.0, num_fast_forward_tokens=7)
    s = DecodeBreakdown.diff(before, after).summary()
    assert s["fast_forward_tokens"] == 7
    assert s["mean_batch"] == 4 and s["gpu_timed"]
    assert s["idle_ms_per_step"] == pytest.approx(2.0) and s["idle_pct"] == pytest.approx(20.0)


def test_idle_share_never_exceeds_100_percent_when_nothing_is_gpu_timed():
    """On CPU the GPU time is 0, so idle == wall: the share must be exactly 100, whatever
    rounding the per-step division does (100 * x / x can land above 100)."""
    from client.bench import DecodeBreakdown
    for wall, steps in [(4632.61, 214), (4611.02, 52), (4548.87, 338), (1.0, 3)]:   # 100*x/x > 100
        d = DecodeBreakdown(steps=steps, seqs=steps, wall_ms=wall, schedule_ms=0, rpc_ms=0,
                            worker_ms=0, gpu_ms=0, postprocess_ms=0).summary()
        assert d["idle_pct"] == 100.0


def test_tokens_per_message_counts_coalesced_chunks():
    from client.bench import RunOutcome, summarize
    reqs = make_workload(WorkloadConfig(num_seqs=2, min_input_len=3, max_input_len=3,
                                        min_output_len=4, max_output_len=4), VOCAB, MAX_POS)
    traces = [Trace(submit=0.0, chunks=[(1.0, 1), (2.0, 3)], finish=2.0),   # 4 tokens, 2 messages
              Trace(submit=0.0, chunks=[(1.0, 4)], finish=1.0)]             # 4 tokens, 1 message
    outcome = RunOutcome(mode="grpc", model="m", device="d", max_model_len=MAX_POS,
                         traces=traces, wall_s=2.0,
                         breakdown=DecodeBreakdown())
    assert summarize(outcome, reqs)["tokens_per_message"] == pytest.approx(8 / 3)


def test_grpc_floor_measures_both_ends(tmp_path):
    """client.grpc_floor times real RPCs over loopback: positive costs on both ends, and the
    tokens/s bound is the cores over the per-message cost."""
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, "-m", "client.grpc_floor", "--rpcs", "128",
                           "--messages", "8", "--cores", "2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["rpc_client_us"] > 0 and r["rpc_server_us"] > 0
    per_token = r["message_client_us"] + r["message_server_us"]
    assert per_token > 0
    assert r["max_tokens_per_s"] == pytest.approx(2 / per_token * 1e6)
    assert "output tok/s (gRPC alone)" in proc.stdout


def test_null_model_takes_another_models_tokenizer(model_dir, tmp_path):
    """--null-tokenizer: the null model gets that tokenizer and its end-of-sequence id, so a
    null worker's grammar masks cover the real vocabulary."""
    from client.null_model import write_null_model
    from tokenizers import Tokenizer
    path = write_null_model(tmp_path / "m", vocab_size=VOCAB, tokenizer_dir=str(model_dir))
    assert (path / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    eos = json.loads((model_dir / "tokenizer_config.json").read_text())["eos_token"]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == tok.token_to_id(eos)


def test_score_query_count_from_cache_hits():
    """client.bench --score's count of the documents that computed the query's blocks, from
    a request's cached tokens: 100 documents, 192 tokens every request shares, 32 of the
    query's own: all but one document hit them -> 1; two computed them -> 2; more hits than
    99 documents can make (documents sharing blocks of their own) -> at least 1, flagged."""
    from client.embed_bench import query_computed_times
    assert query_computed_times(100, 100 * 192 + 99 * 32, 192, 32) == (1.0, False)
    assert query_computed_times(100, 100 * 192 + 98 * 32, 192, 32) == (2.0, False)
    assert query_computed_times(100, 100 * 192 + 99 * 32 + 510, 192, 32) == (1.0, True)
    assert query_computed_times(100, 5000, 192, 0) == (None, False)
