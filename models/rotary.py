"""Rotary position embedding, neox style (rotate halves), as Qwen3 and Hugging Face do.

cos/sin are precomputed in float32 for every position up to `max_positions(config)` and
indexed by each token's absolute position, so prefill, chunked prefill and decode tokens
of different sequences can share one flat batch.

RoPE scaling follows transformers' modeling_rope_utils (5.x): `linear`, `dynamic` (NTK),
`yarn` and `llama3` change the inverse frequencies; yarn's attention factor multiplies
cos and sin (as HF's rotary forward does), so every kernel that reads the table (the
rotary kernel, the fused q/k norm + rotary kernel) gets it for free. `dynamic` in HF
recomputes the base from the longest position of each forward call; a paged cache
rotates each key once, when it is written, so here each position p uses the base for a
sequence of p + 1 tokens: what HF computes when it decodes token by token (its prefill
of a prompt longer than max_position_embeddings rotates all of it with the prompt's
base instead).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from kernels.rotary import apply_rotary, apply_rotary_ref
from models import kernel_choice
from models.decode_step import RotaryStep

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """One config's RoPE, resolved (hashable: the cos/sin tables are cached by it)."""
    kind: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    max_position: int = 0             # config.max_position_embeddings (dynamic's threshold)
    original_max_position: int = 0    # yarn / llama3: the pre-training context
    low_freq_factor: float = 1.0      # llama3
    high_freq_factor: float = 4.0     # llama3
    beta_fast: float = 32.0           # yarn
    beta_slow: float = 1.0            # yarn
    truncate: bool = True             # yarn
    attention_factor: float = 1.0     # yarn: multiplies cos and sin

    def table_length(self) -> int:
        """Positions the table covers: yarn to original x factor, linear and dynamic
        to max_position_embeddings x factor (vLLM's lengths), others max_position_embeddings."""
        if self.kind == "yarn":
            return max(self.max_position, int(self.original_max_position * self.factor))
        if self.kind in ("linear", "dynamic"):
            return int(self.max_position * self.factor)
        return self.max_position


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_from_config(config) -> RopeScaling:
    """The RoPE of a transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters)
    config; as HF, a rope_scaling dict wins over rope_parameters."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    spec = dict(getattr(config, "rope_scaling", None) or params)
    kind = spec.get("rope_type", spec.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    if spec.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary (partial_rotary_factor != 1) is not supported")
    theta = spec.get("rope_theta") or params.get("rope_theta") or getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("config has no rope_theta (neither rope_theta nor rope_parameters)")
    max_position = int(getattr(config, "max_position_embeddings", 0) or 0)
    if kind == "default":
        return RopeScaling(theta=float(theta), max_position=max_position)

    def need(key: str):
        if spec.get(key) is None:
            raise ValueError(f"rope_scaling {kind!r} needs {key!r}, got {spec}")
        return spec[key]

    original = int(getattr(config, "original_max_position_embeddings", None)
                   or spec.get("original_max_position_embeddings") or max_position)
    common = dict(kind=kind, theta=float(theta), max_position=max_position)
    if kind in ("linear", "dynamic"):
        return RopeScaling(**common, factor=float(need("factor")))
    if kind == "llama3":
        return RopeScaling(**common, factor=float(need("factor")), original_max_position=original,
                           low_freq_factor=float(need("low_freq_factor")),
                           high_freq_factor=float(need("high_freq_factor")))
    factor = spec.get("factor") or max_position / original   # yarn
    attention = spec.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = spec.get("mscale"), spec.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    return RopeScaling(**common, factor=float(factor), original_max_position=original,
                       beta_fast=float(spec.get("beta_fast") or 32),
                       beta_slow=float(spec.get("beta_slow") or 1),
                       truncate=bool(spec.get("truncate", True)),
                       attention_factor=float(attention))


def rope_theta_from_config(config) -> float:
    return rope_from_config(config).theta


def max_positions(config) -> int:
    """How many positions the model can rotate: the context limit RoPE scaling allows."""
    return rope_from_config(config).table_length()


def _inv_freq(dim: int, rope: RopeScaling, device: torch.device) -> torch.Tensor:
    """[dim / 2] float32 (or [positions, dim / 2] for dynamic), with HF's float32 op order."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    base = rope.theta
    if rope.kind == "dynamic":
        seq_len = torch.arange(1, rope.table_length() + 1, device=device).clamp(min=rope.max_position)
        base = base * ((rope.factor * seq_len / rope.max_position) - (rope.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base[:, None] ** exponents[None, :])
    inv_freq = 1.0 / (base ** exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        old, low, high = rope.original_max_position, rope.low_freq_factor, rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / rope.factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    if rope.kind == "yarn":
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
                2 * math.log(rope.theta))
        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp.to(device)
        pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq


@functools.lru_cache(maxsize=None)
def _cos_sin_table(head_dim: int, rope: RopeScaling, device: torch.device) -> torch.Tensor:
    """[positions, head_dim] float32 cos | sin, one per (shape, RoPE, device): every layer
    shares it (a Qwen3-30B-A3B rank held 48 copies, 1 GB, at 40,960 positions). Float32
    whatever the model dtype (the loader builds the model in its dtype, so no .to(dtype)
    ever rounds these)."""
    inv_freq = _inv_freq(head_dim, rope, device)
    positions = torch.arange(rope.table_length(), dtype=torch.float32, device=device)[:, None]
    freqs = positions * inv_freq
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table * rope.attention_factor if rope.attention_factor != 1.0 else table


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; the rotation is kernels/rotary.py (Triton on GPU).
    `base` with max_position is plain RoPE; `rope` (rope_from_config) any scaled one."""

    def __init__(self, head_dim: int, max_position: int = 0, base: float = 10000.0,
                 rope: RopeScaling | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.rope = rope or RopeScaling(theta=float(base), max_position=max_position)
        # built on the default device (the loader's `with torch.device(...)`); not saved in
        # checkpoints (derived from the config)
        table = _cos_sin_table(head_dim, self.rope, torch.get_default_device())
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def decode_step(self) -> RotaryStep:
        """The shared cos/sin table, by reference (models/decode_step.py)."""
        return RotaryStep(self.cos_sin_cache, self.head_dim)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k) (in place on GPU)."""
        rotate = apply_rotary if kernel_choice.paths(q).triton else apply_rotary_ref
        return rotate(q, k, positions, self.cos_sin_cache)
