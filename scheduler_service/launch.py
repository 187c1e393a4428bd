"""python -m scheduler_service.launch: a whole deployment on one host, without Docker.

Starts one worker process per tensor-parallel rank and the scheduler (control plane), as
children of this process, and keeps them up: a worker that exits takes its whole TP group
down and the group is restarted (a collective group cannot take back one member), the
control plane is restarted on its own; both after a backoff (supervision.RestartPolicy).
A restarted group starts from spare worker processes that did their imports while the old
one served (--standby-workers).
Meanwhile the scheduler keeps every request and re-prefills it once the workers are back,
so clients see a pause. It stops on Ctrl-C / SIGTERM, or when a group crash-loops; SIGHUP
goes on to the scheduler (it re-reads --api-keys). This is
what `make serve` and `make demo` run; docker-compose.yml is the same layout in containers.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from nanoserve import cli
from scheduler_service.supervision import RestartPolicy

# A worker that refuses its configuration exits with this (sysexits EX_CONFIG; the planes do
# not import each other, tests/test_supervision.py checks it equals the worker's): a restart
# would only repeat the refusal, so the launcher stops with the worker's reason on its stderr.
EXIT_CONFIG = 78


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_service.launch",
        description="Run N worker services (one per GPU / tensor-parallel rank) and the "
                    "scheduler service on this host. Extra scheduler flags go after '--'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (number of workers)")
    cli.add_listen_flags(p, 50051, "the scheduler's public gRPC API")
    cli.add_http_port_flag(p)
    p.add_argument("--worker-base-port", type=int, default=50061,
                   help="worker i listens on this port + i")
    p.add_argument("--dist-port", type=int, default=29500, help="torch.distributed rendezvous port")
    p.add_argument("--device", default=None,
                   help="worker device: cuda (rank i uses cuda:i) or cpu (default: cuda if present)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="every worker's KV cache: auto = the model's dtype; fp8 = e4m3 with a "
                        "scale per token, ~2x the blocks (sm_89+ GPUs)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "fp8"],
                   help="every worker's weights: auto = as the checkpoint is; fp8 = e4m3 linear "
                        "layers, per-channel scales (sm_89+ GPUs)")
    p.add_argument("--deterministic", action="store_true",
                   help="every worker runs batch-invariant kernels (worker --deterministic): a "
                        "request's greedy or seeded answer does not depend on the load; TP=1")
    p.add_argument("--draft-model", default="", metavar="DIR",
                   help="speculative decoding with this draft model (a smaller model sharing the "
                        "model's tokenizer, e.g. Qwen3-0.6B for Qwen3-8B): every worker loads it "
                        "(--draft-model) and the scheduler proposes with it (--speculative "
                        "draft; tune with --num-speculative-tokens after '--')")
    p.add_argument("--worker-args", default="",
                   help="extra flags for every worker, e.g. '--dtype bfloat16 --kv-cache-gb 2'")
    sup = p.add_argument_group(
        "supervision and metrics",
        "A worker that exits is restarted with its whole TP group (its other ranks are "
        "SIGKILLed: a broken group holds nothing to drain), the scheduler on its own, "
        "after a delay doubling from 0.5 s (at most 10 s); a group that exits more than "
        "--max-restarts times within --restart-window seconds is a crash loop and stops "
        "the launcher (status 1).")
    sup.add_argument("--standby-workers", action=argparse.BooleanOptionalAction, default=True,
                     help="once the workers listen, keep a spare process per rank that has "
                          "imported torch and the model code (4-6 s on a GPU host) and waits, "
                          "without touching a GPU (ps: ns-standby-<rank>); a restarted group "
                          "starts from the spares")
    sup.add_argument("--max-restarts", type=int, default=5,
                     help="restarts of one group within --restart-window before giving up")
    sup.add_argument("--restart-window", type=float, default=60.0,
                     help="seconds over which --max-restarts is counted")
    cli.add_metrics_flags(sup, "the scheduler on this port, worker rank i on this port + 1 + i")
    sec = p.add_argument_group(
        "security", "passed to the scheduler (see python -m scheduler_service --help)")
    cli.add_api_key_flag(sec)
    cli.add_tls_flags(sec, "the public port")
    cli.add_adapter_root_flag(sec)
    cli.add_worker_secret_flag(sec, otherwise=", else a random one per launch, so other local "
                                              "users cannot drive the workers")
    p.add_argument("scheduler_args", nargs=argparse.REMAINDER,
                   help="extra flags for the scheduler, after '--' (e.g. -- --block-size 16)")
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error("--tp must be >= 1")
    cli.check_adapter_root(p, args)
    if args.scheduler_args and args.scheduler_args[0] == "--":
        args.scheduler_args = args.scheduler_args[1:]
    return args


def commands(args: argparse.Namespace) -> list[list[str]]:
    """The worker commands (rank order) and, last, the scheduler command."""
    py = sys.executable
    cmds = []
    for rank in range(args.tp):
        cmd = [py, "-m", "worker_service", "--model", args.model, "--rank", str(rank),
               "--world-size", str(args.tp), "--port", str(args.worker_base_port + rank),
               "--dist-init", f"tcp://127.0.0.1:{args.dist_port}"]
        if args.device == "cpu":
            cmd += ["--device", "cpu"]
        elif args.device:
            cmd += ["--device", f"{args.device.split(':')[0]}:{rank}" if args.device.startswith("cuda")
                    else args.device]
        if args.metrics_port:
            cmd += ["--metrics-port", str(args.metrics_port + 1 + rank)]
        if args.kv_cache_dtype != "auto":
            cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
        if args.quantization != "auto":
            cmd += ["--quantization", args.quantization]
        if args.draft_model:
            cmd += ["--draft-model", args.draft_model]
        if args.deterministic:
            cmd += ["--deterministic"]
        cmds.append(cmd + args.worker_args.split())
    workers = ",".join(f"127.0.0.1:{args.worker_base_port + r}" for r in range(args.tp))
    sched = [py, "-m", "scheduler_service", "--model", args.model, "--workers", workers,
             "--host", args.host, "--port", str(args.port)]
    if args.http_port is not None:
        sched += ["--http-port", str(args.http_port)]
    if args.metrics_port:
        sched += ["--metrics-port", str(args.metrics_port)]
    sched += [a for flag, v in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                                ("--tls-client-ca", args.tls_client_ca),
                                ("--adapter-root", args.adapter_root)) if v for a in (flag, v)]
    if args.draft_model:
        sched += ["--speculative", "draft"]
    cmds.append(sched + list(args.scheduler_args))
    return cmds


@dataclass
class Unit:
    """Processes started, stopped and restarted together: the TP group, or the scheduler."""
    name: str
    cmds: list[list[str]]
    policy: RestartPolicy
    env: dict[str, str]                 # secrets travel here, not on command lines (`ps`)
    standby_ports: list[int] = field(default_factory=list)   # workers' ports; [] = no spares
    procs: list[subprocess.Popen] = field(default_factory=list)
    spares: list[subprocess.Popen] = field(default_factory=list)   # worker --standby, rank order
    restart_at: float | None = None     # when a stopped unit comes back

    def start(self) -> None:
        """Wake the spares (their imports are done) or, lacking one, start afresh."""
        self.procs, self.spares = self.spares, []
        if not self._wake():
            self.stop(grace=1.0)   # a spare that died, if any, and the rest
            self.procs = [subprocess.Popen(cmd, env=self.env) for cmd in self.cmds]
        self.restart_at = None

    def _wake(self) -> bool:
        try:
            for p in self.procs:
                p.stdin.write(b"go\n")
                p.stdin.close()
        except OSError:   # a spare died: its pipe is closed
            return False
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def keep_spares(self) -> None:
        """Once every rank listens (start-up's CPU work is done), start a spare per rank."""
        if (self.standby_ports and not self.spares and self.restart_at is None
                and all(_listening(port) for port in self.standby_ports)):
            self.spares = [subprocess.Popen(cmd + ["--standby"], env=self.env,
                                            stdin=subprocess.PIPE) for cmd in self.cmds]

    def exited(self) -> subprocess.Popen | None:
        return next((p for p in self.procs if p.poll() is not None), None)

    def stop(self, grace: float, spares: bool = False) -> None:
        """SIGTERM, then SIGKILL after `grace` s: a rank blocked in a collective whose peer
        is gone may never get to its signal handler. grace 0: SIGKILL at once. The spares
        too where asked."""
        procs = self.procs + (self.spares if spares else [])
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        if spares:
            self.spares = []


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _describe(p: subprocess.Popen) -> str:
    code = p.returncode
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def secrets_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's environment: secrets travel there, not on command lines (`ps`)."""
    env = dict(os.environ)
    env[cli.WORKER_SECRET_ENV] = args.worker_secret or secrets.token_urlsafe(24)
    if args.api_key:
        env[cli.API_KEY_ENV] = args.api_key
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cmds = commands(args)
    env = secrets_env(args)   # once: a restarted worker gets the same secret
    policy = lambda: RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window)
    ports = [args.worker_base_port + r for r in range(args.tp)] if args.standby_workers else []
    workers = Unit("worker group" if args.tp > 1 else "worker", cmds[:-1], policy(), env, ports)
    scheduler = Unit("scheduler", cmds[-1:], policy(), env)
    units = [workers, scheduler]
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    def hangup(*_):   # the scheduler re-reads --api-keys (its streams keep running)
        for p in scheduler.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, hangup)
    for u in units:
        u.start()
    code = 0
    while not stopping:
        now = time.monotonic()
        for u in units:
            if u.restart_at is not None:
                if now >= u.restart_at:
                    log(f"restarting the {u.name}")
                    u.start()
                continue
            dead = u.exited()
            if dead is None:
                u.keep_spares()
                continue
            which = (f"rank {u.procs.index(dead)} " if len(u.procs) > 1 else "")
            if dead.returncode == EXIT_CONFIG:
                log(f"the {u.name} {which}refused its configuration (exit status {EXIT_CONFIG}, "
                    "the reason is above): not restarting, stopping")
                stopping, code = True, 1
                break
            delay = u.policy.next_delay(now)
            if delay is None:
                log(f"the {u.name} {which}exited ({_describe(dead)}) more than "
                    f"{args.max_restarts} times in {args.restart_window:g}s: crash loop, stopping")
                stopping, code = True, 1
                break
            log(f"the {u.name} {which}exited ({_describe(dead)}); restarting "
                f"{'all ranks ' if len(u.procs) > 1 else ''}in {delay:.1f}s")
            # A broken group has nothing to drain (the scheduler holds the requests), and a
            # survivor stuck in a collective with its dead peer never got through SIGTERM's
            # 1 s of grace on a GPU (its server waits for the stuck Step stream): kill it.
            u.stop(grace=0.0)
            u.restart_at = time.monotonic() + delay
        time.sleep(0.1)
    # Scheduler first (it drains requests), then the workers.
    scheduler.stop(grace=30.0)
    workers.stop(grace=30.0, spares=True)
    return code


def log(msg: str) -> None:
    print(f"launch: {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
