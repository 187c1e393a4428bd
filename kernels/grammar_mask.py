"""Grammar (structured output) token mask applied to logits rows in place, in one launch.

The grammar engine (llguidance) fills, on the CPU, one int32 bitmask row per constrained
sequence: [M, W] with W = ceil(V / 32), token j allowed iff bit j % 32 of word j // 32 is
set (bit 31 is the sign bit, so a word with token 32k + 31 allowed is negative). Once that
mask is copied to the device, the kernel sets logits[rows[i], j] = -inf wherever bitmask[i]
clears bit j, without a host round trip and without the torch reference's [M, 32 * W]
int32 expansion (repeat_interleave, shift, compare, masked_fill, a gather and a scatter of
the rows): each program reads 32 words for its 1024 tokens and only stores, no logits read.
Tokens past 32 * W (a mask narrower than the vocab) are disallowed, as llguidance's own
apply_token_bitmask_inplace does; words past ceil(V / 32) are ignored. A row listed twice
gets both masks (the intersection of the allowed sets).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def apply_token_bitmask_ref(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
                            ) -> torch.Tensor:
    """Copy of logits [N, V] with logits[rows[i], j] = -inf wherever token j is disallowed
    by bitmask[i] (tokens j >= 32 * W too). rows [M] int64, bitmask [M, W] int32."""
    m, w = bitmask.shape
    v = logits.shape[1]
    nw = triton.cdiv(v, 32)
    words = torch.zeros(m, nw, dtype=torch.int32, device=bitmask.device)
    words[:, :min(w, nw)] = bitmask[:, :min(w, nw)]
    shift = torch.arange(32 * nw, dtype=torch.int32, device=bitmask.device) % 32
    bits = (words.repeat_interleave(32, dim=1) >> shift) & 1
    disallowed = (bits[:, :v] == 0).to(torch.int32)
    hits = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
    hits.index_add_(0, rows, disallowed)
    return logits.masked_fill(hits > 0, float("-inf"))


@triton.jit
def _token_bitmask_kernel(Logits, stride_logits, Rows, Bitmask, W, V, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    word_idx = offs // 32
    # other=0: tokens past the mask's 32 * W are disallowed
    word = tl.load(Bitmask + p.to(tl.int64) * W + word_idx, mask=ok & (word_idx < W), other=0)
    # arithmetic shift of a negative word fills with ones from the left, but & 1 keeps only
    # the bit that was shifted down to position 0, which is the wanted one for shifts 0..31
    allowed = ((word >> (offs % 32)) & 1) != 0
    row = tl.load(Rows + p).to(tl.int64)
    tl.store(Logits + row * stride_logits + offs, tl.full([BLOCK], float("-inf"), tl.float32),
             mask=ok & ~allowed)   # cast to the logits' dtype by the store; -inf is exact


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
                         ) -> torch.Tensor:
    """In place on logits [N, V] (float32 / bfloat16 / float16, unit column stride, any row
    stride): rows[i] of it masked with bitmask[i] ([M, W] contiguous int32). Returns logits."""
    n, v = logits.shape
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert logits.stride(1) == 1
    assert bitmask.dim() == 2 and bitmask.dtype == torch.int32 and bitmask.is_contiguous()
    assert rows.dim() == 1 and rows.dtype == torch.int64 and rows.shape[0] == bitmask.shape[0]
    assert rows.device == logits.device and bitmask.device == logits.device
    if len(rows):
        block = 1024
        _token_bitmask_kernel[(len(rows), triton.cdiv(v, block))](
            logits, logits.stride(0), rows, bitmask, bitmask.shape[1], v,
            BLOCK=block, num_warps=4)
    return logits
