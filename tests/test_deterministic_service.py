"""--deterministic through the services (CPU, Triton interpreter in the worker): the worker
reports it (GetStats, GetModelInfo, /v1/models), and one prompt's greedy and seeded answers
are the same token for token alone and beside concurrent requests of other lengths, whose
steps put it in batches of other sizes, with other neighbours, prefilling beside its decode.
The kernels' bit-level checks are tests/test_deterministic.py's."""
from __future__ import annotations

import concurrent.futures as cf
import json
import random
import urllib.request

import grpc
import pytest

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import start_scheduler, start_worker
from tiny_checkpoint import tiny_qwen3_dir
from triton_device import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the CPU worker runs Triton interpreted")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model_dir = tiny_qwen3_dir(tmp_path_factory)
    worker = start_worker(model_dir, extra=["--deterministic"])
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=16,
                                extra=["--http-port", "0"])
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as channel:
            yield generate_pb2_grpc.GenerationStub(channel), sched.http_port, \
                f"127.0.0.1:{sched.port}"
    finally:
        if sched:
            sched.stop()
        worker.stop()


def answer(stub, prompt: list[int], **sampling) -> list[int]:
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(max_tokens=12, ignore_eos=True, **sampling))
    return list(stub.Complete(req, timeout=300).token_ids)


def test_reported(stack):
    stub, http_port, target = stack
    assert stub.GetStats(generate_pb2.StatsRequest(), timeout=10).deterministic
    assert stub.GetModelInfo(generate_pb2.ModelInfoRequest(), timeout=10).deterministic
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10) as r:
        assert json.load(r)["data"][0]["deterministic"] is True
    from client import Client
    with Client(target) as c:
        assert c.stats().deterministic and c.model_info().deterministic


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7)],
                         ids=["greedy", "seeded"])
def test_same_answer_alone_and_under_load(stack, sampling):
    stub, _, _ = stack
    rnd = random.Random(68)
    prompt = [rnd.randrange(300) for _ in range(70)]
    alone = answer(stub, prompt, **sampling)
    others = [[rnd.randrange(300) for _ in range(rnd.randint(3, 90))] for _ in range(5)]
    with cf.ThreadPoolExecutor(6) as pool:
        load = [pool.submit(answer, stub, p, temperature=1.0) for p in others[:3]]
        loaded = pool.submit(answer, stub, prompt, **sampling)
        load += [pool.submit(answer, stub, p, temperature=0.0) for p in others[3:]]
        assert loaded.result() == alone
        for f in load:
            f.result()


def test_launcher_and_compose_pass_the_flag():
    from pathlib import Path

    from scheduler_service.launch import commands, parse_args
    cmds = commands(parse_args(["--model", "m", "--tp", "1", "--deterministic"]))
    assert all("--deterministic" in c for c in cmds[:-1]) and "--deterministic" not in cmds[-1]
    assert not any("--deterministic" in c for c in commands(parse_args(["--model", "m"])))
    from worker_service.__main__ import parse_args as worker_args
    assert worker_args(["--model", "m", "--deterministic"]).deterministic == "on"
    assert worker_args(["--model", "m", "--deterministic=off"]).deterministic == "off"
    assert worker_args(["--model", "m"]).deterministic == "off"
    root = Path(__file__).resolve().parents[1]
    for name in ("docker-compose.yml", "docker-compose.single.yml"):
        text = (root / name).read_text()
        assert text.count("--deterministic=${DETERMINISTIC:-off}") == text.count(
            "-m, worker_service,"), name
