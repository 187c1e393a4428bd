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


def aligned_offsets(sizes: list[int], align: int) -> tuple[list[int], int]:
    """Byte offsets of parts of these sizes laid out in order, each `align`-aligned, and
    the end of the last one (rounded up too)."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // align) * align
    return offsets, end


def to_device_many(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several numpy arrays on `device` with one transfer (CUDA): a step's small inputs cost
    one copy, not one each. Each part starts 16-byte aligned, as an allocation of its own
    would: Triton specializes a pointer on that alignment."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    offsets, end = aligned_offsets([a.nbytes for a in arrays], 16)
    host = torch.empty(end, dtype=torch.uint8, pin_memory=True)
    h = host.numpy()
    for a, at in zip(arrays, offsets):
        h[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)
    return [dev[at:at + a.nbytes].view(_TORCH_DTYPE[a.dtype]).view(a.shape)
            for a, at in zip(arrays, offsets)]


_TORCH_DTYPE = {np.dtype(n): getattr(torch, n) for n in
                ("int64", "int32", "float32", "bool", "uint8", "int8", "float16")}


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor to host memory (pinned on CUDA: asynchronously)."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)
