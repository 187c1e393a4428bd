"""Scale-out over whole replicas: the client's round_robin over two control planes, and the
compose profile `replicas` with Envoy in front (checked without Docker or Envoy).

Two replicas on loopback, each a control plane with its own null worker: calls spread over
both (each replica's GetStats counts its share), every answer is exactly the null worker's
tokens, and after one replica is SIGKILLed (supervisor, engine core, frontends, worker:
a host going away) every call still succeeds, on the survivor.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time

import pytest
import yaml

from client.client import Client, SamplingParams, channel_target
from client.null_model import write_null_model
from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import ROOT, children, start_null_worker, start_scheduler, wait_until
from test_compose import compose_config
from worker_service.null_worker import expected_tokens

VOCAB, MAX_TOKENS = 1000, 6


def generated(port: int) -> int:
    import grpc
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stats = generate_pb2_grpc.GenerationStub(ch).GetStats(generate_pb2.StatsRequest(), timeout=5)
    return stats.num_generated_tokens


def kill_replica(sched, worker) -> None:
    """SIGKILL every process of one replica at once (its supervisor's children first)."""
    for pid in children(sched.popen.pid) + [sched.popen.pid, worker.popen.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sched.popen.wait(10)
    worker.popen.wait(10)


@pytest.mark.slow
def test_round_robin_spreads_calls_and_survives_a_replica_death(tmp_path):
    model_dir = write_null_model(tmp_path / "m", vocab_size=VOCAB, max_position_embeddings=256)
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    replicas = []
    try:
        for _ in range(2):
            worker = start_null_worker(model_dir, step_ms=1)
            replicas.append((start_scheduler(model_dir, [worker.port], block_size=16), worker))
        ports = [s.port for s, _ in replicas]
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        with Client([f"127.0.0.1:{p}" for p in ports], timeout=30) as client:
            assert client.target == f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"

            def call(i: int, params: SamplingParams = params) -> None:
                prompt = [1 + i % 50, 2, 3]
                out = client.complete(prompt, params)
                assert out.token_ids == expected_tokens(prompt, params.max_tokens, VOCAB, eos)

            for i in range(20):
                call(i)
            shares = [generated(p) // MAX_TOKENS for p in ports]
            assert sum(shares) == 20 and min(shares) >= 5, shares   # round robin: ~10 each

            # Calls in flight on both replicas when one dies: those on the dead one have
            # no answer yet (unary), so they are retried on the survivor.
            long = SamplingParams(max_tokens=60, ignore_eos=True)   # ~60+ ms each
            before = generated(ports[1])
            with cf.ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(call, i, long) for i in range(36)]
                time.sleep(0.15)
                kill_replica(*replicas[0])
                for f in futures:
                    f.result()
            assert generated(ports[1]) > before
            before = generated(ports[1])
            for i in range(20):   # all on the survivor now
                call(i)
            assert generated(ports[1]) - before == 20 * MAX_TOKENS
            # Streams too.
            chunks = list(client.generate([7, 8, 9], params))
            assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS
    finally:
        for sched, worker in replicas:
            sched.stop()
            worker.stop()


def test_channel_target_forms():
    assert channel_target("127.0.0.1:50051") == ("127.0.0.1:50051", [])
    target, options = channel_target("localhost:1,127.0.0.1:2")
    assert target == "ipv4:127.0.0.1:1,127.0.0.1:2"
    config = json.loads(dict(options)["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": "nanoserve.v1.Generation"}
    assert config["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert channel_target(["127.0.0.1:1", "127.0.0.1:2"])[0] == target
    assert channel_target("ipv4:10.0.0.1:1,10.0.0.2:1") == ("ipv4:10.0.0.1:1,10.0.0.2:1", [])
    uri, options = channel_target("dns:///nanoserve:50051")
    assert uri == "dns:///nanoserve:50051" and "grpc.service_config" in dict(options)
    with pytest.raises(ValueError):
        channel_target("127.0.0.1,127.0.0.1:2")


# ---------------------------------------------------------------------------- compose + Envoy
@pytest.fixture(scope="module")
def replicas_config(tmp_path_factory):
    proc = compose_config(["docker-compose.yml"], str(tmp_path_factory.mktemp("model")),
                          profiles=["replicas"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def flags(cmd: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)


def test_replicas_profile_runs_two_independent_replicas(replicas_config):
    services = replicas_config
    scheds = {n: flags(s["command"]) for n, s in services.items()
              if "scheduler_service" in s.get("command", [])}
    assert set(scheds) == {"scheduler", "scheduler-b"}
    workers = {n: s for n, s in services.items() if "worker_service" in s.get("command", [])}
    gpus = []
    for name, f in scheds.items():
        mine = f["workers"].split(",")
        assert len(mine) == 2 and all(w.rsplit(":", 1)[0] in workers for w in mine), name
        assert set(services[name]["depends_on"]) == {w.rsplit(":", 1)[0] for w in mine}
        inits = {flags(workers[w.rsplit(":", 1)[0]]["command"])["dist-init"] for w in mine}
        assert inits == {f"tcp://{mine[0].rsplit(':', 1)[0]}:29500"}, "one rendezvous per replica"
        for w in mine:
            gpus += workers[w.rsplit(":", 1)[0]]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        assert f["http-port"] == "8000" and f["port"] == "50051"
    assert sorted(gpus) == ["0", "1", "2", "3"], "every worker its own GPU"
    assert not services["scheduler-b"].get("ports"), "replica b is reached through Envoy only"
    envoy = services["envoy"]
    assert set(envoy["depends_on"]) == set(scheds)
    assert all(v["condition"] == "service_healthy" for v in envoy["depends_on"].values())
    (mount,) = envoy["volumes"]
    assert mount["source"] == str(ROOT / "scheduler_service" / "envoy.yaml") and mount["read_only"]
    assert envoy["command"][envoy["command"].index("-c") + 1] == mount["target"]


def test_envoy_config_balances_both_replicas_with_grpc_health_checks(replicas_config):
    config = yaml.safe_load((ROOT / "scheduler_service" / "envoy.yaml").read_text())
    res = config["static_resources"]
    clusters = {c["name"]: c for c in res["clusters"]}
    listeners = {l["name"]: l for l in res["listeners"]}
    published = {int(p["target"]) for p in replicas_config["envoy"]["ports"]}

    def route_cluster(listener: dict) -> str:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
        assert route["route"]["timeout"] == "0s", "long streams must not be cut"
        assert hcm["http_filters"][-1]["name"] == "envoy.filters.http.router"
        return route["route"]["cluster"]

    def endpoints(cluster: dict) -> set[tuple[str, int]]:
        return {(e["endpoint"]["address"]["socket_address"]["address"],
                 e["endpoint"]["address"]["socket_address"]["port_value"])
                for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]}

    grpc_listener = next(l for l in listeners.values()
                         if clusters[route_cluster(l)].get("typed_extension_protocol_options"))
    assert grpc_listener["address"]["socket_address"]["port_value"] in published
    grpc_cluster = clusters[route_cluster(grpc_listener)]
    opts = grpc_cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in opts["explicit_http_config"], "gRPC needs HTTP/2 upstream"
    assert endpoints(grpc_cluster) == {("scheduler", 50051), ("scheduler-b", 50051)}
    (check,) = grpc_cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == "nanoserve.v1.Generation"
    from scheduler_service.frontend import SERVICE_NAME
    assert check["grpc_health_check"]["service_name"] == SERVICE_NAME

    http_listener = next(l for l in listeners.values() if l is not grpc_listener)
    assert http_listener["address"]["socket_address"]["port_value"] in published
    http_cluster = clusters[route_cluster(http_listener)]
    assert endpoints(http_cluster) == {("scheduler", 8000), ("scheduler-b", 8000)}
    assert http_cluster["health_checks"][0]["http_health_check"]["path"] == "/health"
