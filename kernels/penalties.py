"""Repetition / presence / frequency penalties in one pass over the penalized rows.

The torch reference (`apply_penalties_ref`) is about ten passes over [rows, vocab] (two
gathers, compares, two wheres, two multiply-subtracts); the kernel reads each row's logits,
prompt mask and output counts once and writes the logits in place. Repetition follows
Hugging Face's RepetitionPenaltyLogitsProcessor (logit * p where negative, logit / p
otherwise, for ids in the prompt or the output; the division is IEEE round-to-nearest,
so it is bit-exact), presence / frequency follow OpenAI (output ids only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def apply_penalties_ref(logits: torch.Tensor, prompt_mask: torch.Tensor, counts: torch.Tensor,
                        repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
                        ) -> torch.Tensor:
    """Penalized copy of logits [N, V] (float32). prompt_mask [N, V] bool, counts [N, V]
    output-id counts; repetition / presence / frequency [N] float32."""
    in_output = counts > 0
    rep = repetition.unsqueeze(1)
    x = torch.where(prompt_mask | in_output, torch.where(logits < 0, logits * rep, logits / rep),
                    logits)
    return (x - frequency.unsqueeze(1) * counts.to(logits.dtype)
            - presence.unsqueeze(1) * in_output.to(logits.dtype))


@triton.jit
def _penalties_kernel(Logits, stride_logits, Rows, Slots, Mask, Counts, stride_state,
                      Repetition, Presence, Frequency, V, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    row = tl.load(Rows + p).to(tl.int64)
    slot = tl.load(Slots + p).to(tl.int64)
    rep = tl.load(Repetition + p)
    presence = tl.load(Presence + p)
    frequency = tl.load(Frequency + p)
    x = tl.load(Logits + row * stride_logits + offs, mask=ok, other=0.0)
    seen = tl.load(Mask + slot * stride_state + offs, mask=ok, other=0)
    count = tl.load(Counts + slot * stride_state + offs, mask=ok, other=0)
    in_output = count > 0
    penalized = tl.where(x < 0, x * rep, tl.math.div_rn(x, rep))
    x = tl.where((seen != 0) | in_output, penalized, x)
    x = x - frequency * count.to(tl.float32)
    x = x - tl.where(in_output, presence, 0.0)
    tl.store(Logits + row * stride_logits + offs, x, mask=ok)


def apply_penalties_(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                     prompt_mask: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor,
                     presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """In place on logits [N, V] float32: rows[i] of it penalized with state row slots[i]
    of prompt_mask [S, V] bool and counts [S, V] int32 and the i-th penalty values."""
    n, v = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert prompt_mask.shape == counts.shape and prompt_mask.shape[1] == v
    assert prompt_mask.is_contiguous() and counts.is_contiguous() and counts.dtype == torch.int32
    if len(rows):
        block = 1024
        _penalties_kernel[(len(rows), triton.cdiv(v, block))](
            logits, logits.stride(0), rows, slots, prompt_mask.view(torch.uint8), counts, v,
            repetition, presence, frequency, v, BLOCK=block, num_warps=4)
    return logits
