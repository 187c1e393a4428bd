"""CPU seconds of a benchmark's processes, by name (Linux /proc; elsewhere only our own).

On a host that runs the load generator, the control plane and a null worker side by side,
throughput alone does not say whose CPU set it: these counters do. The control plane
names its children (supervision.child_setup: ns-engine-core, ns-frontend-N), so a
process tree reads as {"engine-core": s, "frontend-0": s, ...}.
"""
from __future__ import annotations

import os
import resource
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def host_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def python_speed(seconds: float = 0.05) -> float:
    """Millions of iterations a second of a fixed pure-Python loop on one core: how fast
    this host runs Python at the moment. On the 2-core VM the same control plane's 0 ms
    ceiling halved within an hour while vmstat showed no steal time; read after each run,
    this tells a slow hour from a slower change."""
    loops, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        x = 0
        for i in range(10_000):
            x += i & 7
        loops += 10_000
    return loops / elapsed / 1e6


def own_cpu_s() -> float:
    """This process's CPU seconds, with its children that have been waited for (the bench's
    --client-procs processes, joined after each run)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def _cpu_s(pid: int) -> float:
    """utime + stime of a live process; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    """Direct child processes of pid (OSError once pid is gone)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def comm(pid: int) -> str:
    """The name pid gave itself ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def tree_cpu_s(roots: dict[str, int]) -> dict[str, float]:
    """{name: CPU seconds} over each root's process tree: a root under its given name, a
    descendant named ns-X under X, any other descendant added to its parent's name."""
    out: dict[str, float] = {}

    def walk(pid: int, name: str) -> None:
        out[name] = out.get(name, 0.0) + _cpu_s(pid)
        try:
            kids = children(pid)
        except OSError:   # gone while we looked
            kids = []
        for child in kids:
            own = comm(child)
            walk(child, own[3:] if own.startswith("ns-") else name)

    for name, pid in roots.items():
        walk(pid, name)
    return out


def diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}
