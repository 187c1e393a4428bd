"""Fused temperature sampling: one pass over the logits (Gumbel-max), split over the vocab.

argmax(logits / T + G) with G = -log(-log(U)), U ~ Uniform(0, 1), is an exact draw from
softmax(logits / T); T = 0 is plain argmax. One read of the (bf16) logits replaces the
softmax / noise / divide / argmax passes over a float32 copy, and the same pass can keep a
running logsumexp, so the sampled token's log-probability (of the unscaled logits) comes
for free when a row asks for it. U comes from Philox keyed by a per-row seed and the
vocab index: a seeded request draws the same noise whatever else is in the batch. Rows
that need top-k / top-p / min-p use the sampler's torch path instead (they need the
sorted distribution).

Each row's vocab is cut into CHUNK-wide pieces, one program each, and a second kernel
merges a row's pieces: a program per row alone (131 at the reference workload's mean
decode batch, ~150k ids each) leaves one warp per scheduler with a long dependent chain
(Philox, two logs per id). The merge takes the smallest index among the best scores, as
one pass over the row would, so the tokens do not depend on the chunking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.interpret import INTERPRET

LOG2E = tl.constexpr(1.4426950408889634)
BLOCK = 1024     # ids per loop iteration of a program
CHUNK = 8192     # ids per program (a multiple of BLOCK)


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
def _fast_log2(x):
    """log2 in one MUFU instruction (lg2.approx: ~2^-22 relative error, plenty for noise);
    tl.log2 goes through libdevice's accurate log, several times the instructions."""
    if INTERPRET:   # the CPU tests' interpreter runs no PTX
        return tl.log2(x)
    else:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _fold(best, best_idx, run_max, run_sum, x, offs, mask, u, t, inv_t, NOISE: tl.constexpr,
          LOGPROBS: tl.constexpr):
    """Fold one tile of ids into the lanes' best (score, index) and, with LOGPROBS, their
    online logsumexp of the raw logits. A lane sees its ids in increasing order and keeps
    the first best one (strict >)."""
    score = x
    if NOISE:
        # x / T + Gumbel noise, over ln 2 and less a constant (the same argmax):
        # -ln(-ln u) = -ln(ln 2) - ln 2 * log2(-log2 u).
        score = tl.where(t > 0, x * (inv_t * LOG2E) - _fast_log2(-_fast_log2(u)), x)
    score = tl.where(mask, score, float("-inf"))
    better = score > best
    best = tl.where(better, score, best)
    best_idx = tl.where(better, offs, best_idx)
    if LOGPROBS:
        new_max = tl.maximum(run_max, x)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.where(mask, tl.exp(x - safe), 0.0)
        run_max = new_max
    return best, best_idx, run_max, run_sum


@triton.jit
def _gumbel_chunk_kernel(Logits, stride_row, Temperature, Seeds, PartScore, PartIdx, PartMax,
                         PartSum, Uniform, V, num_chunks, BLOCK: tl.constexpr,
                         CHUNK: tl.constexpr, NOISE: tl.constexpr, LOGPROBS: tl.constexpr,
                         WRITE_UNIFORM: tl.constexpr, PDL: tl.constexpr):
    """One row's ids [chunk * CHUNK, +CHUNK) -> that piece's best score and its smallest
    index (and, with LOGPROBS, the piece's max and sum of exp(x - max)). NOISE = 0: every
    row is greedy, no Philox. A loop iteration takes BLOCK ids as four quarter tiles that
    share one Philox call (tl.rand4x: four uniforms per counter; the counter is the
    quarter tile's lane, id // 4 past the iteration's start, so each id has its own)."""
    Q: tl.constexpr = BLOCK // 4
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(Temperature + row)
    seed = tl.load(Seeds + row)
    inv_t = 1.0 / tl.maximum(t, 1e-6)
    best = tl.full([Q], float("-inf"), tl.float32)
    best_idx = tl.zeros([Q], tl.int32)
    run_max = tl.full([Q], float("-inf"), tl.float32)
    run_sum = tl.zeros([Q], tl.float32)
    lo = chunk * CHUNK
    lanes = tl.arange(0, Q)
    base = Logits + row * stride_row
    for start in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
        o0 = start + lanes
        o1 = o0 + Q
        o2 = o1 + Q
        o3 = o2 + Q
        x0 = tl.load(base + o0, mask=o0 < V, other=float("-inf")).to(tl.float32)
        x1 = tl.load(base + o1, mask=o1 < V, other=float("-inf")).to(tl.float32)
        x2 = tl.load(base + o2, mask=o2 < V, other=float("-inf")).to(tl.float32)
        x3 = tl.load(base + o3, mask=o3 < V, other=float("-inf")).to(tl.float32)
        u0, u1, u2, u3 = x0, x1, x2, x3   # unused without NOISE
        if NOISE:
            if WRITE_UNIFORM:
                u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)
                tl.store(Uniform + row * V + o0, u0, mask=o0 < V)
                tl.store(Uniform + row * V + o1, u1, mask=o1 < V)
                tl.store(Uniform + row * V + o2, u2, mask=o2 < V)
                tl.store(Uniform + row * V + o3, u3, mask=o3 < V)
            elif t > 0:   # a greedy row draws no noise (_fold ignores it there)
                u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)
        best, best_idx, run_max, run_sum = _fold(best, best_idx, run_max, run_sum, x0, o0,
                                                 o0 < V, u0, t, inv_t, NOISE, LOGPROBS)
        best, best_idx, run_max, run_sum = _fold(best, best_idx, run_max, run_sum, x1, o1,
                                                 o1 < V, u1, t, inv_t, NOISE, LOGPROBS)
        best, best_idx, run_max, run_sum = _fold(best, best_idx, run_max, run_sum, x2, o2,
                                                 o2 < V, u2, t, inv_t, NOISE, LOGPROBS)
        best, best_idx, run_max, run_sum = _fold(best, best_idx, run_max, run_sum, x3, o3,
                                                 o3 < V, u3, t, inv_t, NOISE, LOGPROBS)
    top = tl.max(best, axis=0)
    part = row * num_chunks + chunk
    tl.store(PartScore + part, top)
    tl.store(PartIdx + part, tl.min(tl.where(best == top, best_idx, V), axis=0))
    if LOGPROBS:
        m = tl.max(run_max, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(PartMax + part, m)
        tl.store(PartSum + part, tl.sum(run_sum * tl.exp(run_max - m_safe), axis=0))


@triton.jit
def _gumbel_merge_kernel(Logits, stride_row, PartScore, PartIdx, PartMax, PartSum, Tokens,
                         Logprobs, V, num_chunks, CHUNKS_PAD: tl.constexpr,
                         LOGPROBS: tl.constexpr, PDL: tl.constexpr):
    """A row's pieces -> its token (the smallest index among the best scores) and, with
    LOGPROBS, that token's log-probability under the raw logits."""
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    mask = offs < num_chunks
    base = row * num_chunks
    score = tl.load(PartScore + base + offs, mask=mask, other=float("-inf"))
    idx = tl.load(PartIdx + base + offs, mask=mask, other=V)
    top = tl.max(score, axis=0)
    token = tl.min(tl.where(mask & (score == top), idx, V), axis=0)
    tl.store(Tokens + row, token.to(tl.int64))
    if LOGPROBS:
        m_c = tl.load(PartMax + base + offs, mask=mask, other=float("-inf"))
        s_c = tl.load(PartSum + base + offs, mask=mask, other=0.0)
        m = tl.max(m_c, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.where(mask, s_c * tl.exp(m_c - m_safe), 0.0), axis=0)
        x_tok = tl.load(Logits + row * stride_row + token).to(tl.float32)
        tl.store(Logprobs + row, x_tok - m - tl.log(total))


_SCRATCH: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _scratch(device: torch.device, size: int, logprobs: bool) -> tuple[torch.Tensor, ...]:
    """The chunk pass's partial results, allocated once per shape: four allocations a step
    were a tenth of a batch-1 step's host time. Reuse is safe in stream order (each call's
    two kernels finish with them before the next call's first kernel runs). Separate
    allocations, not views of one: Triton specializes a pointer on its 16-byte alignment,
    and a view's offset would change it with n (a compile mid-serving)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = (device, size, logprobs)
    if capturing or key not in _SCRATCH:   # a graph's own scratch (DecodeGraphs' sample)
        f32 = dict(dtype=torch.float32, device=device)
        scores = torch.empty(size, **f32)
        scratch = (scores, torch.empty(size, dtype=torch.int32, device=device),
                   torch.empty(size, **f32) if logprobs else scores,
                   torch.empty(size, **f32) if logprobs else scores)
        if capturing:
            return scratch
        _SCRATCH[key] = scratch
    return _SCRATCH[key]


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  logprobs: bool = True, greedy: bool = False, return_uniform: bool = False):
    """logits [N, V] (any float dtype, last dim contiguous), temperature [N] float32,
    seeds [N] int32 -> (tokens [N] int64, logprobs [N] float32 or None[, U [N, V] for
    tests]). logprobs=False skips the logsumexp; greedy=True (every temperature is 0)
    skips the noise."""
    n, v = logits.shape
    assert logits.stride(-1) == 1 and temperature.shape == (n,) and seeds.shape == (n,)
    assert not (greedy and return_uniform), "greedy draws no noise"
    dev = logits.device
    chunks = triton.cdiv(v, CHUNK)
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    lp = torch.empty(n if logprobs else 1, dtype=torch.float32, device=dev)
    uniform = torch.empty((n, v) if return_uniform else (1,), dtype=torch.float32, device=dev)
    scores, idx, maxes, sums = _scratch(dev, n * chunks, logprobs)
    if n:
        _gumbel_chunk_kernel[(n, chunks)](
            logits, logits.stride(0), temperature, seeds, scores, idx, maxes, sums, uniform, v,
            chunks, BLOCK=BLOCK, CHUNK=CHUNK, NOISE=not greedy, LOGPROBS=logprobs,
            WRITE_UNIFORM=return_uniform, num_warps=4, **pdl.launch(dev, n))
        _gumbel_merge_kernel[(n,)](
            logits, logits.stride(0), scores, idx, maxes, sums, tokens, lp, v, chunks,
            CHUNKS_PAD=triton.next_power_of_2(chunks), LOGPROBS=logprobs, num_warps=1,
            **pdl.launch(dev, n))
    out = (tokens, lp if logprobs else None)
    return out + (uniform,) if return_uniform else out
