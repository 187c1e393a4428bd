"""python -m scheduler_service.launch: a whole deployment on one host, without Docker.

Starts one worker process per tensor-parallel rank and the scheduler, as children of
this process, and stops them all on Ctrl-C / SIGTERM or when any of them dies. This is
what `make serve` and `make demo` run; docker-compose.yml is the same layout in containers.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_service.launch",
        description="Run N worker services (one per GPU / tensor-parallel rank) and the "
                    "scheduler service on this host. Extra scheduler flags go after '--'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (number of workers)")
    p.add_argument("--host", default="127.0.0.1", help="scheduler listen address")
    p.add_argument("--port", type=int, default=50051, help="scheduler port (public API)")
    p.add_argument("--worker-base-port", type=int, default=50061,
                   help="worker i listens on this port + i")
    p.add_argument("--dist-port", type=int, default=29500, help="torch.distributed rendezvous port")
    p.add_argument("--device", default=None,
                   help="worker device: cuda (rank i uses cuda:i) or cpu (default: cuda if present)")
    p.add_argument("--worker-args", default="",
                   help="extra flags for every worker, e.g. '--dtype bfloat16 --kv-cache-gb 2'")
    sec = p.add_argument_group(
        "security", "passed to the scheduler (see python -m scheduler_service --help)")
    sec.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                     help="public API key (default: $NANOSERVE_API_KEY; none = open)%(default).0s")
    sec.add_argument("--tls-cert", default=None, help="PEM certificate: TLS on the public port")
    sec.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    sec.add_argument("--tls-client-ca", default=None,
                     help="PEM CA: public clients must present a certificate it signed")
    sec.add_argument("--worker-secret", default=os.environ.get("NANOSERVE_WORKER_SECRET"),
                     help="secret between the scheduler and its workers (default: "
                          "$NANOSERVE_WORKER_SECRET, else a random one per launch, so other "
                          "local users cannot drive the workers)%(default).0s")
    p.add_argument("scheduler_args", nargs=argparse.REMAINDER,
                   help="extra flags for the scheduler, after '--' (e.g. -- --block-size 16)")
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error("--tp must be >= 1")
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
        cmds.append(cmd + args.worker_args.split())
    workers = ",".join(f"127.0.0.1:{args.worker_base_port + r}" for r in range(args.tp))
    tls = [a for flag, v in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                             ("--tls-client-ca", args.tls_client_ca)) if v for a in (flag, v)]
    cmds.append([py, "-m", "scheduler_service", "--model", args.model, "--workers", workers,
                 "--host", args.host, "--port", str(args.port), *tls, *args.scheduler_args])
    return cmds


def secrets_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's environment: secrets travel there, not on command lines (`ps`)."""
    env = dict(os.environ, NANOSERVE_WORKER_SECRET=args.worker_secret or secrets.token_urlsafe(24))
    if args.api_key:
        env["NANOSERVE_API_KEY"] = args.api_key
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = secrets_env(args)
    procs = [subprocess.Popen(cmd, env=env) for cmd in commands(args)]
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while not stopping:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            code = dead[0].returncode or 1
            print(f"launch: {' '.join(dead[0].args[1:4])} exited with {dead[0].returncode}; "
                  "stopping the rest", file=sys.stderr)
            break
        time.sleep(0.2)
    # Scheduler first (it drains requests), then the workers.
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
