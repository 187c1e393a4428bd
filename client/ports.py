"""Ports to tell a process up front (the demo's launcher, the tests' services).

A port the kernel hands out (bind to 0, then close) is in its ephemeral range, so until the
process told to listen there binds it, any outgoing connection on the host (gloo between
TP ranks, a gRPC channel) may take it as its source port, and the bind then fails with
"Address already in use" (seen once in CI). These ports come from below that range.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

_HANDED_OUT: set[int] = set()
_BLOCK = 8          # launchers count up from a base port (worker i, metrics of rank i)


def free_port() -> int:
    """A port that was free a moment ago, with the next few free too (a launcher counts
    up from a base port), below the ephemeral range, never one this process handed out
    before."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(500):
        if low - _BLOCK <= 10000:
            break
        port = rng.randrange(max(10000, low - 15000), low - _BLOCK)
        block = set(range(port, port + _BLOCK))
        if not block & _HANDED_OUT and all(_bindable(p) for p in block):
            _HANDED_OUT.update(block)
            return port
    with socket.socket() as s:   # an odd port range: the kernel's pick, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
