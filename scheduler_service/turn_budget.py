"""Keep a frontend's event-loop turns short, so it goes on accepting calls while it streams.

grpc.aio's server takes new calls one at a time, and each acceptance needs about three
turns of the event loop (request the call, its completion, the serving loop resuming).
A turn runs every callback that was ready when it began: when a decode step wakes every
stream at once, one turn writes a delta to each of them, and acceptance waits behind all
those writes. On a saturated host (the 2-core null-worker ceiling) turns of 10-40 ms
held acceptance of a 256-request burst to ~100 calls/s, so decode ran at a fraction of
its batch for seconds. Bounding the deltas per turn lets the acceptance chain in between;
a stream that waits longer is not slower, it sends more tokens in its next message.

A burst of new calls gets the loop to itself: a turn that follows one in which a call
started grants no writes, up to `HOLD_TURNS` turns in a row, so each acceptance waits for
a short turn rather than behind K writes. On the 2-core null-worker ceiling that admitted
the 256-request burst sooner (TTFT p99 median 1,189 -> 846 ms, mean decode batch 82 -> 95)
and the control plane's CPU per token fell 12% (tests/gpu/RESULTS.md); a stream sends the
tokens it held in one message. The cap keeps writes going under a steady flood of calls.

A stream's first delta does not queue: it is granted in the turn it asks, over the budget
(a turn held for arrivals excepted). Queued behind the running streams' writes, a new
request's first token waited up to a decode step's worth of them; against a 4 ms null
worker at 26 req/s on 2 cores, TTFT p99 median 57.3 -> 48.5 ms (9 runs a side), the 0 ms
ceiling unchanged.
"""
from __future__ import annotations

import asyncio
import collections


HOLD_TURNS = 8   # at most this many turns in a row without writes while calls arrive


class TurnBudget:
    """At most `per_turn` grants per event-loop turn; later takers wait, first come first
    served, for the turns after; none in a turn after a call arrived (`arrived`), at most
    HOLD_TURNS in a row. per_turn = 0: no limit, no holds."""

    def __init__(self, per_turn: int):
        self.per_turn = per_turn
        self.used = 0                   # grants in the current turn
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.armed = False              # a _next_turn callback is scheduled
        self.arrivals = 0               # calls started since the current turn began
        self.held = 0                   # turns in a row that granted nothing for them

    def arrived(self) -> None:
        """A new call started: the next turn is left to accepting more."""
        if self.per_turn:
            self.arrivals += 1
            self._arm()

    def _arm(self) -> None:   # callbacks scheduled now run in the next turn: it resets the count
        if not self.armed:
            self.armed = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    async def take(self, first: bool = False) -> None:
        """Wait for a grant. first: a stream's first delta (its time to first token) is
        granted at once, over the turn's budget and ahead of the queue, unless the turn is
        held for arrivals."""
        if not self.per_turn:
            return
        self._arm()
        if not self.held and (first or (self.used < self.per_turn and not self.waiting)):
            self.used += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        await fut   # cancelled with its task (client gone): _next_turn skips it

    def _next_turn(self) -> None:
        self.used = 0
        if self.arrivals and self.held < HOLD_TURNS:
            self.arrivals = 0
            self.held += 1
            asyncio.get_running_loop().call_soon(self._next_turn)
            return
        self.arrivals = self.held = 0
        while self.waiting and self.used < self.per_turn:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                self.used += 1
        if self.waiting or self.used:
            asyncio.get_running_loop().call_soon(self._next_turn)
        else:
            self.armed = False
