"""RMSNorm with the residual add fused in (vLLM style).

The residual stream flows between decoder layers as a separate tensor, so one call does
"add the sublayer output to the residual, then normalize": one pass over memory on a
fused kernel, and the plain-torch version here defines its exact numerics (float32
math, cast back to the input dtype before the weight multiply, like Hugging Face)."""
from __future__ import annotations

import torch
from torch import nn

from models.parallel import replicated_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = replicated_weight_loader

    def _norm(self, x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        var = x32.pow(2).mean(dim=-1, keepdim=True)
        return (x32 * torch.rsqrt(var + self.eps)).to(dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x_normed, or (x_normed, x + residual) when a residual is given."""
        if residual is None:
            return self._norm(x.float(), x.dtype)
        summed = x.float() + residual.float()
        return self._norm(summed, x.dtype), summed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
