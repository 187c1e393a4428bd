"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of ceil(vocab / tp) rows. Vocab sizes need not divide
by the TP size: the last shard is zero-padded, and the padding rows never reach the
caller (ids there never occur; padded logits are cut off after the gather).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.batch_invariant import invariant_linear
from models import kernel_choice
from models.decode_step import TPShard, VocabStep
from models.parallel import TPGroup, check_shape


class VocabParallelEmbedding(nn.Module):
    """Rank r looks up ids in [r * shard, (r + 1) * shard), zeroes the rest, all-reduces."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        # zeros, not empty: padding rows are never loaded and must stay inert
        self.weight = nn.Parameter(torch.zeros(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} got unexpected shard id {shard_id!r}")
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"{type(self).__name__}: checkpoint has {loaded_weight.shape[0]} "
                             f"vocab rows, config says {self.num_embeddings}")
        rows = self.vocab_end - self.vocab_start
        dst = param.data.narrow(0, 0, rows)
        shard = loaded_weight.narrow(0, self.vocab_start, rows)
        check_shape(dst, shard, type(self).__name__)
        dst.copy_(shard)

    def decode_step(self) -> VocabStep:
        """This rank's vocab rows, by reference (models/decode_step.py)."""
        return VocabStep(self.weight, self.vocab_start, self.vocab_end, self.num_embeddings,
                         TPShard(self.tp.rank, self.tp.size, 0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = F.embedding((input_ids - self.vocab_start) * mask, self.weight)
        y = y * mask.unsqueeze(-1).to(y.dtype)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocab: local shard GEMM, then all-gather.

    Callers select the rows they need (e.g. the last token per sequence) before calling,
    so the GEMM and the gather only touch those. cuBLAS even for one token: on an H200
    (tests/gpu/bench_gemv.py) it reads the 0.6B's LM head in 76 us against the one-token
    GEMV's 90 (a vocabulary's rows are one long grid, where the GEMV's edge, no padding of
    the token to a tile and PDL, is small), the 8B's in 289 against 291."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if kernel_choice.paths(hidden).invariant:   # --deterministic (kernel_choice.DETERMINISTIC)
            logits = invariant_linear(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.gather(logits, dim=-1)[..., :self.num_embeddings]
