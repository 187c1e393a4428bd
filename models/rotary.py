"""Rotary position embedding, neox style (rotate halves), as Qwen3 and Hugging Face do.

cos/sin are precomputed in float32 for every position up to max_position_embeddings and
indexed by each token's absolute position, so prefill, chunked prefill and decode tokens
of different sequences can share one flat batch.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from kernels.rotary import apply_rotary, apply_rotary_ref
from models import kernel_choice
from models.decode_step import RotaryStep


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


@functools.lru_cache(maxsize=None)
def _cos_sin_table(head_dim: int, max_position: int, base: float,
                   device: torch.device) -> torch.Tensor:
    """[max_position, head_dim] float32 cos | sin, one per (shape, base, device): every layer
    shares it (a Qwen3-30B-A3B rank held 48 copies, 1 GB, at 40,960 positions). Float32
    whatever the model dtype (the loader builds the model in its dtype, so no .to(dtype)
    ever rounds these)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=device) / head_dim))
    freqs = torch.arange(max_position, dtype=torch.float32, device=device)[:, None] * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; the rotation is kernels/rotary.py (Triton on GPU)."""

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        # built on the default device (the loader's `with torch.device(...)`); not saved in
        # checkpoints (derived from the config)
        table = _cos_sin_table(head_dim, max_position, float(base), torch.get_default_device())
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def decode_step(self) -> RotaryStep:
        """The shared cos/sin table, by reference (models/decode_step.py)."""
        return RotaryStep(self.cos_sin_cache, self.head_dim)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k) (in place on GPU)."""
        rotate = apply_rotary if kernel_choice.paths(q).triton else apply_rotary_ref
        return rotate(q, k, positions, self.cos_sin_cache)
