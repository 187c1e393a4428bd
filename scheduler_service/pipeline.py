"""How many steps the engine keeps queued on the workers, chosen from measured times.

With D steps in flight, the workers have D - 1 steps queued behind the one they compute,
so the control plane's round trip for a step (its answer leaving the worker, the engine
taking it in and streaming it, scheduling and sending the next step, that step reaching
the worker) is hidden as long as it takes less than D - 1 device steps. Two cover a 7 ms
step many times over; at a 0.3 ms step the round trip on a loaded 2-core host is 0.6-0.9
ms (null worker, median), so it takes four. Deeper costs little: a finished sequence's
extra rows computed and dropped (never streamed: the scheduler drops a step's tokens for
a sequence that already ended) and a new request's prefill queued behind D - 1 short
steps.

The round trip is measured per decode step, as the engine sees it: the time from sending
a step to having its answer, less the worker's own time for it (step_ms: queued +
computing), plus the engine's time to fold the answer in and send the next step.

Past the second step in flight the engine sends steps `per_message` at a time, in one
stream write (StepRequest.then): at a 0.3 ms step the write of each step was ~45% of the
engine core's time. A group goes out once that many fit, so the engine keeps
`per_message - 1` more in flight than `depth` (Engine.max_in_flight) and the workers still
hold depth - 1 steps behind the one they compute when the next group arrives.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

# No CLI flag yet: the engine core's deepest pipeline comes from the environment (2 = the
# one-step-ahead overlap alone, for comparisons).
MAX_DEPTH = int(os.environ.get("NANOSERVE_MAX_PIPELINE_DEPTH", "4"))
# Steps a message past the second in flight (1: each step its own message, for comparisons).
PER_MESSAGE = max(1, int(os.environ.get("NANOSERVE_STEPS_PER_MESSAGE", "3")))


@dataclass
class PipelineDepth:
    max_depth: int = MAX_DEPTH  # 1: no overlap; 2: the classic one step ahead
    margin: float = 2.0         # round trips vary: cover this many times the mean
    alpha: float = 0.05         # EMA weight of a new sample (~20 steps of memory)
    round_trip_ms: float = 0.0  # EMA: the control plane's time per step (see above)
    device_ms: float = 0.0      # EMA: a decode step's device time
    depth: int = 2              # steps to keep in flight now
    per_message: int = PER_MESSAGE   # steps sent together past the second (see above)

    def __post_init__(self) -> None:
        self.depth = min(2, self.max_depth)

    def observe(self, round_trip_ms: float, device_ms: float) -> None:
        """One decode step's measured round trip and device time: update `depth`."""
        if self.max_depth <= 2 or device_ms <= 0:
            return
        a = self.alpha
        if self.device_ms == 0.0:
            self.round_trip_ms, self.device_ms = max(round_trip_ms, 0.0), device_ms
        else:
            self.round_trip_ms += a * (max(round_trip_ms, 0.0) - self.round_trip_ms)
            self.device_ms += a * (device_ms - self.device_ms)
        want = 1 + math.ceil(self.margin * self.round_trip_ms / self.device_ms)
        self.depth = max(2, min(self.max_depth, want))
