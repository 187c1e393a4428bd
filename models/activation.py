"""SiLU-and-mul: the SwiGLU gate applied to the merged gate_up projection output
(MergedColumnParallelLinear.swiglu, which takes it from the GEMV's epilogue at one token).

The fused Triton kernel (kernels/activation.py) runs where models/kernel_choice.py says
fused kernels run (on CUDA unless NANOSERVE_FUSED_KERNELS=0), its torch reference elsewhere."""
from __future__ import annotations

import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.fp8_linear import quantized_rows_ref
from models import kernel_choice


def swiglu(x: torch.Tensor, fp8: bool = False):
    """[..., 2 * d] (gate then up, as MergedColumnParallelLinear lays them out) -> [..., d];
    fp8: as QuantizedRows for the FP8 GEMM it feeds (LinearBase.takes_fp8_rows)."""
    if kernel_choice.paths(x).fused:
        return silu_and_mul(x, fp8=fp8)
    out = silu_and_mul_ref(x)
    return quantized_rows_ref(out) if fp8 else out
