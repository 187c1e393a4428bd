"""Supervision under the real launcher (`python -m scheduler_service.launch`, what `make
serve` runs): a worker killed with SIGKILL mid-generation is restarted (TP=2: the whole
group, its surviving rank gone within seconds), the scheduler re-prefills every request it
holds, and every stream finishes token-identical to an undisturbed run of the same
greedy requests on the same server (test_e2e / test_tp_e2e pin that to Hugging Face)."""
from __future__ import annotations

import concurrent.futures as cf
import os
import random
import re
import signal
import time
from pathlib import Path

import grpc
import pytest

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import Proc, alive, children, comm, free_port, named_children, wait_until
from test_metrics import scrape, value
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = [pytest.mark.slow, pytest.mark.alone]
VOCAB = 389
_SCHEDULER = re.compile(r"scheduler listening on [\w.:]+:(\d+)")


def start_launcher(model_dir: Path, tp: int, extra: list[str] = ()) -> tuple[Proc, int]:
    """The launcher with its workers and scheduler: (its Proc, the scheduler's port)."""
    port = free_port()
    launcher = Proc("launcher", [
        "scheduler_service.launch", "--model", str(model_dir), "--tp", str(tp), "--device", "cpu",
        "--port", str(port), "--worker-base-port", str(free_port()), "--dist-port", str(free_port()),
        "--worker-args", "--kv-cache-gb 0.05 --log-level WARNING", *extra,
        "--", "--block-size", "8", "--log-level", "WARNING"], env={"OMP_NUM_THREADS": "1"}).launch()
    if not wait_until(lambda: any(_SCHEDULER.search(l) for l in launcher.log), 120, 0.2):
        launcher.stop(signal.SIGKILL)
        raise RuntimeError(f"launcher did not start:\n{launcher.output()}")
    return launcher, port


def worker_pids(launcher: Proc, standby: bool = False) -> list[int]:
    """The launcher's live worker processes (standby: its spares), rank order. A spare is
    started with --standby and renames itself ns-rank-<rank> once woken; by argv, not by
    its ns-standby name alone, since a spare just spawned has not named itself yet (counted
    as serving, it once took rank 0's place and the test killed it instead)."""
    ranks = {}
    for pid in children(launcher.popen.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        spare = "--standby" in argv and not (comm(pid) or "").startswith("ns-rank")
        if "worker_service" in argv and alive(pid) and spare == standby:
            ranks[int(argv[argv.index("--rank") + 1])] = pid
    return [ranks[r] for r in sorted(ranks)]


def engine_core_pid(launcher: Proc) -> int:
    """The launcher's scheduler's engine core (the supervisor names it ns-engine-core)."""
    for pid in children(launcher.popen.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        if "scheduler_service" in argv:
            return named_children(pid)["ns-engine-core"]
    raise RuntimeError("no scheduler under the launcher")


def run_streams_through_a_kill(model_dir: Path, tp: int, n_streams: int, max_tokens: int,
                               victim_rank: int | None) -> None:
    """victim_rank None: the engine core is killed instead of a worker. Half the streams
    are greedy, half sample with a seed: both must match the undisturbed run."""
    rng = random.Random(tp)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 30))]
               for _ in range(n_streams)]
    metrics_port = free_port()   # the scheduler's; rank i gets metrics_port + 1 + i
    launcher, port = start_launcher(model_dir, tp, ["--metrics-port", str(metrics_port)])
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = generate_pb2_grpc.GenerationStub(channel)
        old = worker_pids(launcher)
        assert len(old) == tp
        sampling = [generate_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True) if i % 2 else
                    generate_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=i,
                                                max_tokens=max_tokens, ignore_eos=True)
                    for i in range(n_streams)]
        start = lambda: [stub.Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=p), sampling=sp), timeout=240)
            for p, sp in zip(prompts, sampling)]
        streams = start()   # the undisturbed run: the reference
        reference = [[t for chunk in s for t in chunk.token_ids] for s in streams]
        assert all(len(r) == max_tokens for r in reference)
        streams = start()
        got = [list(next(s).token_ids) for s in streams]   # every stream is running
        core = engine_core_pid(launcher)
        os.kill(core if victim_rank is None else old[victim_rank], signal.SIGKILL)
        killed_at = time.monotonic()
        assert all(len(g) < max_tokens for g in got)

        def drain(i: int) -> list[int]:
            for chunk in streams[i]:
                got[i].extend(chunk.token_ids)
            return got[i]

        with cf.ThreadPoolExecutor(n_streams) as pool:
            outs = list(pool.map(drain, range(n_streams)))
        assert outs == reference
        new = worker_pids(launcher)
        if victim_rank is None:   # a new engine core; the workers stayed
            assert engine_core_pid(launcher) != core and new == old
        else:
            assert len(new) == tp and not set(new) & set(old), "the whole group was restarted"
            log = launcher.output(None)   # a survivor's traceback can be longer than a tail
            assert re.search(r"launch: the worker (group )?(rank \d )?exited \((killed by "
                             r"SIGKILL|exit status 69)\); restarting", log), log
        if tp > 1:   # the survivor left in seconds (heartbeat / broken collective), not ~80 s
            assert time.monotonic() - killed_at < 60
        stats = stub.GetStats(generate_pb2.StatsRequest(), timeout=5)
        assert stats.workers_healthy and stats.num_running == stats.num_waiting == 0
        # Every request of both runs counted once, none failed; the restarted ranks serve
        # metrics on their ports again.
        m = scrape(metrics_port)
        assert value(m, "nanoserve_requests_total", finish_reason="length", code="OK") == 2 * n_streams
        assert sum(v for (name, _), v in m.items() if name == "nanoserve_requests_total") == 2 * n_streams
        for rank in range(tp):
            assert value(scrape(metrics_port + 1 + rank), "nanoserve_worker_kv_blocks",
                         rank=str(rank)) == stats.num_kv_blocks
    finally:
        channel.close()
        code = launcher.stop(signal.SIGTERM, timeout=60)
    assert code == 0, launcher.output()
    assert "CancelledError" not in launcher.output(None), launcher.output()


def test_worker_sigkilled_under_launcher_20_greedy_streams_finish_identical(tmp_path_factory):
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=21)
    run_streams_through_a_kill(model_dir, tp=1, n_streams=20, max_tokens=80, victim_rank=0)


def test_engine_core_sigkilled_under_launcher_greedy_and_seeded_streams_finish_identical(
        tmp_path_factory):
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=23)
    run_streams_through_a_kill(model_dir, tp=1, n_streams=10, max_tokens=80, victim_rank=None)


def test_tp2_rank_sigkilled_under_launcher_group_restarted_streams_finish(tmp_path_factory):
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_heads=4, num_kv_heads=2,
                               seed=22)
    run_streams_through_a_kill(model_dir, tp=2, n_streams=6, max_tokens=60, victim_rank=1)


def test_hung_rank_is_noticed_by_its_peer_through_the_heartbeat(tmp_path_factory):
    """Rank 1 frozen (SIGSTOP: its sockets stay open, so no collective fails and NCCL
    would wait out its own timeout): idle rank 0 stops seeing its heartbeat and exits
    with EXIT_GROUP_BROKEN within --heartbeat-timeout, so a supervisor restarts the group."""
    from services import start_tp_workers
    from worker_service.distributed import EXIT_GROUP_BROKEN
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_heads=4, num_kv_heads=2,
                               seed=23)
    rank0, rank1 = start_tp_workers(model_dir, 2, extra=["--heartbeat-timeout", "2"])
    try:
        os.kill(rank1.popen.pid, signal.SIGSTOP)
        started = time.monotonic()
        assert rank0.wait_exit(15) == EXIT_GROUP_BROKEN, rank0.output()
        assert time.monotonic() - started < 10
        assert "rank 1 sent no heartbeat" in rank0.output()
    finally:
        rank1.popen.kill()
        os.kill(rank1.popen.pid, signal.SIGCONT)
        rank0.stop()
        rank1.stop()


def test_broken_group_survivor_is_killed_at_once(tmp_path_factory):
    """Issue 49: a kill's restart costs what a start costs, not a wait on the survivor. When
    rank 1 dies, the launcher SIGKILLs rank 0 (frozen here, as a rank blocked in a
    collective whose peer is gone may be: SIGTERM never handled) with no grace: the group
    holds no requests to drain, the scheduler does. The restart begins after the first
    backoff (0.5 s), not after a grace period too (1 s until 2026-11-28: >= 1.5 s)."""
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_heads=4, num_kv_heads=2,
                               seed=24)
    launcher, _ = start_launcher(model_dir, 2)
    try:
        rank0, rank1 = worker_pids(launcher)
        os.kill(rank0, signal.SIGSTOP)
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: "restarting the worker group" in launcher.output(), 30, 0.05), \
            launcher.output()
        took = time.monotonic() - killed   # noticed (0.1 s polls) + the first backoff, 0.5 s
        assert 0.5 <= took < 1.4, (took, launcher.output())
        assert not alive(rank0)
        assert wait_until(lambda: len(worker_pids(launcher)) == 2, 60, 0.2)
    finally:
        code = launcher.stop(signal.SIGTERM, timeout=60)
    assert code == 0, launcher.output()


def test_restarted_group_starts_from_spares_that_did_their_imports(tmp_path_factory):
    """Issue 49: once the workers listen, the launcher keeps a spare per rank that has
    imported torch and the model code and waits; a rank's death wakes the spares as the
    new group (no imports in its start-up line), which serves, and new spares follow.
    Nothing outlives the launcher; --no-standby-workers keeps none."""
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_heads=4, num_kv_heads=2,
                               seed=25)
    launcher, port = start_launcher(model_dir, 2)
    try:
        assert wait_until(lambda: launcher.output().count("standing by (imports") == 2, 120, 0.2), \
            launcher.output()
        spares, (rank0, rank1) = worker_pids(launcher, standby=True), worker_pids(launcher)
        assert len(spares) == 2 and not set(spares) & {rank0, rank1}
        os.kill(rank1, signal.SIGKILL)
        assert wait_until(lambda: launcher.output().count("imports (done standing by) 0.0 s") == 2,
                          120, 0.2), launcher.output()
        assert wait_until(lambda: worker_pids(launcher) == spares, 30, 0.2), launcher.output()
        assert not alive(rank0) and not alive(rank1)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            chunks = stub.Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]), sampling=generate_pb2.SamplingParams(
                    temperature=0.0, max_tokens=8, ignore_eos=True)), timeout=120)
            assert sum(len(c.token_ids) for c in chunks) == 8
        assert wait_until(lambda: len(worker_pids(launcher, standby=True)) == 2, 120, 0.2)
        everyone = worker_pids(launcher) + worker_pids(launcher, standby=True)
        assert len(set(everyone)) == 4
    finally:
        code = launcher.stop(signal.SIGTERM, timeout=60)
    assert code == 0, launcher.output()
    assert wait_until(lambda: not any(alive(p) for p in everyone), 10, 0.1)
    launcher, _ = start_launcher(model_dir, 1, ["--no-standby-workers"])
    try:
        assert len(worker_pids(launcher)) == 1
        time.sleep(3)
        assert worker_pids(launcher, standby=True) == [] and "standing by" not in launcher.output()
    finally:
        assert launcher.stop(signal.SIGTERM, timeout=60) == 0, launcher.output()


def test_a_refused_configuration_stops_the_launcher_without_restarts(tmp_path_factory):
    """A worker that refuses its flags (here --deterministic beside --small-batch-kernel
    persistent) exits EX_CONFIG with its reason; the launcher does not restart it (the
    refusal would only repeat) and exits 1 at once."""
    from scheduler_service import launch
    from worker_service import __main__ as worker_main
    assert launch.EXIT_CONFIG == worker_main.EXIT_CONFIG
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_heads=4, num_kv_heads=2,
                               seed=25)
    launcher = Proc("launcher", [
        "scheduler_service.launch", "--model", str(model_dir), "--device", "cpu",
        "--port", str(free_port()), "--worker-base-port", str(free_port()), "--deterministic",
        "--worker-args", "--small-batch-kernel persistent --kv-cache-gb 0.05"]).launch()
    code = launcher.wait_exit(120)
    out = launcher.output()
    launcher.stop(signal.SIGKILL)
    assert code == 1, out
    assert "configuration error" in out and "small-batch-kernel" in out, out
    assert "refused its configuration" in out and "; restarting" not in out, out


def test_crash_loop_stops_the_launcher_with_status_1(tmp_path):
    """A group that keeps exiting is not restarted forever: after --max-restarts exits
    within --restart-window the launcher stops everything and exits 1."""
    launcher = Proc("launcher", [
        "scheduler_service.launch", "--model", str(tmp_path / "missing"), "--device", "cpu",
        "--port", str(free_port()), "--worker-base-port", str(free_port()),
        "--max-restarts", "1", "--restart-window", "120"]).launch()
    code = launcher.wait_exit(120)
    out = launcher.output()
    launcher.stop(signal.SIGKILL)
    assert code == 1, out
    assert "restarting" in out and "crash loop, stopping" in out, out
