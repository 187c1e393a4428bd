"""Where tokens proposed ahead of sampling come from on the worker: the `Proposer` protocol
that the draft model (drafter.py) and the EAGLE-3 head (eagle3_drafter.py) implement, and
the one place that picks between them.

The step pipeline (model_runner.py) calls a proposer at three points and nowhere else:
before the target's forward (`before_forward`: which rows settle last step's sampled
drafts), after the step is committed (`mirror`: its own KV follows the target's, from the
step's inputs and the target's features), and when the step asked for drafts (`propose`).
Its KV cache lives in the target's blocks (kv_binding.py); its forwards run through its
own executors (executors.py), CUDA graphs first where captured.
"""
from __future__ import annotations

from typing import Protocol

import torch

from worker_service.executors import Forward, StepInputs
from worker_service.kv_binding import KVFormat
from worker_service.sampler import DraftCheck
from worker_service.step_plan import DraftPlan, SeqTable, StepPlan


class Proposer(Protocol):
    name: str                          # the draft checkpoint's directory name
    layers: list                       # its paged attention layers (KV beside the target's)
    feature_layers: tuple[int, ...]    # the target's layers whose input it drafts from

    def bind_kv(self, num_blocks: int, block_size: int, fmt: KVFormat) -> None:
        """Allocate its KV cache in the target's block geometry."""

    def free_kv(self) -> None:
        """Free its KV cache, graphs and whatever refers to cached positions."""

    def capture(self, max_batch: int, max_model_len: int, block_size: int,
                phases: dict[str, float]) -> None:
        """Capture its CUDA graphs (timed into `phases`)."""

    def before_forward(self, plan: StepPlan, dropped: list[int]) -> DraftCheck | None:
        """`dropped`: sequences dropped or sent afresh. -> the sampling rows that settle
        sampled drafts of the last step (None: none)."""

    def mirror(self, step: StepInputs, table: SeqTable, forward: Forward,
               samples: torch.Tensor | None) -> None:
        """Bring its KV up to the committed step (the target's `forward` gave features)."""

    def propose(self, drafts: DraftPlan, samples: torch.Tensor, table: SeqTable,
                step_id: int) -> torch.Tensor:
        """The drafting sequences' proposals: [D, max k] int32 host memory, -1 past a stop."""


def load_proposer(draft_dir: str, target, target_dir: str, tp, dtype: torch.dtype,
                  device: torch.device, backend, quantization: str, sampling: str) -> Proposer:
    """An EAGLE-3 head where the checkpoint is one, else a draft model."""
    from models.eagle3 import is_eagle3
    if is_eagle3(draft_dir):
        from worker_service.eagle3_drafter import Eagle3Drafter
        return Eagle3Drafter(draft_dir, target, target.config, backend, device, dtype)
    from worker_service.drafter import Drafter
    return Drafter(draft_dir, target_dir, target.config.vocab_size, tp, dtype, device, backend,
                   quantization, sampling)
