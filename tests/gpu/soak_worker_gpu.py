"""The CPU soak's request mix (tests/test_soak_worker.py: prompts of 1-300 ids, seeded
sampling, n = 2, penalties, logprobs, cancels, deadlines) against a GPU worker, several
rounds; after each: the worker's host RSS and its GPU memory (nvidia-smi's per-process
figure: torch's reserved pool + the CUDA context), both of which must stay flat after the
warm-up round (issue 35).

    python tests/gpu/soak_worker_gpu.py --model DIR [--rounds 10] [--streams 200]
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "protos")]

import test_soak_worker as soak  # noqa: E402
from services import Proc, engine_idle, rss_bytes, start_scheduler, wait_until  # noqa: E402


def gpu_mib(pid: int) -> int:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    rows = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
    return sum(int(m) for p, m in rows if int(p) == pid)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--streams", type=int, default=200)
    args = p.parse_args()
    soak.STREAMS = args.streams
    worker = Proc("worker", ["worker_service", "--model", args.model, "--port", "0",
                             "--max-model-len", "4096", "--log-level", "WARNING"]).start(timeout=600)
    sched = start_scheduler(pathlib.Path(args.model), [worker.port], block_size=256,
                            extra=["--max-model-len", "4096"])
    import grpc
    from nanoserve.v1 import generate_pb2_grpc
    rows = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)

            for r in range(args.rounds):
                t0 = time.monotonic()
                results = asyncio.run(soak.one_round(sched.port, seed=r))
                bad = [o for o in results if o != "ok"]
                ok = wait_until(lambda: engine_idle(stub), timeout=30)
                rows.append((r, time.monotonic() - t0, rss_bytes(worker.popen.pid) >> 20,
                             gpu_mib(worker.popen.pid), len(bad), ok))
                print(f"round {r}: {rows[-1][1]:.1f}s worker RSS {rows[-1][2]} MiB, GPU "
                      f"{rows[-1][3]} MiB, bad {len(bad)} {bad[:2]}, idle {ok}", flush=True)
    finally:
        sched.stop()
        worker.stop()
    print("\n| round | s | worker RSS MiB | worker GPU MiB | failed streams |\n|---|---|---|---|---|")
    for r, s, rss, gpu, bad, _ in rows:
        print(f"| {r} | {s:.1f} | {rss} | {gpu} | {bad} |")
    after = rows[1:]
    flat = (max(x[2] for x in after) - min(x[2] for x in after) <= 32      # MiB: "a few MB",
            and max(x[3] for x in after) - min(x[3] for x in after) <= 16)  # not a trend
    print(f"\nafter warm-up: RSS {min(x[2] for x in after)}-{max(x[2] for x in after)} MiB, GPU "
          f"{min(x[3] for x in after)}-{max(x[3] for x in after)} MiB: {'flat' if flat else 'NOT flat'}")
    return 0 if flat and not any(x[4] for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
