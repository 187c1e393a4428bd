"""client.bench with every Triton compile logged: when (seconds since start), which kernel,
its specialization key and the call path, with a marker where the warm-up and each run
begin. A compile after the warm-up marker is a request waiting on the compiler.
    python tests/gpu/log_compiles.py <client.bench args> 2> compiles.log
"""
from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from triton import knobs  # noqa: E402

import client.bench as bench  # noqa: E402

T0 = time.time()


def _log(tag: str, text: str) -> None:
    sys.stderr.write(f"[{tag}] t={time.time() - T0:.2f}s {text}\n")


def _compiled(*_, **kw) -> bool:
    ours = [f.name for f in traceback.extract_stack()
            if any(d in f.filename for d in ("models/", "kernels/", "worker_service/"))][-6:]
    _log("compile", f"{kw['fn'].name} key={str(kw.get('key'))[:700]} via {'>'.join(ours)}")
    return False   # False: compile and run as usual


def _marked(fn, what):
    def wrapper(*a, **k):
        _log("marker", f"run {a[1]}" if what == "run" else what)
        return fn(*a, **k)
    return wrapper


knobs.runtime.jit_post_compile_hook = _compiled
bench.for_run = _marked(bench.for_run, "run")
bench.warmup_workload = _marked(bench.warmup_workload, "warmup")

if __name__ == "__main__":
    sys.exit(bench.main(sys.argv[1:]))
