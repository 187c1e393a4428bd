"""Paged KV caches bound to attention layers: the target's, and a drafter's beside it in
the same block count and block size (so the same block tables and slots address both).

A cache is one tensor [2, layers, blocks, block_size, heads, head_dim]; each layer gets
views of its K and V (and, for fp8, of its per-token float32 scales), which its attention
reads and writes. Unbinding leaves empty views, so nothing keeps a freed cache alive.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import new_kv_cache
from kernels.kv_quant import FP8_DTYPE


@dataclass(frozen=True)
class KVFormat:
    """How K and V are stored: in the model's dtype, or (fp8) as e4m3 with a float32 scale
    per token."""
    dtype: torch.dtype
    fp8: bool = False

    @property
    def name(self) -> str:
        return "fp8_e4m3" if self.fp8 else str(self.dtype).removeprefix("torch.")

    def block_bytes(self, layers: list, block_size: int) -> int:
        """K and V bytes of one block of `block_size` tokens over `layers`."""
        if not layers:
            return 0
        values = layers[0].num_kv_heads * layers[0].head_dim
        per_token = values + 4 if self.fp8 else values * self.dtype.itemsize
        return 2 * len(layers) * block_size * per_token


def bind_kv(layers: list, num_blocks: int, block_size: int, fmt: KVFormat,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A KV cache for `layers`, each layer given its views -> (cache, fp8 scales or None)."""
    heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
    cache = new_kv_cache(len(layers), num_blocks, block_size, heads, head_dim,
                         FP8_DTYPE if fmt.fp8 else fmt.dtype, device)
    scales = (torch.ones(2, len(layers), num_blocks, block_size, dtype=torch.float32,
                         device=device) if fmt.fp8 else None)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
        if scales is not None:
            layer.k_scale, layer.v_scale = scales[0, i], scales[1, i]
    return cache, scales


def unbind_kv(layers: list) -> None:
    """Drop every layer's views of its cache."""
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
        layer.k_scale = layer.v_scale = None
