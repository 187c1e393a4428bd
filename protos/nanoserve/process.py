"""Linux process attributes both planes set on themselves (prctl): a name `ps`/`top` show,
and no outliving the parent. No-ops elsewhere."""
from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1


def _prctl(option: int, arg) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)
        except OSError:
            pass


def set_name(name: str) -> None:
    """The process's name (/proc/PID/comm): ns-<name>, 15 characters at most."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(("ns-" + name.replace(" ", "-")).encode()[:15]))


def die_with_parent() -> None:
    """Linux sends SIGTERM when the parent dies, even by SIGKILL."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
