"""A precise asyncio wait until a point on time.perf_counter()'s clock (the null worker's
emulated device finishing a step).

asyncio.sleep cannot wait less than a millisecond: the loop's epoll timeout is rounded up
to whole milliseconds, so a 0.3 ms step answered through it came back 0.37 ms late at the
median (null worker, 2-core VM), and that lateness, which a real worker waiting on a CUDA
event does not have, was charged to the control plane. A Linux timerfd armed at the
absolute deadline wakes the same epoll with the kernel's hrtimer precision, on the loop's
own thread. Elsewhere (no timerfd) it falls back to asyncio.sleep.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import time

_CLOCK_MONOTONIC = 1          # what time.perf_counter() reads on Linux
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create, libc.timerfd_settime   # noqa: B018 - present?
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc() if os.name == "posix" else None


class DeviceClock:
    """`await clock.until(t)`: returns once time.perf_counter() >= t. One per Step stream
    (its waits are sequential); close() when the stream ends."""

    def __init__(self) -> None:
        self.fd = -1
        if _LIBC is not None and time.get_clock_info("perf_counter").implementation == \
                "clock_gettime(CLOCK_MONOTONIC)":
            self.fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        self._spec = _Itimerspec()

    async def until(self, deadline: float) -> None:
        if deadline <= time.perf_counter():
            return
        if self.fd < 0:
            await asyncio.sleep(deadline - time.perf_counter())
            return
        sec = int(deadline)
        self._spec.it_value.tv_sec = sec
        self._spec.it_value.tv_nsec = int((deadline - sec) * 1e9)
        if _LIBC.timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None):
            await asyncio.sleep(deadline - time.perf_counter())
            return
        loop = asyncio.get_running_loop()
        fired = loop.create_future()
        loop.add_reader(self.fd, _fire, self.fd, fired)
        try:
            await fired
        finally:
            loop.remove_reader(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _fire(fd: int, fired: asyncio.Future) -> None:
    try:
        os.read(fd, 8)   # the expiry count: re-arms the fd's readiness
    except BlockingIOError:
        return
    if not fired.done():
        fired.set_result(None)
