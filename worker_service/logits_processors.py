"""The sampling rank's part of a step: what changes the logits before sampling, then the
sample (or the verdict on sampled drafts).

In vLLM's order: logit_bias (and min_tokens' bans), then penalties, then the output
formats' masks; log-probabilities stay those of the raw logits. The usual step has none
of them and goes straight to the sampler.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.grammar_mask import apply_token_bitmask_, apply_token_bitmask_ref
from worker_service.grammar import GrammarState
from worker_service.penalties import PenaltyState
from worker_service.sampler import (DraftCheck, SamplingBatch, StepSamples, fused_inputs,
                                    sample_step)
from worker_service.step_plan import SamplingParams, StepPlan
from worker_service.transfers import to_device


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens of the constrained rows to -inf: the kernel on a GPU (in place on
    this step's own copy of the logits), its torch reference elsewhere."""
    if logits.device.type == "cuda":
        return apply_token_bitmask_(logits, rows, masks)
    return apply_token_bitmask_ref(logits, rows, masks)


def logit_bias(params: list[SamplingParams], context_lens: list[int], device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, ids, biases) of the step's logit_bias entries, for index_put_ on the sampling
    rows' logits, with -inf for the ids a row's min_tokens still bans (its context length
    below banned_until); None where no sampling row has any (the usual case)."""
    entries = [(i, p.bias_ids, p.biases) for i, p in enumerate(params) if p.bias_ids]
    entries += [(i, p.banned_ids, (-np.inf,) * len(p.banned_ids)) for i, (p, n) in
                enumerate(zip(params, context_lens)) if p.banned_ids and n < p.banned_until]
    if not entries:
        return None
    rows = np.concatenate([np.full(len(ids), i, np.int64) for i, ids, _ in entries])
    ids = np.concatenate([np.asarray(ids, np.int64) for _, ids, _ in entries])
    biases = np.concatenate([np.asarray(b, np.float32) for _, _, b in entries])
    return to_device(rows, device), to_device(ids, device), to_device(biases, device)


def grammar_masks(grammar: GrammarState, constrained: list, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, bitmasks) of the constrained sampling rows on the device. Runs while the GPU
    computes this step's forward (already queued): first the matchers take the ids of
    earlier steps (sampled before this forward began), then the masks are filled on
    llguidance's threads into pinned memory and copied over asynchronously."""
    grammar.catch_up()
    cuda = device.type == "cuda"
    host = torch.empty((len(constrained), grammar.words), dtype=torch.int32, pin_memory=cuda)
    grammar.fill(constrained, host.numpy())
    rows = np.array([i for i, _ in constrained], dtype=np.int64)
    return to_device(rows, device), host.to(device, non_blocking=True)


def graph_sampling(plan: StepPlan, vocab_size: int, penalties: PenaltyState | None,
                   grammar: GrammarState | None, check: DraftCheck | None
                   ) -> tuple[np.ndarray, np.ndarray] | None:
    """The usual step's sampling inputs (sampler.fused_inputs), for an executor that samples
    in its forward: every row samples, none has a bias, a banned id, a penalty or a mask, no
    drafts are checked. None: sample_plan after the forward."""
    if check is not None or not len(plan.sample) or not plan.sample.all():
        return None
    if any(p.bias_ids or p.banned_ids for p in plan.sampling):
        return None
    if penalties is not None and penalties.slot_of and any(
            s in penalties.slot_of for s in plan.seq_ids):
        return None
    if grammar is not None and grammar.matchers and any(
            s in grammar.matchers for s in plan.seq_ids):
        return None
    return fused_inputs(plan.sampling, plan.context_lens.tolist(), vocab_size)


def sample_plan(logits: torch.Tensor, plan: StepPlan, vocab_size: int,
                penalties: PenaltyState | None, grammar: GrammarState | None,
                check: DraftCheck | None = None) -> StepSamples:
    """The plan's sampling rows' tokens from their logits, after bias, penalties and masks;
    check: rows that settle sampled drafts (Drafter.match)."""
    dev = logits.device
    ctx = plan.context_lens[plan.sample].tolist()
    batch = SamplingBatch.build(plan.sampling, ctx, vocab_size, dev)
    pen = penalties.rows(plan.sampling_seq_ids, plan.sampling) if penalties else None
    constrained = grammar.rows(plan.sampling_seq_ids) if grammar else []
    bias = logit_bias(plan.sampling, ctx, dev)
    if pen is None and not constrained and bias is None:   # the usual case
        return sample_step(logits, batch, check=check)
    masks = grammar_masks(grammar, constrained, dev) if constrained else None

    def adjust(x: torch.Tensor) -> torch.Tensor:
        """A copy of the logits for sampling to draw from (logprobs stay raw)."""
        if bias is not None:
            x = x.to(torch.float32, copy=True).index_put_(bias[:2], bias[2], accumulate=True)
        if pen is not None:
            x = penalties.apply(x, pen)
        elif bias is None:
            x = x.clone()
        return apply_token_bitmask(x, *masks) if masks is not None else x

    samples = sample_step(logits, batch, adjust, check)
    if pen is not None:
        penalties.record(pen, samples.tokens)
    samples.constrained = constrained
    return samples
