"""RMSNorm with the residual add fused in (vLLM style).

The residual stream flows between decoder layers as a separate tensor, so one call does
"add the sublayer output to the residual, then normalize". The math lives in
kernels/rmsnorm.py: the fused Triton kernel on GPU, its torch reference elsewhere (the
numerics of both follow Hugging Face's Qwen3RMSNorm).

Under tensor parallelism the sublayer output arrives unreduced (RowParallelLinear with
reduce=False): a norm given `tp` sums it over the ranks first, and where peer memory allows,
the all-reduce, the add and the norm are one kernel (kernels/all_reduce_norm.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.fp8_linear import quantized_rows_ref
from kernels.gemv import GemvNorm
from kernels.rmsnorm import rms_norm, rms_norm_ref
from models import kernel_choice
from models.decode_step import NormStep
from models.parallel import TPGroup, replicated_weight_loader


@dataclass
class DeferredNorm:
    """A norm left to the GEMV or small-M kernel that consumes its output
    (kernels/gemv.GemvNorm): that kernel normalizes x (+ the residual) in its prologue, one
    launch fewer. `residual` is the residual stream after the norm (written by that kernel
    where there was one to add)."""
    x: torch.Tensor
    norm: GemvNorm

    @property
    def residual(self) -> torch.Tensor:
        return self.norm.residual_out if self.norm.residual_out is not None else self.x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.tp = tp   # given: x with a residual is a partial sum over these ranks
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = replicated_weight_loader

    @property
    def sums_ranks(self) -> bool:
        """Whether x given with a residual is a partial sum over TP ranks, summed here."""
        return self.tp is not None and self.tp.size > 1

    def decode_step(self) -> NormStep:
        """The weight (by reference), eps and the TP sum (models/decode_step.py)."""
        return NormStep(self.weight, self.eps, self.sums_ranks)

    def deferred(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> DeferredNorm:
        """This norm of x (+ residual) for the GEMV or small-M kernel that consumes it to
        compute (no TP sum); the new residual goes to a fresh buffer."""
        assert not (residual is not None and self.sums_ranks)
        out = torch.empty_like(residual) if residual is not None else None
        return DeferredNorm(x, GemvNorm(self.weight, self.eps, residual, out))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: bool = False):
        """x_normed, or (x_normed, x + residual) when a residual is given (on GPU the sum
        is written into `residual` in place). fp8: x_normed comes as QuantizedRows for the
        FP8 GEMM it feeds (LinearBase.takes_fp8_rows), quantized in the norm's own pass."""
        if residual is not None and self.sums_ranks:
            fast = self.tp.fast
            if not fp8 and fast is not None and fast.fuses(x, residual):
                return fast.all_reduce_norm(x, residual, self.weight, self.eps)
            x = self.tp.all_reduce(x)
        if kernel_choice.paths(x).triton:
            return rms_norm(x, self.weight, self.eps, residual, fp8=fp8)
        out = rms_norm_ref(x, self.weight, self.eps, residual)
        if not fp8:
            return out
        return ((quantized_rows_ref(out[0]), out[1]) if residual is not None
                else quantized_rows_ref(out))

    def extra_repr(self) -> str:
        tp = f", sums over {self.tp.size} ranks" if self.sums_ranks else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{tp}"
