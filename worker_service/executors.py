"""How a step's forward runs: executors behind one interface, and the one choice among them.

An executor answers two questions about a step: does it fit (a CUDA graph has a largest
bucket and a widest block table; a small-batch kernel may decline a shape), and run it.
The target model, the draft model and the EAGLE-3 head each keep a list, most specialised
first and an eager executor last (it fits every step), and `run` takes the first that
fits: the one place where a step's path is chosen. A new way to run a step (issue 63's
persistent small-batch kernel) is one more entry that may decline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from worker_service.step_meta import step_metadata
from worker_service.step_plan import StepPlan
from worker_service.transfers import to_device, to_device_many


@dataclass
class StepInputs:
    """A step's inputs to a forward, by name: the plan's host arrays, and what is already on
    the device."""
    plan: StepPlan
    fill: tuple[torch.Tensor, torch.Tensor] | None = None   # placeholders: (indices into the
                                                            # plan's ids, device ids for them)
    last: torch.Tensor | None = None    # or the samples they come from (placeholders())
    ids: torch.Tensor | None = None     # [T] device ids in place of the plan's (drafters)
    lora: np.ndarray | None = None      # [T] adapter slot a token (-1: base); None: no adapters
    logits: bool = True                 # the sampling rows' logits (a draft mirror needs none)
    hidden: torch.Tensor | None = None  # [T, H] an EAGLE-3 head's input hidden states
    slot_mapping: np.ndarray | None = None   # in place of the plan's (-1: store nothing)
    # (temperature, seeds) of the rows where the step's sampling is the usual one
    # (logits_processors.graph_sampling): an executor may sample in its forward
    sampling: tuple[np.ndarray, np.ndarray] | None = None

    def subset(self, keep: np.ndarray, sampled: bool = True) -> "StepInputs | None":
        """The step's rows `keep` marks (StepPlan.subset): their placeholders, adapter slots
        and slots with them; with `sampled` their logits, else none (a draft model's mirror
        of what it has not computed yet). None where nothing is left."""
        plan = self.plan.subset(keep, sampled)
        if plan is None:
            return None
        tokens = np.repeat(keep, self.plan.num_tokens)
        fill = None
        if plan.fill is not None and self.last is None:   # the kept rows' placeholders
            kept = tokens[self.plan.fill[0]]
            have = self.placeholders()
            fill = (to_device(plan.fill[0], have[1].device),
                    have[1].index_select(0, to_device(np.flatnonzero(kept), have[1].device)))
        return StepInputs(plan, fill=fill, last=self.last, logits=sampled and self.logits,
                          lora=None if self.lora is None else self.lora[tokens],
                          slot_mapping=None if self.slot_mapping is None
                          else self.slot_mapping[tokens])


    def placeholders(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The plan's placeholders as (indices into its ids, their ids) on the device: `fill`,
        or gathered once from `last` (the decode graphs gather them in their own input
        copy and never ask: a step's host work is a few calls fewer)."""
        if self.fill is None and self.plan.fill is not None:
            if self.last is None:
                raise ValueError("placeholder inputs without the samples they stand for")
            at, src = to_device_many(list(self.plan.fill), self.last.device)
            self.fill = (at, self.last.index_select(0, src))
        return self.fill


@dataclass
class Forward:
    """What a forward leaves. A model: the sampling rows' logits (None where none were
    asked for or none sample), the features an EAGLE-3 head needs (None: none asked) and
    the pooling rows' final hidden states (None: the plan pools none; pooler.py).
    An EAGLE-3 head: its next ids and its hidden states. tokens: the sampled ids, where the
    executor sampled the step's `sampling` itself (None: sample the logits)."""
    out: torch.Tensor | None
    features: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


class Executor(Protocol):
    def fits(self, step: StepInputs) -> bool: ...

    def run(self, step: StepInputs) -> Forward: ...


def run(executors: Sequence[Executor], step: StepInputs) -> Forward:
    """The step through the first executor that takes it (the last, eager, takes all).
    A step with pooling rows goes only to executors that return their hidden states
    (`pools`: the eager one; graphs keep none)."""
    pools = step.plan.pool is not None
    for executor in executors:
        if (not pools or getattr(executor, "pools", False)) and executor.fits(step):
            return executor.run(step)
    raise AssertionError("no executor took the step: the eager one must come last")


def input_ids(step: StepInputs, device: torch.device) -> torch.Tensor:
    """The step's input ids on the device, placeholders filled."""
    if step.ids is not None:
        return step.ids
    plan = step.plan
    out = to_device(np.where(plan.token_ids < 0, 0, plan.token_ids), device)
    fill = step.placeholders()
    if fill is not None:
        out[fill[0]] = fill[1]
    return out


class Eager:
    """A model's forward op by op: takes every step (the reference path, big batches).
    adapters: the LoRA store whose rows the step sets; feature_layers: the target's
    features an EAGLE-3 head drafts from."""
    pools = True   # returns the pooling rows' hidden states (Forward.pooled)

    def __init__(self, model, device: torch.device, adapters=None,
                 feature_layers: tuple[int, ...] = ()) -> None:
        self.model, self.device = model, device
        self.adapters, self.feature_layers = adapters, feature_layers

    def fits(self, step: StepInputs) -> bool:
        return True

    def run(self, step: StepInputs) -> Forward:
        plan, dev = step.plan, self.device
        if self.adapters is not None:
            self.adapters.set_rows(step.lora)
        meta = step_metadata(plan, dev, step.slot_mapping)
        hidden, features = self.model.features(input_ids(step, dev), to_device(plan.positions, dev),
                                               meta, self.feature_layers)
        pooled = (hidden.index_select(0, to_device(plan.pool_token_index(), dev))
                  if plan.pool is not None else None)
        if not step.logits or not plan.num_samples:
            return Forward(None, features, pooled)
        last = to_device(plan.last_token_index(), dev)
        return Forward(self.model.compute_logits(hidden.index_select(0, last)), features, pooled)


class EagerHead:
    """An EAGLE-3 head's forward op by op (models/eagle3.py): ids + hidden -> (next ids,
    hidden)."""

    def __init__(self, head, device: torch.device) -> None:
        self.head, self.device = head, device

    def fits(self, step: StepInputs) -> bool:
        return True

    def run(self, step: StepInputs) -> Forward:
        plan, dev = step.plan, self.device
        meta = step_metadata(plan, dev, step.slot_mapping)
        return Forward(*self.head(input_ids(step, dev), step.hidden,
                                  to_device(plan.positions, dev), meta))
