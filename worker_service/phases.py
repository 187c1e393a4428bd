"""Start-up phases timed by name: the worker logs them in one line, so a slow start says
where its seconds went."""
from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def phase(phases: dict[str, float], name: str):
    """Time a start-up phase into `phases` (seconds)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


def phases_line(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + \
        f"; total {sum(phases.values()):.1f} s"
