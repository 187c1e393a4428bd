"""Rotary position embedding, neox style (rotate halves), as Qwen3 and Hugging Face do.

cos/sin are precomputed in float32 for every position up to max_position_embeddings and
indexed by each token's absolute position, so prefill, chunked prefill and decode tokens
of different sequences can share one flat batch.
"""
from __future__ import annotations

import torch
from torch import nn


def rope_theta_from_config(config) -> float:
    """rope_theta from a transformers 4 (config.rope_theta, config.rope_scaling) or
    transformers 5 (config.rope_parameters) config; only plain RoPE is supported."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    for spec in (params, scaling):
        kind = spec.get("rope_type", spec.get("type"))
        if kind not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {kind!r} (only default RoPE)")
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("config has no rope_theta (neither rope_theta nor rope_parameters)")
    return float(theta)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # float32 whatever the model dtype (the loader builds the model in its dtype, so no
        # .to(dtype) ever rounds these); not saved in checkpoints (derived from the config)
        self.register_buffer("cos", freqs.cos(), persistent=False)   # [max_position, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D]; cos/sin [T, 1, D/2]."""
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k)."""
        cos = self.cos[positions].float().unsqueeze(1)
        sin = self.sin[positions].float().unsqueeze(1)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
