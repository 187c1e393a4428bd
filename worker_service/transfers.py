"""Host <-> device copies for the launch path: none of them blocks the launching thread.

A step's host inputs are staged in pinned memory taken from torch's caching host
allocator, fresh each time: the allocator hands a block out again only after the copy
that reads it has run on the GPU, so a later step's host writes can never race an
earlier step's copy still in flight (a reused staging buffer could).
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array on `device` (CUDA: staged through pinned memory, asynchronously)."""
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor to host memory (pinned on CUDA: asynchronously)."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)
