"""The host tier of the prefix cache on one worker rank: pinned slots and the copies.

Why a slot-major layout and a staging block: the device cache is [2, layers, blocks, ...],
so one block is 2 x layers strided pieces. Copied straight into a host tensor of the same
layout, torch made each block a strided host write at 1.1 GB/s (device -> host) and 4.0
GB/s back, on an H100 where one pinned memcpy runs at ~53 GB/s (tests/gpu/bench_host_kv.py).
Here a slot is one contiguous block ([2, layers, block_size, kv heads, head dim]); each copy
gathers the block into a device staging buffer of that shape (a device-side copy at HBM
speed) and moves it over the link in one contiguous pinned memcpy, or the reverse. All of
a step's copies run in order on one stream, so one staging buffer serves them all.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class HostTier:
    kv: torch.Tensor                       # [slots, 2, layers, block_size, kv heads, head dim]
    scales: torch.Tensor | None            # fp8 KV: [slots, 2, layers, block_size] float32
    stage_kv: torch.Tensor | None = None   # CUDA: one block of kv, on the device
    stage_scales: torch.Tensor | None = None
    seconds: float = 0.0                   # copy time measured so far (take_seconds)
    _timing: list = field(default_factory=list)   # CUDA: (start, end) events not yet read
    stream: object = None                  # CUDA: the copy stream, beside the forwards
    done: object = None                    # CUDA event: the last step's copies

    @classmethod
    def allocate(cls, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                 num_slots: int) -> "HostTier":
        """Zeroed (so resident) host slots for kv_cache's blocks; pinned, with staging
        buffers on the device, where the cache is on CUDA."""
        cuda = kv_cache.is_cuda
        block = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
        kv = torch.zeros(num_slots, *block, dtype=kv_cache.dtype, pin_memory=cuda)
        scales = None
        if kv_scales is not None:
            sblock = (kv_scales.shape[0], kv_scales.shape[1], *kv_scales.shape[3:])
            scales = torch.ones(num_slots, *sblock, dtype=kv_scales.dtype, pin_memory=cuda)
        tier = cls(kv, scales)
        if cuda:
            tier.stage_kv = torch.empty(block, dtype=kv_cache.dtype, device=kv_cache.device)
            if kv_scales is not None:
                tier.stage_scales = torch.empty(sblock, dtype=kv_scales.dtype,
                                                device=kv_cache.device)
        return tier

    @property
    def num_slots(self) -> int:
        return self.kv.shape[0]

    def copy(self, ops: list[tuple[int, int, int]], kv_cache: torch.Tensor,
             kv_scales: torch.Tensor | None) -> None:
        """(0, block, slot): block -> slot; (1, block, slot): slot -> block, in order, on
        the current stream (CUDA: enqueued; CPU: done on return)."""
        pairs = [(kv_cache, self.kv, self.stage_kv)]
        if self.scales is not None:
            pairs.append((kv_scales, self.scales, self.stage_scales))
        cuda = kv_cache.is_cuda
        self._harvest()   # bounded whether or not anyone reads take_seconds
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        for kind, block, slot in ops:
            for dev, host, stage in pairs:
                src = dev[:, :, block]
                if stage is None and kind == 0:
                    host[slot].copy_(src)
                elif stage is None:
                    src.copy_(host[slot])
                elif kind == 0:
                    stage.copy_(src)
                    host[slot].copy_(stage, non_blocking=True)
                else:
                    stage.copy_(host[slot], non_blocking=True)
                    src.copy_(stage)
        if cuda:
            end.record()
            self._timing.append((start, end))
        else:
            self.seconds += time.perf_counter() - t0

    def transfer(self, ops: np.ndarray, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                 sync: bool = False) -> None:
        """A step's copies (check_ops' triples; ValueError names a bad one). On CUDA they run
        on the copy stream after everything queued so far (the steps before) and beside this
        step's forward, which the scheduler keeps off those blocks; the next step waits for
        them (`wait`; sync: this one does). On a CPU they run at once."""
        checked = check_ops(ops, kv_cache.shape[2], self.num_slots)
        if not kv_cache.is_cuda:
            self.copy(checked, kv_cache, kv_scales)
            return
        compute = torch.cuda.current_stream(kv_cache.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(kv_cache.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self.copy(checked, kv_cache, kv_scales)
        done = torch.cuda.Event()
        done.record(self.stream)
        if sync:
            compute.wait_event(done)
        else:
            self.done = done

    def wait(self, device: torch.device) -> None:
        """The next step's work waits for the last step's copies."""
        if self.done is not None:
            torch.cuda.current_stream(device).wait_event(self.done)
            self.done = None

    def drain(self) -> None:
        """Wait for every copy in flight (before its buffers are freed)."""
        if self.stream is not None:
            self.stream.synchronize()

    def _harvest(self) -> None:
        """Move the completed copies' event times into `seconds` (never waits)."""
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.pop(0)
            self.seconds += start.elapsed_time(end) / 1e3

    def take_seconds(self) -> float:
        """Copy time finished since the last call (CUDA: of the copies whose events have
        completed; never waits)."""
        self._harvest()
        out, self.seconds = self.seconds, 0.0
        return out


def check_ops(ops: np.ndarray, num_blocks: int, num_slots: int) -> list[tuple[int, int, int]]:
    """StepRequest.kv_transfers_i32 triples (kind, a, b) -> (kind, block, slot): (0, block,
    slot) saves, (1, slot, block) restores. ValueError names the first bad one."""
    checked = []
    for kind, a, b in ops.tolist():
        block, slot = (a, b) if kind == 0 else (b, a)
        if kind not in (0, 1) or not 0 <= block < num_blocks or not 0 <= slot < num_slots:
            raise ValueError(f"bad kv transfer ({kind}, {a}, {b}): {num_blocks} blocks, "
                             f"{num_slots} slots")
        checked.append((kind, block, slot))
    return checked
