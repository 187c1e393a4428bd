"""A StepPlan's attention metadata on the device: what an eager forward over the plan's
tokens gives the attention backends (CUDA graphs keep their own static copies). The
target's eager steps and the EAGLE-3 head's (drafter.py) both build it here."""
from __future__ import annotations

import numpy as np
import torch

from kernels.attention import AttentionMetadata, decode_runs
from worker_service.step_plan import StepPlan
from worker_service.transfers import to_device


def step_metadata(plan: StepPlan, device: torch.device, slot_mapping: np.ndarray | None = None
                  ) -> AttentionMetadata:
    """slot_mapping: instead of the plan's (e.g. -1 where a row stores nothing)."""
    n_tok, ctx = plan.num_tokens, plan.context_lens
    cu_q = np.zeros(len(n_tok) + 1, dtype=np.int32)
    np.cumsum(n_tok, out=cu_q[1:])
    cu_k = np.zeros(len(n_tok) + 1, dtype=np.int32)
    np.cumsum(ctx, out=cu_k[1:])
    runs = decode_runs(plan.rows) if plan.is_decode else None   # fast-forward rows
    return AttentionMetadata(
        slot_mapping=to_device(plan.slot_mapping if slot_mapping is None else slot_mapping, device),
        block_tables=to_device(plan.block_tables, device),
        context_lens=to_device(ctx.astype(np.int32), device),
        cu_seqlens_q=to_device(cu_q, device),
        cu_seqlens_k=to_device(cu_k, device),
        max_seqlen_q=int(n_tok.max()),
        max_seqlen_k=int(ctx.max()),
        is_decode=plan.is_decode,
        prefix_free=plan.prefix_free,
        decode_runs=None if runs is None else to_device(runs, device),
    )
