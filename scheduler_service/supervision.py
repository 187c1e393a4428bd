"""Keeping child processes alive: restart with backoff, give up on a crash loop.

Used by the control plane's supervisor (engine core + frontends) and by the one-host
launcher (workers + control plane). A child that exits is restarted after a delay that
doubles with each quick failure; a child that failed `max_restarts` times within
`window_s` is a crash loop, and the supervisor stops instead of spinning.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from nanoserve import process


def child_setup(log_level: str, name: str) -> None:
    """First thing in a supervised child process: a name `ps`/`top` show (ns-<name>, 15
    characters at most), logging like the parent's, and no outliving the parent (Linux
    sends SIGTERM when it dies, even by SIGKILL)."""
    process.die_with_parent()
    process.set_name(name)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(name)s[{name}] %(levelname)s %(message)s")


@dataclass
class RestartPolicy:
    """When to restart a child that exited, and when to stop trying."""
    max_restarts: int = 5          # within window_s: more is a crash loop
    window_s: float = 60.0
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    _recent: deque = field(default_factory=deque)

    def next_delay(self, now: float | None = None) -> float | None:
        """Seconds to wait before the restart, or None: a crash loop, give up."""
        now = time.monotonic() if now is None else now
        while self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            return None
        delay = min(self.first_delay_s * 2 ** len(self._recent), self.max_delay_s)
        self._recent.append(now)
        return delay
