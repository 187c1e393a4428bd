"""What one step tells the attention backends: where its tokens go in the paged KV cache.

Its own module, below kernels/attention.py (the backends and select_backend) and
kernels/backend_choice.py (timing the backends on made-up steps): both build or read it,
and attention.py uses backend_choice, so neither may be where it lives.
kernels.attention re-exports it; the layout it describes is in that module's docstring.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
