"""The waiting queue: priority classes first, fair shares between API keys inside a class.

Order (what `head` returns next):
  1. a sequence that holds KV blocks while waiting (mid chunked prefill, or its blocks
     coming back from the host tier) continues first: anything else could stall on the
     blocks it holds;
  2. the lowest `priority` value (vLLM's meaning: lower = earlier, default 0);
  3. inside a class, the key (`SamplingOptions.tenant`) with the smallest virtual token
     counter (VTC, Sheng et al., OSDI '24): a key's counter grows by the tokens computed
     for it, so keys saturating the deployment get equal tokens, and a key that only just
     arrived is lifted to the smallest counter of the keys waiting (no credit for having
     been idle). Nothing is ever held back: one key alone is served at full speed;
  4. arrival (`Sequence.order`): a preempted sequence goes back to its own place, ahead
     of everything of its class and key that arrived after it.

One deque per (class, key), in arrival order, so a head is found in O(classes + keys).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from scheduler_service.sequence import Sequence


class WaitQueue:
    def __init__(self):
        self._classes: dict[int, dict[str, deque[Sequence]]] = {}
        self._len = 0
        self._pinned: Sequence | None = None
        self.counters: dict[str, float] = {}   # VTC: tokens computed per key (virtual)
        self._floor = 0.0   # the counter of the key admitted last (nobody waiting: the lift)

    # ---- deque-like surface the scheduler (and tests) use ---------------------------------

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence, by class, then arrival (not fair-share order)."""
        for p in sorted(self._classes):
            yield from heapq.merge(*self._classes[p].values(), key=lambda s: s.order)

    def append(self, seq: Sequence) -> None:
        """Queue seq at its place (a preempted one goes back ahead of later arrivals)."""
        keys = self._classes.setdefault(seq.sampling.priority, {})
        tenant = seq.sampling.tenant
        q = keys.get(tenant)
        if q is None:
            q = keys[tenant] = deque()
            self._lift(tenant)
        if not q or q[-1].order < seq.order:
            q.append(seq)
        else:   # rare: a preempted sequence, usually near the front
            i = next(i for i, s in enumerate(q) if s.order > seq.order)
            q.insert(i, seq)
        self._len += 1

    appendleft = append

    def put_back(self, seqs: list[Sequence]) -> None:
        """Return seqs, taken from the head in that order (and waiting still: the scheduler
        deferred them for a step), to their places. Their keys' counters are not lifted:
        they never stopped waiting."""
        for seq in reversed(seqs):
            keys = self._classes.setdefault(seq.sampling.priority, {})
            q = keys.setdefault(seq.sampling.tenant, deque())
            if not q or q[0].order > seq.order:
                q.appendleft(seq)
            else:   # rare: an older sequence was preempted into the queue meanwhile
                q.insert(next((i for i, s in enumerate(q) if s.order > seq.order), len(q)), seq)
            self._len += 1

    def remove(self, seq: Sequence) -> None:
        keys = self._classes[seq.sampling.priority]
        q = keys[seq.sampling.tenant]
        if q[0] is seq:
            q.popleft()
        else:
            q.remove(seq)
        if not q:
            del keys[seq.sampling.tenant]
            if not keys:
                del self._classes[seq.sampling.priority]
        if self._pinned is seq:
            self._pinned = None
        self._len -= 1

    def clear(self) -> None:
        self._classes.clear()
        self._len = 0
        self._pinned = None

    # ---- order ----------------------------------------------------------------------------

    def head(self) -> Sequence:
        """The sequence to admit next (the queue must not be empty)."""
        if self._pinned is not None:
            return self._pinned
        keys = self._classes[min(self._classes)]
        c = self.counters
        if len(keys) == 1:
            seq = next(iter(keys.values()))[0]
        else:
            seq = min((q[0] for q in keys.values()),
                      key=lambda s: (c.get(s.sampling.tenant, 0.0), s.order))
        if c:
            self._floor = c.get(seq.sampling.tenant, 0.0)
        return seq

    def popleft(self) -> Sequence:
        seq = self.head()
        self.remove(seq)
        return seq

    def pin(self, seq: Sequence) -> None:
        """seq holds blocks while it waits: it stays the head until it runs or leaves."""
        self._pinned = seq

    # ---- fair shares ----------------------------------------------------------------------

    def charge(self, tenant: str, tokens: int) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens

    def _lift(self, tenant: str) -> None:
        """A key with nothing waiting gets work: no less than the least counter of the
        keys waiting (with none waiting: of the key admitted last), so time spent idle is
        not saved up as a burst that would hold the others back."""
        waiting = [self.counters.get(t, 0.0) for keys in self._classes.values()
                   for t, q in keys.items() if q and t != tenant]
        floor = min(waiting) if waiting else self._floor
        if floor > self.counters.get(tenant, 0.0):
            self.counters[tenant] = floor
