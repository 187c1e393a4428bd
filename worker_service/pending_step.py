"""A launched step's answer: its samples copied to pinned host memory while the GPU works,
then, once they are there, the StepResponse. The server finishes steps on another thread
than it launches them on; a PendingStep is all that thread touches."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.v1 import worker_pb2
from worker_service.sampler import StepSamples
from worker_service.step_plan import draft_ids
from worker_service.transfers import to_host


@dataclass
class PendingStep:
    """A launched step: its sampled ids are on their way to pinned host memory."""
    step_id: int
    t0: float
    tokens: torch.Tensor | None = None       # host (pinned on CUDA), int64
    logprobs: torch.Tensor | None = None     # host, float32
    top_ids: torch.Tensor | None = None      # host, int32 [rows, K]
    top_logprobs: torch.Tensor | None = None # host, float32 [rows, K]
    events: tuple | None = None              # CUDA (start, end) events,
    stream: torch.cuda.Stream | None = None  # on the stream the step runs on
    drafts: torch.Tensor | None = None       # host, int32 [D, max k]: the drafter's proposals,
    num_drafts: np.ndarray | None = None     # and how many of each row were asked for
    pooled: torch.Tensor | None = None       # host, float32: the pooling rows' answers,
    pooled_sizes: list[int] | None = None    # values per row,
    pool_at: np.ndarray | None = None        # and each row's place among the answers

    def copy_pooled(self, pooled, pool_at: np.ndarray) -> None:
        """Start copying the pooling rows' answers (pooler.Pooled) to the host; before
        copy_answer, whose end event then covers them."""
        self.pooled = to_host(pooled.values)
        self.pooled_sizes, self.pool_at = pooled.sizes, pool_at

    def copy_answer(self, samples: StepSamples | None, tokens: torch.Tensor | None) -> None:
        """Start copying the answer to the host (tokens: None on ranks that do not answer);
        the end event marks the step's GPU work done."""
        if tokens is not None:
            self.tokens = to_host(tokens)   # int64: cast on the answering thread
            if samples.logprobs is not None:
                self.logprobs = to_host(samples.logprobs.float())
            if samples.top_ids is not None:
                self.top_ids = to_host(samples.top_ids.to(torch.int32))
                self.top_logprobs = to_host(samples.top_logprobs.float())
        if self.events:
            self.events[1].record(self.stream)

    def host_ids(self) -> np.ndarray:
        """The sampled ids on the host (waits for their copy)."""
        if self.events:
            self.events[1].synchronize()
        return self.tokens.numpy()

    def response(self) -> worker_pb2.StepResponse:
        """Wait for the step and encode its answer."""
        resp = worker_pb2.StepResponse(step_id=self.step_id)
        if self.events:
            self.events[1].synchronize()
            resp.gpu_ms = self.events[0].elapsed_time(self.events[1])
        if self.tokens is not None or self.pool_at is not None:
            put = self._answers   # pooling rows: 0s in the sampling rows' arrays
            tokens = self.tokens.numpy() if self.tokens is not None else np.zeros(0, np.int32)
            resp.sampled_token_ids_i32 = put(tokens).astype("<i4", copy=False).tobytes()
            if self.logprobs is not None:
                resp.logprobs_f32 = put(self.logprobs.numpy()).astype("<f4", copy=False).tobytes()
            if self.top_ids is not None:
                resp.top_logprobs_k = self.top_ids.shape[1]
                resp.top_token_ids_i32 = put(self.top_ids.numpy()).astype("<i4", copy=False).tobytes()
                resp.top_logprobs_f32 = put(self.top_logprobs.numpy()).astype("<f4", copy=False).tobytes()
        if self.pooled is not None:
            resp.pooled_f32 = self.pooled.numpy().astype("<f4", copy=False).tobytes()
            resp.pooled_sizes_i32 = np.asarray(self.pooled_sizes, "<i4").tobytes()
        if self.drafts is not None:
            resp.draft_token_ids_i32 = draft_ids(self.drafts.numpy(), self.num_drafts)
        resp.step_ms = (time.perf_counter() - self.t0) * 1e3
        return resp

    def _answers(self, rows: np.ndarray) -> np.ndarray:
        """The sampling rows' values with a 0 (row) at each pooling row's place."""
        at = self.pool_at
        if at is None or not len(at):
            return rows
        return np.insert(rows, at - np.arange(len(at)), 0, axis=0)
