"""The one rule for tokens proposed ahead of sampling (DESIGN.md, one multi-token mechanism).

A step verifies a sequence's proposals by sampling a token after each of them; proposal i
is accepted while every proposal before it was, and it equals the sample of the row before
it. The scheduler (which commits the accepted tokens) and the worker (whose drafters start
from the newest accepted token, and find last step's drafts among a step's inputs) must
count alike, so both call this function: plain Python, no torch, no numpy needed.
"""
from __future__ import annotations

from typing import Sequence


def accepted_prefix(proposals: Sequence[int], samples: Sequence[int], first: int = 0) -> int:
    """How many of `proposals` are accepted: the longest prefix with proposals[i] ==
    samples[first + i] (samples[first] is the sample of the row before the first proposal)."""
    n = 0
    while n < len(proposals) and proposals[n] == samples[first + n]:
        n += 1
    return n
