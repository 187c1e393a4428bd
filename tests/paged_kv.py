"""A small paged KV cache wired into a model, for tests that drive the model directly."""
from __future__ import annotations

import torch

from kernels.attention import AttentionMetadata, new_kv_cache
from kernels.kv_quant import FP8_DTYPE
from models.qwen3 import kv_cache_layers


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """A copy of one layer's cache stored as new_kv_cache stores it (head-major): same shape
    and values, other strides."""
    return new_kv_cache(1, *cache.shape, cache.dtype, cache.device)[0, 0].copy_(cache)


class PagedKV:
    """A small paged KV cache wired into a model, with shuffled per-sequence block tables."""

    def __init__(self, model, seq_lens: list[int], block_size: int, seed: int = 0,
                 fp8: bool = False) -> None:
        self.block_size = block_size
        layers = kv_cache_layers(model)
        attn = layers[0]
        need = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(need) + 3                       # a few spare, never-used blocks
        dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.kv = new_kv_cache(len(layers), num_blocks, block_size, attn.num_kv_heads,
                               attn.head_dim, dtype, self.device).fill_(float("nan"))  # junk shows
        self.kv = self.kv.to(FP8_DTYPE) if fp8 else self.kv    # .to keeps the worker's strides
        self.scales = torch.full((2, len(layers), num_blocks, block_size), float("nan"),
                                 device=self.device) if fp8 else None
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv[0, i], self.kv[1, i]
            layer.k_scale, layer.v_scale = (self.scales[0, i], self.scales[1, i]) if fp8 else (None, None)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables, start = [], 0
        for n in need:
            self.tables.append(perm[start:start + n])
            start += n

    def metadata(self, chunks: list[tuple[int, int, int]], is_decode: bool = False
                 ) -> tuple[torch.Tensor, AttentionMetadata]:
        """chunks: (seq index, first position, end position) per sequence in this step.
        Returns (positions [T], metadata)."""
        positions, slots, cu_q, ctx = [], [], [0], []
        for seq, start, end in chunks:
            for p in range(start, end):
                positions.append(p)
                slots.append(self.tables[seq][p // self.block_size] * self.block_size
                             + p % self.block_size)
            cu_q.append(cu_q[-1] + end - start)
            ctx.append(end)
        width = max(len(self.tables[seq]) for seq, _, _ in chunks)
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _, _ in chunks]
        i32 = dict(dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, **i32),
            block_tables=torch.tensor(tables, **i32),
            context_lens=torch.tensor(ctx, **i32),
            cu_seqlens_q=torch.tensor(cu_q, **i32),
            cu_seqlens_k=torch.tensor([0] + torch.tensor(ctx).cumsum(0).tolist(), **i32),
            max_seqlen_q=max(e - s for _, s, e in chunks),
            max_seqlen_k=max(ctx),
            is_decode=is_decode,
            prefix_free=all(start == 0 for _, start, _ in chunks))
        return torch.tensor(positions, dtype=torch.long, device=self.device), meta
