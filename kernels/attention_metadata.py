"""What one step tells the attention backends: where its tokens go in the paged KV cache.

Its own module, below kernels/attention.py (the backends and select_backend) and
kernels/backend_choice.py (timing the backends on made-up steps): both build or read it,
and attention.py uses backend_choice, so neither may be where it lives.
kernels.attention re-exports it; the layout it describes is in that module's docstring.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [num_tokens] int32: block_id * block_size + offset; -1 = skip
    block_tables: torch.Tensor   # [num_seqs, max_blocks] int32, padded with 0 (never read)
    context_lens: torch.Tensor   # [num_seqs] int32: KV length after this step
    cu_seqlens_q: torch.Tensor   # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor   # [num_seqs + 1] int32: prefix sums of context_lens
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool              # every sequence has exactly one query token
    prefix_free: bool = False    # every sequence starts at position 0 (no cached prefix)
    decode_runs: torch.Tensor | None = None   # decode: [2, num_seqs] int32 runs of rows that
                                              # are one sequence's tokens (decode_runs below)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def decode_runs(seq_rows: np.ndarray) -> np.ndarray | None:
    """Runs of consecutive decode rows of one sequence (fast-forward tokens: equal entries
    of seq_rows, e.g. SeqTable rows) as paged_decode's `runs` [2, n] int32: each row's
    place in its run and the rows left in it, itself included. None where every row is
    its own sequence (the usual decode step: nothing to share)."""
    n = len(seq_rows)
    first = np.ones(n, dtype=bool)
    first[1:] = seq_rows[1:] != seq_rows[:-1]
    if first.all():
        return None
    idx = np.arange(n)
    start = np.maximum.accumulate(np.where(first, idx, 0))
    end = np.minimum.accumulate(np.where(np.r_[first[1:], True], idx, n)[::-1])[::-1]
    return np.stack([idx - start, end - idx + 1]).astype(np.int32)
