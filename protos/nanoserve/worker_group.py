"""The worker-group contract: what the scheduler's Engine gets from whatever runs its steps.

Two implementations: `scheduler_service.worker_client.WorkerGroup` (the worker services'
ranks over gRPC) and `worker_service.local_group.LocalWorkerGroup` (one in-process
ModelRunner, for benchmarks). Both offer `connect(block_size, num_kv_blocks, wait) ->
GroupInfo`, `send`/`receive` of Step messages, `healthy`, `close_streams` and `close`, and
fail with `WorkerGroupError`. One `send` may carry several steps (StepRequest.then: see
`steps_in`); each is answered by its own `receive`. The types of that contract live here, in
the package both planes may import, so neither plane imports the other. No grpc, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass


class WorkerGroupError(RuntimeError):
    """A rank failed or the ranks disagree; `lost` is True when a rank is unreachable."""

    def __init__(self, message: str, lost: bool = True):
        super().__init__(message)
        self.lost = lost


@dataclass
class GroupInfo:
    model: str
    fingerprint: str
    world_size: int
    num_kv_blocks: int      # min over ranks
    block_size: int
    vocab_size: int
    max_model_len: int
    eos_token_id: int
    kv_cache_dtype: str = ""
    structured_output: bool = False   # rank 0 follows grammars (WorkerInfo.structured_output)
    max_loras: int = 0                # LoRA slots (WorkerInfo.max_loras: min over ranks)
    num_host_kv_blocks: int = 0       # host-tier slots (min over ranks)
    draft_model: str = ""             # the drafter's model (WorkerInfo.draft_model; "": none)
    task: str = "generate"            # what the workers serve, comma-joined (WorkerInfo.task)
    hidden_size: int = 0              # an embedding's full size (WorkerInfo.hidden_size)
    deterministic: bool = False       # every rank runs batch-invariant kernels (--deterministic)


def steps_in(message) -> tuple:
    """A Step message's steps in order: itself, then those sent with it (StepRequest.then;
    the first keeps its `then`, which nothing past this reads)."""
    return (message, *message.then) if message.then else (message,)
