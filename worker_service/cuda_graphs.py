"""CUDA graphs for decode steps: one captured forward (+ LM head) per batch-size bucket.

A decode step of a 0.6B model is ~300 small kernels; launched from Python that is
milliseconds of CPU per step, longer than the GPU work at small batches. A graph replays
them with one launch. Graphs need static shapes and addresses, so every input lives in a
persistent buffer sized for the largest bucket; a batch of n runs the smallest bucket
>= n with the tail padded (slot -1: nothing stored; context length 0: attention yields
zeros), and the first n rows of the logits are the answer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(buckets + [max_batch]))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor        # [bucket, vocab] output buffer of the captured LM head


class DecodeGraphs:
    def __init__(self, model, backend, max_batch: int, max_model_len: int, block_size: int,
                 num_kv_heads: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.num_kv_heads = num_kv_heads
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.buckets = batch_buckets(max_batch)
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.slot_mapping = torch.full((max_batch,), -1, **i32)
        self.context_lens = torch.zeros(max_batch, **i32)
        self.block_tables = torch.zeros(max_batch, self.max_blocks, **i32)
        self.cu_seqlens_q = torch.arange(max_batch + 1, **i32)
        self.cu_seqlens_k = torch.zeros(max_batch + 1, **i32)   # unused by decode kernels
        # One pinned staging area for all host inputs: a single H2D copy per step.
        self._staging = torch.zeros(4 * max_batch + max_batch * self.max_blocks,
                                    dtype=torch.int64).pin_memory()
        self.graphs: dict[int, _Graph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            cu_seqlens_k=self.cu_seqlens_k[:bs + 1], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, is_decode=True)

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        from kernels.paged_attention import default_num_splits
        saved = getattr(self.backend, "decode_splits", None)
        try:
            for bs in reversed(self.buckets):
                if hasattr(self.backend, "decode_splits"):   # the grid is frozen in the graph
                    self.backend.decode_splits = default_num_splits(
                        bs, self.num_kv_heads, self.max_model_len, self.device)
                self._forward(bs)                            # warm-up: compile, autotune
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    logits = self._forward(bs)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = _Graph(graph, logits)
        finally:
            if hasattr(self.backend, "decode_splits"):
                self.backend.decode_splits = saved
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            block_tables: np.ndarray, fill: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        """One decode step for n = len(input_ids) sequences -> logits [n, vocab].

        block_tables: [n, w] int32 with w <= max_blocks (context length = position + 1);
        fill: (rows, device ids) written over input_ids (placeholder inputs)."""
        n = len(input_ids)
        bs = next(b for b in self.buckets if b >= n)
        w = block_tables.shape[1]
        mb = self.max_blocks
        host = self._staging.numpy()
        # Layout of the staging buffer (int64): ids | positions | slots | ctx | tables
        host[:n] = input_ids
        host[self.max_batch:self.max_batch + n] = positions
        host[2 * self.max_batch:2 * self.max_batch + bs] = -1
        host[2 * self.max_batch:2 * self.max_batch + n] = slot_mapping
        host[3 * self.max_batch:3 * self.max_batch + bs] = 0
        host[3 * self.max_batch:3 * self.max_batch + n] = positions + 1
        tables = host[4 * self.max_batch:].reshape(self.max_batch, mb)
        tables[:n, :w] = block_tables
        dev = self._staging[:4 * self.max_batch + self.max_batch * mb].to(self.device, non_blocking=True)
        self.input_ids[:bs].copy_(dev[:bs])
        self.positions[:bs].copy_(dev[self.max_batch:self.max_batch + bs])
        self.slot_mapping[:bs].copy_(dev[2 * self.max_batch:2 * self.max_batch + bs])
        self.context_lens[:bs].copy_(dev[3 * self.max_batch:3 * self.max_batch + bs])
        self.block_tables[:n].copy_(dev[4 * self.max_batch:].view(self.max_batch, mb)[:n])
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        g = self.graphs[bs]
        g.graph.replay()
        return g.logits[:n]
