"""Fused temperature sampling: one pass over each row of logits (Gumbel-max).

argmax(logits / T + G) with G = -log(-log(U)), U ~ Uniform(0, 1), is an exact draw from
softmax(logits / T); T = 0 is plain argmax. One read of the (bf16) logits replaces the
softmax / noise / divide / argmax passes over a float32 copy, and the same pass keeps a
running logsumexp, so the sampled token's log-probability (of the unscaled logits) comes
for free. U comes from Philox keyed by a per-row seed: a seeded request draws the same
noise whatever else is in the batch. Rows that need top-k / top-p / min-p use the
sampler's torch path instead (they need the sorted distribution).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def gumbel_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference with the noise U given: (argmax(logits/T - log(-log U)), or argmax(logits)
    where T == 0; log_softmax(logits) at that token). The kernel draws U with Triton's
    Philox, which torch does not have, so its test reads U back from the kernel."""
    x = logits.float()
    t = temperature.float().unsqueeze(1)
    gumbel = -torch.log(-torch.log(uniform))
    scores = torch.where(t > 0, x / t.clamp_min(1e-6) + gumbel, x)
    tokens = scores.argmax(-1)
    logprobs = torch.log_softmax(x, -1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


@triton.jit
def _gumbel_sample_kernel(Logits, stride_row, Temperature, Seeds, Tokens, Logprobs, Uniform,
                          V, BLOCK: tl.constexpr, WRITE_UNIFORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Temperature + row)
    seed = tl.load(Seeds + row)
    inv_t = 1.0 / tl.maximum(t, 1e-6)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(Logits + row * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, offs)
        if WRITE_UNIFORM:
            tl.store(Uniform + row * V + offs, u, mask=mask)
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(t > 0, x * inv_t + gumbel, x)
        score = tl.where(mask, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, offs, best_idx)
        # online logsumexp of the raw logits, lane by lane
        new_max = tl.maximum(run_max, x)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.where(mask, tl.exp(x - safe), 0.0)
        run_max = new_max
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_idx, V), axis=0)
    m = tl.max(run_max, axis=0)
    total = tl.sum(run_sum * tl.exp(run_max - m), axis=0)
    x_tok = tl.load(Logits + row * stride_row + token).to(tl.float32)
    tl.store(Tokens + row, token.to(tl.int64))
    tl.store(Logprobs + row, x_tok - m - tl.log(total))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  return_uniform: bool = False):
    """logits [N, V] (any float dtype, last dim contiguous), temperature [N] float32,
    seeds [N] int32 -> (tokens [N] int64, logprobs [N] float32[, U [N, V] for tests])."""
    n, v = logits.shape
    assert logits.stride(-1) == 1 and temperature.shape == (n,) and seeds.shape == (n,)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    uniform = torch.empty((n, v) if return_uniform else (1,), dtype=torch.float32,
                          device=logits.device)
    if n:
        _gumbel_sample_kernel[(n,)](logits, logits.stride(0), temperature, seeds, tokens,
                                    logprobs, uniform, v, BLOCK=1024,
                                    WRITE_UNIFORM=return_uniform, num_warps=4)
    return (tokens, logprobs, uniform) if return_uniform else (tokens, logprobs)
