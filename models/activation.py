"""SiLU-and-mul: the SwiGLU gate applied to the merged gate_up projection output
(MergedColumnParallelLinear.swiglu, which takes it from the GEMV's epilogue at one token).

On CUDA the fused Triton kernel (kernels/activation.py) runs unless
NANOSERVE_FUSED_KERNELS=0 (kept for before/after comparisons). FUSED is also read by
models/qwen3.py (fused q/k norm + rotary), models/linear.py (the gated GEMV) and set by tests/gpu/profile_decode.py."""
from __future__ import annotations

import os

import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.fp8_linear import quantized_rows_ref

FUSED = os.environ.get("NANOSERVE_FUSED_KERNELS", "1") != "0"


def use_fused(x: torch.Tensor) -> bool:
    """Fused Triton kernels on the decode path: on CUDA unless NANOSERVE_FUSED_KERNELS=0
    (a CPU test patches this to run them in the Triton interpreter)."""
    return x.is_cuda and FUSED


def swiglu(x: torch.Tensor, fp8: bool = False):
    """[..., 2 * d] (gate then up, as MergedColumnParallelLinear lays them out) -> [..., d];
    fp8: as QuantizedRows for the FP8 GEMM it feeds (LinearBase.takes_fp8_rows)."""
    if use_fused(x):
        return silu_and_mul(x, fp8=fp8)
    out = silu_and_mul_ref(x)
    return quantized_rows_ref(out) if fp8 else out
