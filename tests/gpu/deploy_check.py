"""Every deployed topology on a GPU host, started the way users start it (`run.sh deploy`).

  1. the launcher (`python -m scheduler_service.launch`, what `make serve` runs) with
     TP=1, then TP=2: cold start -> first streamed token; greedy tokens through gRPC
     (TP=2 against TP=1, equal up to the first bf16 near-tie); nano-vllm's workload
     through gRPC (client.bench); with TP=2 a SIGKILL of rank 1 mid-run, after which every
     request must finish with all its tokens (the launcher restarts the group, the
     scheduler re-prefills);
  2. the compose topology without a Docker engine: each worker its own process with
     docker-compose.yml's flags and only its GPU visible (as the container's device
     reservation gives it), the scheduler with the compose file's flags: a streamed
     answer, greedy tokens against TP=1.

    python tests/gpu/deploy_check.py --model DIR --out DIR [--skip-kill] [--runs N]

Exits non-zero if any check fails; the last lines are a table for tests/gpu/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from client.client import Client, NanoserveError, SamplingParams  # noqa: E402

PORT, WORKER_PORT, DIST_PORT = 50051, 50061, 29500
TARGET = f"127.0.0.1:{PORT}"
NEAR_TIE = 0.05          # nats between TP=1's top two choices: a bf16 near-tie
GREEDY_TOKENS = 48
PY = sys.executable
failures: list[str] = []
BENCH_ARGS: list[str] = []    # --bench-args
WORKER_ARGS: list[str] = []   # --worker-args (a CPU smoke run: --device cpu --kv-cache-gb 0.1)
SCHEDULER_ARGS: list[str] = []   # --scheduler-args (the launcher phases only)
LAUNCHER_ARGS: list[str] = []    # --launcher-args (e.g. --no-standby-workers)


def check(ok: bool, what: str) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)
    return ok


def start(cmd: list[str], log: pathlib.Path, env: dict | None = None) -> subprocess.Popen:
    """A process in a session of its own (so stop() ends it and everything it started)."""
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, **(env or {})), start_new_session=True)


def stop(*procs: subprocess.Popen, grace: float = 60.0) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    time.sleep(2)   # ports and the rendezvous store free again


def first_token(t0: float, procs: list[subprocess.Popen], limit: float = 600.0) -> float:
    """Seconds from t0 (processes started) to the first streamed token a client gets."""
    while time.monotonic() - t0 < limit:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited while starting")
        try:
            with Client(TARGET, timeout=30) as c:
                for chunk in c.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=1)):
                    if chunk.token_ids:
                        return time.monotonic() - t0
        except NanoserveError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"no token within {limit:.0f}s")


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10000) for _ in range(n)] for n in (37, 180, 411, 900)]


def greedy(adapter: str = "") -> list[dict]:
    """Per prompt: the greedy tokens and, per token, {id: logprob} of the top two (through
    `adapter`, if named)."""
    out = []
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                            logprobs=True, top_logprobs=2)
    with Client(TARGET, timeout=120) as c:
        for p in prompts():
            tokens, tops = [], []
            for chunk in c.generate(p, params, adapter=adapter):
                tokens += chunk.token_ids
                tops += chunk.top_logprobs
            out.append({"tokens": tokens, "top": tops})
    return out


def compare(ref: list[dict], got: list[dict], what: str) -> str:
    """Equal tokens, or a parting at a near-tie of the reference: TP=2 picked the
    reference's second choice and the two were within NEAR_TIE nats."""
    agreed = []
    for r, g in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r["tokens"], g["tokens"])) if a != b), None)
        if n is None:
            ok = len(r["tokens"]) == len(g["tokens"]) == GREEDY_TOKENS
            agreed.append(f"{len(r['tokens'])}/{GREEDY_TOKENS}")
        else:
            top = {int(k): v for k, v in r["top"][n].items()}
            gap = top[r["tokens"][n]] - top.get(g["tokens"][n], float("-inf"))
            ok = gap < NEAR_TIE
            agreed.append(f"{n} (tie {gap:.3f})")
        check(ok, f"{what}: greedy tokens equal to TP=1 up to a near-tie ({agreed[-1]})")
    return ", ".join(agreed)


def generated_tokens() -> int:
    with Client(TARGET, timeout=10) as c:
        return c.stats().num_generated_tokens


def bench(out: pathlib.Path, name: str, runs: int, gpu: str,
          kill: tuple[int, callable] | None = None) -> dict:
    """client.bench through gRPC; kill = (after how many generated tokens, action)."""
    base = generated_tokens()
    cmd = [PY, "-m", "client.bench", "--target", TARGET, "--runs", str(runs), "--no-progress",
           "--device-name", gpu, "--json", str(out / f"bench_{name}.json"), "--timeout", "600",
           *BENCH_ARGS]
    p = start(cmd, out / f"bench_{name}.txt")
    killed_at = None
    if kill is not None:
        while generated_tokens() - base < kill[0] and p.poll() is None:
            time.sleep(0.05)
        check(p.poll() is None, f"{name}: the benchmark was still running at the kill")
        kill[1]()
        killed_at = time.monotonic()
        # The group's steps stop with the kill: the count still moving 0.2 s later is only
        # a step that finished before it. Kill -> next token: the group is back and serving.
        time.sleep(0.2)
        stalled = generated_tokens()
        while generated_tokens() == stalled and p.poll() is None:
            time.sleep(0.05)
        next_token_s = time.monotonic() - killed_at
    rc = p.wait()
    ended = time.monotonic()
    report = json.loads((out / f"bench_{name}.json").read_text()) if rc == 0 else {}
    runs_ = report.get("runs", [])
    tok_s = sorted(r["output_tok_per_s"] for r in runs_)
    complete = all(r["output_tokens"] == r["expected_output_tokens"] for r in runs_) and runs_
    check(rc == 0 and bool(complete), f"{name}: client.bench finished every request with all "
                                      f"its tokens (rc {rc})")
    return {"tok_s": tok_s, "after_kill_s": ended - killed_at if killed_at else None,
            "next_token_s": next_token_s if killed_at else None}


def worker_pid(rank: int, launcher: subprocess.Popen) -> int:
    """The pid of the launcher's worker of this rank (its command line names --rank)."""
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if (b"worker_service" in argv and b"--rank" in argv and int(stat[1]) == launcher.pid
                and argv[argv.index(b"--rank") + 1] == str(rank).encode()):
            return int(d.name)
    raise RuntimeError(f"no worker of rank {rank} under the launcher")


def launcher_phase(args, tp: int, gpu: str, ref: list[dict] | None) -> tuple[list[dict], dict]:
    out = args.out
    cmd = [PY, "-m", "scheduler_service.launch", "--model", args.model, "--tp", str(tp),
           "--port", str(PORT), "--worker-base-port", str(WORKER_PORT),
           "--dist-port", str(DIST_PORT), "--worker-args", " ".join(["--max-model-len 4096", *WORKER_ARGS]),
           *LAUNCHER_ARGS, "--", "--max-model-len", "4096", *SCHEDULER_ARGS]
    t0 = time.monotonic()
    launcher = start(cmd, out / f"launch_tp{tp}.log")
    row: dict = {"topology": f"launcher TP={tp}"}
    try:
        row["cold_start_s"] = first_token(t0, [launcher])
        check(True, f"TP={tp}: first streamed token {row['cold_start_s']:.1f}s after launch")
        got = greedy(args.adapter)
        row["greedy"] = compare(ref, got, f"TP={tp}") if ref else "reference"
        row["bench"] = bench(out, f"tp{tp}", args.runs, gpu)
        if tp > 1 and not args.skip_kill:
            kill = (args.kill_after, lambda: os.kill(worker_pid(1, launcher), signal.SIGKILL))
            row["kill"] = bench(out, f"tp{tp}_kill_rank1", 1, gpu, kill)
        return got, row
    finally:
        stop(launcher)


def compose_phase(args, gpu: str, ref: list[dict]) -> dict:
    """docker-compose.yml's worker-0/worker-1/scheduler commands, hosts -> 127.0.0.1."""
    out, dist = args.out, f"tcp://127.0.0.1:{DIST_PORT}"
    t0 = time.monotonic()
    workers = [start([PY, "-m", "worker_service", "--model=" + args.model, "--host=0.0.0.0",
                      f"--port={WORKER_PORT + r}", "--kv-cache-dtype=auto", f"--rank={r}",
                      "--world-size=2", f"--dist-init={dist}", "--max-model-len=4096", *WORKER_ARGS],
                     out / f"compose_worker{r}.log", env={"CUDA_VISIBLE_DEVICES": str(r)})
               for r in range(2)]
    sched = start([PY, "-m", "scheduler_service", "--model=" + args.model, "--host=0.0.0.0",
                   f"--port={PORT}", "--http-port=8000", "--max-model-len=4096",
                   f"--workers=127.0.0.1:{WORKER_PORT},127.0.0.1:{WORKER_PORT + 1}"],
                  out / "compose_scheduler.log")
    row: dict = {"topology": "compose flags, TP=2"}
    try:
        row["cold_start_s"] = first_token(t0, [*workers, sched])
        check(True, f"compose: first streamed token {row['cold_start_s']:.1f}s after start")
        row["greedy"] = compare(ref, greedy(), "compose TP=2")
        return row
    finally:
        stop(sched)
        stop(*workers)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--runs", type=int, default=2, help="client.bench runs per topology")
    p.add_argument("--kill-after", type=int, default=50_000,
                   help="rank 1 is killed once the kill run has generated this many tokens "
                        "(nano-vllm's workload: 133,966 and a small warm-up)")
    p.add_argument("--skip-kill", action="store_true")
    p.add_argument("--skip-compose", action="store_true")
    p.add_argument("--tp", default="1,2", help="launcher TP sizes, in order (1 first)")
    p.add_argument("--bench-args", default="", help="extra client.bench flags (a smaller workload)")
    p.add_argument("--worker-args", default="", help="extra flags for every worker")
    p.add_argument("--adapter", default="",
                   help="the greedy comparison's requests name this LoRA adapter (give the "
                        "workers --max-loras and the scheduler --lora-modules)")
    p.add_argument("--scheduler-args", default="",
                   help="extra flags for the launcher's scheduler (e.g. --no-fast-forward)")
    p.add_argument("--launcher-args", default="",
                   help="extra flags for the launcher itself (e.g. --no-standby-workers)")
    args = p.parse_args()
    if args.adapter and not args.skip_compose:
        p.error("--adapter needs --skip-compose (the compose phase serves no adapters)")
    SCHEDULER_ARGS.extend(args.scheduler_args.split())
    LAUNCHER_ARGS.extend(args.launcher_args.split())
    BENCH_ARGS.extend(args.bench_args.split())
    WORKER_ARGS.extend(args.worker_args.split())
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.split("\n")[0]
    rows, ref = [], None
    for tp in [int(t) for t in args.tp.split(",")]:
        try:
            got, row = launcher_phase(args, tp, gpu, ref)
            ref = ref or got
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - report and go on to the next topology
            check(False, f"launcher TP={tp}: {type(e).__name__}: {e}")
    if ref and not args.skip_compose:
        try:
            rows.append(compose_phase(args, gpu, ref))
        except Exception as e:  # noqa: BLE001
            check(False, f"compose: {type(e).__name__}: {e}")
    (args.out / "deploy.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{gpu}, model {args.model}\n")
    print("| topology | cold start -> first token | greedy vs TP=1 (tokens equal before a tie) "
          "| gRPC output tok/s (min / median / max) | rank-1 SIGKILL mid-run |")
    print("|---|---|---|---|---|")
    for r in rows:
        b = r.get("bench", {}).get("tok_s") or []
        spread = " / ".join(f"{v:,.0f}" for v in (b[0], b[len(b) // 2], b[-1])) if b else "-"
        k = r.get("kill")
        kill = (f"all finished; kill -> next token {k['next_token_s']:.1f} s, -> last token "
                f"{k['after_kill_s']:.0f} s"
                if k and k["tok_s"] else "failed" if k else "-")
        print(f"| {r['topology']} | {r.get('cold_start_s', float('nan')):.1f} s | "
              f"{r.get('greedy', '-')} | {spread} | {kill} |")
    print(f"\n{len(failures)} failed check(s)" + (": " + "; ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
