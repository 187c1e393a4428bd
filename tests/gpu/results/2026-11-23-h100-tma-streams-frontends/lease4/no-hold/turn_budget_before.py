"""Keep a frontend's event-loop turns short, so it goes on accepting calls while it streams.

grpc.aio's server takes new calls one at a time, and each acceptance needs about three
turns of the event loop (request the call, its completion, the serving loop resuming).
A turn runs every callback that was ready when it began: when a decode step wakes every
stream at once, one turn writes a delta to each of them, and acceptance waits behind all
those writes. On a saturated host (the 2-core null-worker ceiling) turns of 10-40 ms
held acceptance of a 256-request burst to ~100 calls/s, so decode ran at a fraction of
its batch for seconds. Bounding the deltas per turn lets the acceptance chain in between;
a stream that waits longer is not slower, it sends more tokens in its next message.
"""
from __future__ import annotations

import asyncio
import collections


class TurnBudget:
    """At most `per_turn` grants per event-loop turn; later takers wait, first come first
    served, for the turns after. per_turn = 0: no limit."""

    def __init__(self, per_turn: int):
        self.per_turn = per_turn
        self.used = 0                   # grants in the current turn
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.armed = False              # a _next_turn callback is scheduled

    async def take(self) -> None:
        if not self.per_turn:
            return
        loop = asyncio.get_running_loop()
        if not self.armed:   # callbacks scheduled now run in the next turn: it resets the count
            self.armed = True
            loop.call_soon(self._next_turn)
        if self.used < self.per_turn and not self.waiting:
            self.used += 1
            return
        fut = loop.create_future()
        self.waiting.append(fut)
        await fut   # cancelled with its task (client gone): _next_turn skips it

    def _next_turn(self) -> None:
        self.used = 0
        while self.waiting and self.used < self.per_turn:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                self.used += 1
        if self.waiting or self.used:
            asyncio.get_running_loop().call_soon(self._next_turn)
        else:
            self.armed = False
