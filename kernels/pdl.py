"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may be
scheduled while the kernel before it in the stream is still running, and calls `wait`
before it reads anything that kernel (or any before it) wrote, or writes anything.

Why: at batch 1 a decode step is a chain of ~330 small kernels (8B) whose each one pays
its launch and the ramp of its first memory reads after the one before has drained. With
PDL the next kernel is already resident when its predecessor finishes, and the decode
GEMV (kernels/gemv.py) loads its first weight tile *before* waiting: weights are never a
kernel's output, so their streaming starts during the norm or activation before it. A
kernel signals `launch_dependents` only after its own wait, so at most one kernel waits
ahead of the running one (no cascade of resident waiters crowding the SMs).

Only where a kernel takes a few tokens (MAX_ROWS: a small batch's decode step chain).
Measured on an H100 (tests/gpu/bench_pdl.py, decode step from its CUDA graph):
batch 1 0.6B 1.211 -> 1.038 ms, 8B bf16 5.966 -> 5.748, 8B FP8 weights + KV 4.224 -> 3.942;
at batch 8, where cuBLAS and the FP8 GEMM kernels (no PDL) sat between the chain's, 0-3%
slower. Since the layers of 2-8 rows take kernels/small_m.py (Triton, PDL) instead of cuBLAS,
PDL runs up to 8 rows: on an H200 (0.6B, through the launcher, batch 8) 1.384 -> 1.318 ms a
step with the small-M kernel, against 1.355 for cuBLAS without PDL; from the graph (bench_pdl.py)
batch 2 1.430 -> 1.311, FP8 weights + KV batch 8 1.679 -> 1.532, logits bit-equal.

Every kernel of the decode chain takes a PDL constexpr and is launched with
`**launch(device, rows)`'s flag; kernels without it launch as before (a PDL kernel after
one of them just waits for it). NANOSERVE_PDL=0 turns it off (before/after measurements);
the interpreter (CPU tests) never uses it: it runs no PTX.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.interpret import INTERPRET_ENV

ENABLED = os.environ.get("NANOSERVE_PDL", "1") != "0" and not INTERPRET_ENV
# tokens (rows) a kernel may take and still launch with PDL (NANOSERVE_PDL_MAX_ROWS; models/
# kernel_choice.SMALL_M_MAX_ROWS, the rows the chain is Triton throughout, is 8 too)
MAX_ROWS = int(os.environ.get("NANOSERVE_PDL_MAX_ROWS", "8"))


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    return ENABLED and device.type == "cuda" and _supported(device.index
                                                           if device.index is not None
                                                           else torch.cuda.current_device())


def launch(device: torch.device, rows: int) -> dict:
    """A kernel call's extra arguments: its PDL constexpr and the launch flag, which must
    agree (a PDL launch of a kernel that never waits would race its predecessor); on
    where the kernel takes at most MAX_ROWS rows."""
    on = rows <= MAX_ROWS and enabled(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the kernels before this one finished and their writes are visible; then
    let the next kernel be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
