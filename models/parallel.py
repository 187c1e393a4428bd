"""Tensor-parallel group: which slice of every sharded weight this process holds.

Layers never call torch.distributed directly; they ask their TPGroup. With size 1 the
collectives are identities, so the same model code runs single-device with no process
group at all (and sharding math can be tested without one).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """Rank/size of tensor parallelism. `group` is the torch.distributed process group
    (None = the default group)."""
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    fast: Any = field(default=None, compare=False, repr=False)   # models.fast_all_reduce

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid TP rank/size {self.rank}/{self.size}")

    def use_peer_memory(self, fast) -> None:
        """Attach the peer-memory all-reduce. The group sets it up beside the weights load
        (worker_service/distributed.py), after the layers took this TPGroup, so it is filled
        in place, once, before the first forward."""
        object.__setattr__(self, "fast", fast)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks; identity for size 1. Use the result: decode-sized tensors
        return a new tensor from peer memory (`fast`), others are summed in place by NCCL."""
        if self.size == 1:
            return x
        if self.fast is not None and self.fast.handles(x):
            return self.fast(x)
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite x on every rank with rank src's x (in place); identity for size 1."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim, on every rank; identity for size 1."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact division, or a ValueError naming what could not be split evenly."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def check_shape(param: nn.Parameter, loaded: torch.Tensor, what: str) -> None:
    """Weight loaders copy, so a mismatched checkpoint must fail loudly, not broadcast."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: checkpoint shard has shape {tuple(loaded.shape)}, "
                         f"parameter expects {tuple(param.shape)}")


def replicated_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                             shard_id: object = None) -> None:
    """Every rank holds the whole tensor (norm weights, biases of row-parallel layers)."""
    if shard_id is not None:
        raise ValueError(f"replicated parameter got shard id {shard_id!r}")
    check_shape(param, loaded_weight, "replicated parameter")
    param.data.copy_(loaded_weight)
