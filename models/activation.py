"""SiLU-and-mul: the SwiGLU gate applied to the merged gate_up projection output."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate then up, as MergedColumnParallelLinear lays them out) -> [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
