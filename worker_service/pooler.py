"""The pooling stage: what a pooling row answers in place of a sample (worker.proto's
WorkerPooling), from the final hidden state of its last prompt token.

* embed (Qwen3-Embedding): last-token pooling, the first `dimensions` values (matryoshka),
  L2-normalised;
* score (Qwen3-Reranker): P(yes) = softmax(W[yes] . h, W[no] . h)[0], with W the LM head.
  Only those two rows are read (vLLM builds its Qwen3ForSequenceClassification from the
  same rows), never the vocabulary's logits.

Every rank runs it (a score's LM head rows are sharded over the vocabulary: one small
all-reduce); rank 0 answers. Pooling rows come only from prefill chunks, so they never
meet a CUDA graph (cuda_graphs.py declines steps with them) and need no decode state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.parallel import TPGroup
from nanoserve.v1 import worker_pb2
from worker_service.step_plan import PoolingParams

EMBED = worker_pb2.WorkerPooling.KIND_EMBED
SCORE = worker_pb2.WorkerPooling.KIND_SCORE


@dataclass
class Pooled:
    """A step's pooling answers, in the plan's pooling-row order, on the device."""
    values: torch.Tensor   # float32, every row's values concatenated
    sizes: list[int]       # values per row


class Pooler:
    def __init__(self, model, tp: TPGroup = TPGroup()) -> None:
        self.model, self.tp = model, tp

    def pool(self, hidden: torch.Tensor, params: list[PoolingParams]) -> Pooled:
        """hidden [N, H]: the pooling rows' final hidden states -> their answers."""
        h = hidden.float()
        outs: list[torch.Tensor | None] = [None] * len(params)
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):   # rows alike are computed together
            key = (p.kind, p.dimensions) if p.kind == EMBED else (p.kind, p.yes_token_id, p.no_token_id)
            groups.setdefault(key, []).append(i)
        for key, rows in groups.items():
            x = h[rows] if len(rows) < len(params) else h
            y = self._embed(x, key[1]) if key[0] == EMBED else self._score(x, key[1], key[2])
            for j, i in enumerate(rows):
                outs[i] = y[j]
        return Pooled(torch.cat([o.reshape(-1) for o in outs]), [o.numel() for o in outs])

    @staticmethod
    def _embed(h: torch.Tensor, dimensions: int) -> torch.Tensor:
        if dimensions:
            h = h[:, :dimensions]
        return torch.nn.functional.normalize(h, p=2.0, dim=-1)

    def _score(self, h: torch.Tensor, yes: int, no: int) -> torch.Tensor:
        """P(yes) per row from the LM head's yes and no rows (this rank's shard of them)."""
        head = self.model.lm_head
        w = head.weight
        ids = torch.tensor([yes, no], device=w.device) - head.vocab_start
        mine = (ids >= 0) & (ids < w.shape[0])
        rows = w.index_select(0, ids.clamp(0, w.shape[0] - 1)).float() * mine[:, None]
        logits = h @ rows.T                       # [N, 2]
        if self.tp.size > 1:
            logits = self.tp.all_reduce(logits.contiguous())
        return torch.softmax(logits, dim=-1)[:, :1]
