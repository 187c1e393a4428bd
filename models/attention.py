"""Paged attention layer: owns one layer's KV cache slots and calls the backend.

The runner allocates the whole KV tensor once and assigns each layer its views
(`layer.k_cache = kv[0, i]`); the layer itself never allocates, so memory planning stays
in one place. The backend (kernels.attention) writes this step's k/v at
meta.slot_mapping and attends over meta.block_tables.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.attention import AttentionMetadata
from kernels.qk_norm_rotary import NormRotary
from models import kernel_choice
from models.decode_step import AttentionStep


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend) -> None:
        super().__init__()
        self.num_heads = num_heads        # local (this rank's) head counts
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # plain attributes, not buffers: the runner owns these tensors, state_dict must not
        self.k_cache = torch.tensor([])   # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v_cache = torch.tensor([])
        self.k_scale: torch.Tensor | None = None   # [num_blocks, block_size] fp32: fp8 caches
        self.v_scale: torch.Tensor | None = None

    def decode_step(self) -> AttentionStep:
        """The KV views the runner assigned (by reference), heads and scale
        (models/decode_step.py)."""
        if self.k_cache.numel() == 0:
            raise RuntimeError("KV cache not assigned: set layer.k_cache / layer.v_cache "
                               "(see models.qwen3.kv_cache_layers) before running the model")
        return AttentionStep(self.k_cache, self.v_cache, self.k_scale, self.v_scale,
                             self.num_heads, self.num_kv_heads, self.head_dim, self.scale)

    def cache(self, meta: AttentionMetadata) -> dict:
        """Where this step's K/V go, for a kernel that stores them itself
        (kernels/qk_norm_rotary.py): pass kv_stored=True to forward then."""
        s = self.decode_step()
        return dict(k_cache=s.k_cache, v_cache=s.v_cache, slot_mapping=meta.slot_mapping,
                    k_scale=s.k_scale, v_scale=s.v_scale)

    def takes_norm_rotary(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step's attention would apply the q/k norm and rotary and store K/V
        itself (forward's norm_rotary): decode rows q [T, Hq, D], at least
        kernel_choice.NORM_ROTARY_IN_ATTENTION_ROWS of them, on the Triton backend's decode
        kernel (not --deterministic's), a bf16 / fp16 cache."""
        rows = kernel_choice.NORM_ROTARY_IN_ATTENTION_ROWS
        return (0 < rows <= q.shape[0] and meta.is_decode and self.k_scale is None
                and getattr(self.backend, "name", "") == "triton" and not self.backend.invariant)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, kv_stored: bool = False,
                norm_rotary: NormRotary | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. norm_rotary (takes_norm_rotary):
        q, k, v are the projection's raw heads; the decode kernel normalizes, rotates and
        stores them (its slot_mapping is meta's)."""
        c = self.cache(meta)
        if norm_rotary is not None:
            return self.backend.forward(q, k, v, c["k_cache"], c["v_cache"], meta, self.scale,
                                        norm_rotary=norm_rotary)
        return self.backend.forward(q, k, v, c["k_cache"], c["v_cache"], meta, self.scale,
                                    c["k_scale"], c["v_scale"], kv_stored=kv_stored)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"backend={getattr(self.backend, 'name', type(self.backend).__name__)}")
