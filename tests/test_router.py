"""vllm-router (PyPI, pinned in the dev extra) in front of two replicas' OpenAI HTTP APIs:
its kv_aware policy reads their KV events (scheduler_service/kv_events.py) and their
/tokenize, and sends a repeated prompt to the replica whose cache holds it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from client.null_model import write_null_model
from services import free_port, start_null_worker, start_scheduler
from test_scale_out import generated

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or \
    shutil.which("vllm-router")


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


@pytest.mark.slow
@pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install -e .[dev])")
def test_vllm_router_kv_aware_follows_the_kv_events(tmp_path):
    model = write_null_model(tmp_path / "m", vocab_size=1000)
    stacks, router = [], None
    try:
        sources = []
        for _ in range(2):
            w = start_null_worker(model, step_ms=1)
            ev, replay = free_port(), free_port()
            cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{replay}"})
            s = start_scheduler(model, [w.port], block_size=16, extra=[
                "--http-port", "0", "--served-model-name", "nano", "--kv-events-config", cfg])
            stacks.append((s, w))
            sources.append((f"http://127.0.0.1:{s.http_port}", ev, replay))
        port = free_port()
        args = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
                "--worker-urls", *(u for u, _, _ in sources), "--kv-event-block-size", "16",
                "--kv-event-model", "nano", "--log-level", "warning"]
        for url, ev, replay in sources:
            args += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{ev}",
                     "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay}"]
        router = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and router.poll() is None, "router did not start"
                time.sleep(0.2)
        tok = post(f"{sources[0][0]}/tokenize", {"model": "nano", "prompt": "Once upon a time"})
        assert tok["count"] == len(tok["tokens"]) > 0
        prompt = "Paged attention stores keys and values in fixed-size blocks. " * 6
        for i in range(6):
            out = post(f"{base}/v1/completions", {"model": "nano", "prompt": prompt,
                                                  "max_tokens": 4, "ignore_eos": True})
            assert out["usage"]["completion_tokens"] == 4
            if i == 0:
                time.sleep(0.5)   # the first answer's BlockStored reaches the router
        shares = sorted(generated(s.port) // 4 for s, _ in stacks)
        assert shares == [0, 6], shares   # every repeat went where its prefix is cached
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for s, w in stacks:
            s.stop()
            w.stop()


def test_compose_router_follows_both_schedulers_events(tmp_path):
    """The replicas profile's router: its flags parse with vllm-router's own parser, its
    event sources are the schedulers' --kv-events-config endpoints, its block size and
    model their --block-size and model name, and its pin is the dev extra's."""
    import re
    import tomllib

    from scheduler_service.__main__ import parse_args
    from scheduler_service.kv_events import KVEventsConfig
    from test_compose import compose_config
    proc = compose_config(["docker-compose.yml"], str(tmp_path), profiles=["replicas"])
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    router = services["router"]
    vr = pytest.importorskip("vllm_router.launch_router")
    args = vr.parse_router_args(router["command"])
    assert args.policy == "kv_aware"
    sources = dict(s.split("=", 1) for s in args.kv_event_source)
    replays = dict(s.split("=", 1) for s in args.kv_event_replay_source)
    assert set(sources) == set(args.worker_urls) == set(replays)
    for name in ("scheduler", "scheduler-b"):
        sched = parse_args(services[name]["command"][3:])
        cfg = KVEventsConfig.from_cli(sched.kv_events_config)
        url = f"http://{name}:{sched.http_port}"
        assert cfg.active and url in args.worker_urls
        assert sources[url] == cfg.endpoint.replace("*", name)
        assert replays[url] == cfg.replay_endpoint.replace("*", name)
        assert args.kv_event_block_size == sched.block_size
        assert args.kv_event_model == (sched.served_model_name or Path(sched.model).name)
        assert name in router["depends_on"]
    pin = re.search(r"VLLM_ROUTER_VERSION=(\S+)",
                    (Path(__file__).parent.parent / "scheduler_service" / "router.Dockerfile")
                    .read_text()).group(1)
    dev = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]["dev"]
    assert f"vllm-router=={pin}" in dev
