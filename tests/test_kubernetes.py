"""kubernetes.yaml, checked offline (no cluster can run here): every built-in resource
against the Kubernetes API's JSON schemas that kubernetes-validate bundles (strict: unknown
fields fail), the InferencePool against its v1 CRD's shape, every flag a container passes
through the services' own argparse parsers, and the pieces that must agree (ports, labels,
metric names, the TP layout)."""
from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "kubernetes.yaml"

# inference.networking.k8s.io/v1 InferencePool (gateway-api-inference-extension v1.0's CRD)
INFERENCE_POOL = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False,
                             "required": ["matchLabels"],
                             "properties": {"matchLabels": {
                                 "type": "object", "minProperties": 1,
                                 "additionalProperties": {"type": "string"}}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
                    "type": "object", "additionalProperties": False, "required": ["number"],
                    "properties": {"number": {"type": "integer", "minimum": 1,
                                              "maximum": 65535}}}},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": {"type": "string"}, "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "port": {"type": "object", "additionalProperties": False,
                                 "required": ["number"],
                                 "properties": {"number": {"type": "integer", "minimum": 1,
                                                           "maximum": 65535}}},
                        "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}}}


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    out = {}
    for d in yaml.safe_load_all(MANIFEST.read_text()):
        out[(d["kind"], d["metadata"]["name"])] = d
    return out


def test_one_manifest_at_the_top_level():
    assert MANIFEST.exists()
    assert not any(p.suffix in (".yaml", ".yml") and "kube" in p.name.lower()
                   for p in ROOT.glob("*/*"))


def test_built_in_resources_validate_strictly(docs):
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    checked = set()
    for (kind, name), d in docs.items():
        if d["apiVersion"].startswith("inference.networking"):
            continue
        kv.validate(d, version, strict=True)   # raises ValidationError
        checked.add(kind)
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role",
            "RoleBinding"} <= checked


def test_inference_pool_matches_its_crd_and_the_replicas(docs):
    pool = docs[("InferencePool", "nanoserve")]
    jsonschema.validate(pool, INFERENCE_POOL)
    pod = docs[("Deployment", "nanoserve")]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    sched = scheduler_args(docs)
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [sched.http_port]
    ref = pool["spec"]["endpointPickerRef"]
    epp_svc = docs[("Service", ref["name"])]
    assert ref["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    epp = docs[("Deployment", ref["name"])]["spec"]["template"]
    assert epp_svc["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    svc = docs[("Service", "nanoserve")]
    assert svc["spec"]["selector"].items() <= labels.items()


def containers(docs, name="nanoserve") -> dict[str, dict]:
    pod = docs[("Deployment", name)]["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def scheduler_args(docs):
    from scheduler_service.__main__ import parse_args
    cmd = containers(docs)["scheduler"]["command"]
    assert cmd[:3] == ["python", "-m", "scheduler_service"]
    return parse_args(cmd[3:])


def test_every_flag_parses_and_the_tp_layout_agrees(docs):
    from scheduler_service.kv_events import KVEventsConfig
    from worker_service.__main__ import parse_args as worker_args
    sched = scheduler_args(docs)
    assert KVEventsConfig.from_cli(sched.kv_events_config).active
    pod = docs[("Deployment", "nanoserve")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    workers = [c for n, c in containers(docs).items() if n.startswith("worker")]
    addrs = sched.workers.split(",")
    assert len(workers) == len(addrs) >= 1
    for rank, (c, addr) in enumerate(zip(workers, addrs)):
        assert c["command"][:3] == ["python", "-m", "worker_service"]
        w = worker_args(c["command"][3:])
        assert (w.rank, w.world_size) == (rank, len(addrs))
        assert addr == f"127.0.0.1:{w.port}", "the scheduler reaches each rank over loopback"
        assert w.dist_init == worker_args(workers[0]["command"][3:]).dist_init
        assert w.dist_init.startswith("tcp://127.0.0.1:"), "the ranks meet inside the pod"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, "one GPU per worker"
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", "the IPC volume"
        assert mounts["/model"] == "model"
        probe = c["startupProbe"]["exec"]["command"][-1]
        assert f"127.0.0.1:{w.port}" in probe, "each worker's probe asks its own port"
    c = containers(docs)["scheduler"]
    assert c["readinessProbe"]["grpc"] == {"port": sched.port, "service": "nanoserve.v1.Generation"}
    from scheduler_service.frontend import SERVICE_NAME
    assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == sched.port and ports["http"] == sched.http_port
    assert ports["metrics"] == sched.metrics_port > 0
    cfg = KVEventsConfig.from_cli(sched.kv_events_config)
    assert f"tcp://*:{ports['kv-events']}" == cfg.endpoint
    assert f"tcp://*:{ports['kv-replay']}" == cfg.replay_endpoint


def test_endpoint_picker_reads_metrics_the_scheduler_exports(docs):
    from scheduler_service import metrics
    sched = scheduler_args(docs)
    (epp,) = containers(docs, "nanoserve-epp").values()
    flags = dict(a[2:].split("=", 1) for a in epp["args"])
    exported = {m._name for m in (metrics.VLLM_WAITING, metrics.VLLM_KV_CACHE, metrics.VLLM_GPU_CACHE,
                                  metrics.VLLM_LORA_INFO)}
    for flag in ("total-queued-requests-metric", "kv-cache-usage-percentage-metric",
                 "lora-info-metric"):
        assert flags[flag] in exported, flag
    assert int(flags["model-server-metrics-port"]) == sched.metrics_port
    pool = docs[("InferencePool", "nanoserve")]
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert int(flags["grpc-port"]) == pool["spec"]["endpointPickerRef"]["port"]["number"]
    config = yaml.safe_load(docs[("ConfigMap", "nanoserve-epp")]["data"]["epp.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p["type"] for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        refs = [p["pluginRef"] for p in profile["plugins"]]
        assert set(refs) <= declared and refs[-1].endswith("picker")
    mount = {m["mountPath"] for m in epp["volumeMounts"]}
    assert str(Path(flags["config-file"]).parent) in mount
