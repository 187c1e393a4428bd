"""On-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Everything stays on the logits' device; the only host sync is the caller reading the
sampled ids. On a GPU, a batch without top-k / top-p / min-p rows (the common case) is
sampled by one fused Triton pass over the logits (kernels/sampling.py: Gumbel-max with
Philox noise keyed by a per-row seed). Otherwise sampling uses the exponential race
(argmax of p / E with E ~ Exp(1)) over the filtered distribution. Either way both draw
exactly from the distribution, and a seeded request's noise comes from (seed, position),
so its tokens do not depend on which other requests share the batch. `sample_step` adds
what some requests ask for: penalties (worker_service/penalties.py) before sampling, and
log-probabilities / top-K alternatives of the raw logits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from models import kernel_choice
from worker_service.step_plan import SamplingParams
from worker_service.transfers import to_device, to_device_many


@dataclass
class SamplingBatch:
    """Per-row parameters as device tensors, built once per step."""
    temperature: torch.Tensor   # [N] float32 (0 rows are greedy)
    top_k: torch.Tensor         # [N] int64, vocab size where off
    top_p: torch.Tensor         # [N] float32
    min_p: torch.Tensor         # [N] float32
    seeded_rows: list[tuple[int, int]]   # (row, seed ^ position mix) for seeded rows
    seeds: torch.Tensor         # [N] int32 per-row Philox seeds (the fused path)
    fused: bool                 # one fused kernel pass (CUDA, no filtering rows)
    all_greedy: bool
    need_top_k_or_p: bool
    need_min_p: bool
    want_logprobs: bool
    top_logprobs: int = 0       # alternatives to return per row (the most any row asked)
    # CUDA, rows with and without top-k / top-p / min-p: (rows without, rows with), each
    # part sampled on its own rows' path (sample_split); None: one path for the batch
    split: tuple[list[int], list[int]] | None = None
    source: tuple = ()          # (params, positions, vocab_size, device): the parts' builds

    @classmethod
    def build(cls, params: list[SamplingParams], positions: list[int], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        temps = [p.temperature for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        seeded = [(i, _mix(p.seed, pos)) for i, (p, pos) in enumerate(zip(params, positions))
                  if p.seed is not None and p.temperature > 0]
        sampled_rows = [i for i, t in enumerate(temps) if t > 0]
        need_top_k_or_p = any(top_k[i] < vocab_size or top_p[i] < 1.0 for i in sampled_rows)
        need_min_p = any(min_p[i] > 0.0 for i in sampled_rows)
        filtered = [i for i in sampled_rows
                    if top_k[i] < vocab_size or top_p[i] < 1.0 or min_p[i] > 0.0]
        # the fused kernel where a row's own parameters allow it (CUDA; a test runs it in
        # the interpreter), so a seeded row's noise never follows its neighbours' filters
        cuda = torch.device(device).type == "cuda" or kernel_choice.FUSED_ON_CPU
        split = None
        if cuda and filtered and len(filtered) < len(params):
            split = ([i for i in range(len(params)) if i not in set(filtered)], filtered)
        row_seeds = _row_seeds(params, positions)
        temperature, top_k_t, top_p_t, min_p_t, seeds = to_device_many(   # one transfer
            [np.array(temps, np.float32), np.array(top_k, np.int64), np.array(top_p, np.float32),
             np.array(min_p, np.float32), np.array(row_seeds, np.int32)], torch.device(device))
        return cls(
            temperature=temperature, top_k=top_k_t, top_p=top_p_t, min_p=min_p_t,
            seeded_rows=seeded, seeds=seeds,
            # a row's path follows its own parameters alone (the split above), so under
            # --deterministic too a row samples the same way beside any neighbours
            fused=cuda and not filtered,
            all_greedy=not sampled_rows,
            need_top_k_or_p=need_top_k_or_p,
            need_min_p=need_min_p,
            want_logprobs=any(p.logprobs for p in params),
            top_logprobs=max((p.top_logprobs for p in params), default=0),
            split=split, source=(params, positions, vocab_size, device),
        )


def _row_seeds(params: list[SamplingParams], positions: list[int]) -> list[int]:
    """Each row's Philox seed for the fused kernel: a seeded request's from (seed, position),
    so its tokens do not depend on its neighbours; a fresh random one otherwise."""
    return [_mix(p.seed, pos) & 0x7FFFFFFF if p.seed is not None else random.getrandbits(31)
            for p, pos in zip(params, positions)]


def fused_inputs(params: list[SamplingParams], positions: list[int], vocab_size: int
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """(temperature [N] float32, seeds [N] int32) where the fused kernel alone samples these
    rows and nobody wants their log-probabilities: what a decode graph samples in its own
    replay (DecodeGraphs). None where a row filters (top-k, top-p, min-p) or asks for
    log-probabilities: `sample` after the forward."""
    for p in params:
        if (p.logprobs or p.top_logprobs or (p.temperature > 0 and (
                0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0))):
            return None
    return (np.array([p.temperature for p in params], np.float32),
            np.array(_row_seeds(params, positions), np.int32))


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, token position)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] -> (token ids [N] int64, logprobs of those ids [N] or None)."""
    if batch.split is not None:
        return sample_split(logits, batch)
    if batch.fused:
        from kernels.sampling import gumbel_sample
        return gumbel_sample(logits, batch.temperature, batch.seeds,
                             logprobs=batch.want_logprobs, greedy=batch.all_greedy)
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy
    else:
        probs = distribution(logits, batch.temperature, batch.top_k if batch.need_top_k_or_p
                             else None, batch.top_p, batch.min_p if batch.need_min_p else None)
        noise = torch.empty_like(probs).exponential_()
        for row, seed in batch.seeded_rows:
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            noise[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(batch.temperature > 0, sampled, greedy)
    logprobs = None
    if batch.want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs


def sample_split(logits: torch.Tensor, batch: SamplingBatch
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sample` of a batch.split batch: the rows without filters through the fused kernel,
    the rest through the filtered race, each part a batch of its own rows, so which noise a
    row draws (and a seeded row's token) depends on its own parameters alone."""
    params, positions, vocab_size, device = batch.source
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for rows in batch.split:
        part = SamplingBatch.build([params[i] for i in rows], [positions[i] for i in rows],
                                   vocab_size, device)
        at = to_device(np.array(rows, np.int64), logits.device)
        tokens[at] = sample(logits.index_select(0, at), part)[0]
    logprobs = None
    if batch.want_logprobs:
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs


def distribution(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """What a sampled row draws from: softmax(logits / T) cut to its top-k, its top-p
    nucleus and above min-p (unnormalized after the cuts: the races below need no sum);
    top_k / min_p None: no row cuts by them."""
    probs = torch.softmax(logits.float() / temperature.clamp_min(1e-6).unsqueeze(1), dim=-1)
    if top_k is not None:
        probs = _top_k_top_p(probs, top_k, top_p)
    if min_p is not None:
        keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs * keep
    return probs


@dataclass
class DraftCheck:
    """Sampling rows whose next token is a sampled draft: the rejection rule needs the
    distribution q the draft was drawn from (worker_service/drafter.py, sampled drafting)."""
    rows: torch.Tensor     # [n] int64 sampling rows
    drafts: torch.Tensor   # [n] int64 the draft each one checks
    q: torch.Tensor        # [n, V] float32, normalized


def check_drafts(logits: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor,
                 check: DraftCheck) -> torch.Tensor:
    """The standard rejection rule on check's rows: the draft x is kept with probability
    min(1, p(x) / q(x)), otherwise the row's token is drawn from max(p - q, 0), normalized
    (Leviathan et al. 2023; vLLM's rejection sampler). A kept draft is the row's sample and
    a replacement never equals it, so the scheduler's rule (a proposal is accepted while it
    equals the sample before it) settles the step unchanged, and every output token is
    distributed as p. `tokens` (every row's plain sample) is returned with those rows
    replaced. Noise of seeded rows is keyed by their (seed, position), as every draw."""
    rows = check.rows
    at = rows.tolist()
    p = distribution(logits.index_select(0, rows), batch.temperature[rows],
                     batch.top_k[rows], batch.top_p[rows], batch.min_p[rows])
    p = p / p.sum(-1, keepdim=True)
    q = check.q
    x = check.drafts.unsqueeze(1)
    uniform = torch.rand(len(at), device=p.device)
    noise = torch.empty_like(p).exponential_()
    seeded = dict(batch.seeded_rows)
    for i, row in enumerate(at):
        if row in seeded:
            gen = torch.Generator(device=p.device).manual_seed(_mix(seeded[row], 1))
            uniform[i] = torch.rand(1, device=p.device, generator=gen)[0]
            noise[i] = torch.empty(p.shape[1], device=p.device).exponential_(generator=gen)
    keep = uniform * q.gather(1, x).squeeze(1) <= p.gather(1, x).squeeze(1)
    other = (residual(p, q) / noise).argmax(-1)
    return tokens.index_copy(0, rows, torch.where(keep, check.drafts, other))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected draft's row draws from: max(p - q, 0) (unnormalized), or p where
    that is empty (p == q: never rejected but for rounding)."""
    rest = (p - q).clamp_min(0)
    return torch.where(rest.sum(-1, keepdim=True) > 0, rest, p)


def compile_fused_sampling(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Run each variant of the fused sampling kernels once on blank rows (logprobs or not,
    greedy or not, with PDL (one row) and without; the LM head's dtype, and float32:
    penalized logits), so Triton compiles
    them at startup: compiled at the first request that asks for one, the whole step
    (every stream in it) would wait for the compiler."""
    from kernels import pdl
    from kernels.sampling import gumbel_sample
    for rows in {1, pdl.MAX_ROWS + 1}:   # launched with PDL and without (kernels/pdl.py)
        temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        seeds = torch.zeros(rows, dtype=torch.int32, device=device)
        for logits_dtype in {dtype, torch.float32}:
            logits = torch.zeros(rows, vocab_size, dtype=logits_dtype, device=device)
            for logprobs in (False, True):
                for greedy in (False, True):
                    gumbel_sample(logits, temperature, seeds, logprobs=logprobs, greedy=greedy)


@dataclass
class StepSamples:
    tokens: torch.Tensor                 # [N] int64
    logprobs: torch.Tensor | None        # [N] float32: the sampled ids' log-probabilities
    top_ids: torch.Tensor | None = None  # [N, K] the K most likely ids, most likely first
    top_logprobs: torch.Tensor | None = None   # [N, K] float32
    constrained: list = field(default_factory=list)   # (row, matcher): grammar rows


def sample_step(logits: torch.Tensor, batch: SamplingBatch,
                penalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
                check: DraftCheck | None = None) -> StepSamples:
    """`sample` with the extras: `penalize` (penalties.PenaltyState.apply) changes the logits
    that are sampled from; `check`: rows that settle sampled drafts (check_drafts);
    log-probabilities, top-K included, are always of the raw logits (the model's own
    distribution, as vLLM reports them)."""
    raw = logits
    if penalize is not None:
        logits = penalize(logits)
    tokens, logprobs = sample(logits, batch)
    if check is not None:
        tokens = check_drafts(logits, batch, tokens, check)
    k = batch.top_logprobs
    log_probs = None
    changed = logprobs is not None and (penalize is not None or check is not None)
    if k or changed:
        log_probs = torch.log_softmax(raw.float(), dim=-1)
    if changed:
        logprobs = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    out = StepSamples(tokens, logprobs)
    if k:
        out.top_logprobs, out.top_ids = log_probs.topk(min(k, log_probs.shape[1]), dim=-1)
    return out


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside each row's top-k and outside its top-p nucleus."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    drop = rank >= top_k.unsqueeze(1)
    # Mass strictly before each token: a token is kept while that mass is below top_p,
    # so the most likely token always survives.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p.unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
