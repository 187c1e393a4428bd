"""An EAGLE-3 head (models/eagle3.py) as the proposer (proposer.py): one layer with a KV
cache of its own in the target's blocks, fed the target's features of each token (the
residual stream entering three of its layers, which the target's forward returns).

Its position i pairs the token after i with the features at i, so a step's rows are
mirrored shifted by one: a row takes the next row's token, a sequence's last sampling row
its sample (still on the device: no sync), a prefill chunk's last row nothing (its next
token is the next chunk's; that one position keeps stale KV: worse drafts, never wrong
output). A verify row whose next row was a rejected proposal is re-done by the first
draft pass, which pairs the newest token with the features of the position before it;
later passes feed the head's own output back. It drafts greedily and mirrors every row,
so it settles no sampled drafts and keeps no record of its own.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from worker_service.cuda_graphs import HeadGraphs
from worker_service.executors import EagerHead, Executor, Forward, StepInputs, run
from worker_service.kv_binding import KVFormat, bind_kv, unbind_kv
from worker_service.phases import phase
from worker_service.step_plan import DraftPlan, SeqTable, StepPlan
from worker_service.transfers import to_device, to_host

MAX_GRAPH_ROWS = 64   # its passes are a few rows of small kernels


class Eagle3Drafter:
    def __init__(self, model_dir: str, target, target_config, backend, device: torch.device,
                 dtype: torch.dtype):
        from models.eagle3 import load_eagle3
        self.model_dir = model_dir
        self.name = os.path.basename(os.path.normpath(model_dir))   # its checkpoint's
        self.device = device
        self.backend = backend
        self.head = load_eagle3(model_dir, target_config, target.model.embed_tokens, backend,
                                device, dtype)
        self.feature_layers = self.head.cfg.aux_layers
        self.layers = [self.head.attn]
        self.executors: list[Executor] = [EagerHead(self.head, device)]
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None
        self.features: torch.Tensor | None = None   # the last step's target features

    def bind_kv(self, num_blocks: int, block_size: int, fmt: KVFormat) -> None:
        self.kv_cache, self.kv_scales = bind_kv(self.layers, num_blocks, block_size, fmt,
                                                self.device)

    def free_kv(self) -> None:
        self.kv_cache = self.kv_scales = self.features = None
        self.executors = [EagerHead(self.head, self.device)]
        unbind_kv(self.layers)

    def capture(self, max_batch: int, max_model_len: int, block_size: int,
                phases: dict[str, float]) -> None:
        graphs = HeadGraphs(self.head, self.backend, min(max_batch, MAX_GRAPH_ROWS),
                            max_model_len, block_size, self.device)
        with phase(phases, f"{len(graphs.buckets)} EAGLE-3 head graphs"):
            graphs.capture()
        self.executors = [graphs, EagerHead(self.head, self.device)]

    def before_forward(self, plan: StepPlan, dropped: list[int]) -> None:
        return None

    @torch.inference_mode()
    def mirror(self, step: StepInputs, table: SeqTable, forward: Forward,
               samples: torch.Tensor | None) -> None:
        plan = step.plan
        self.features = forward.features
        n = len(plan.token_ids)
        token_row = np.repeat(np.arange(len(plan.rows)), plan.num_tokens)
        same = np.zeros(n, bool)   # the next token is the sequence's next row's input
        if n > 1:
            seq = np.asarray(plan.seq_ids, dtype=np.int64)[token_row]
            same[:-1] = seq[1:] == seq[:-1]
        nxt = np.zeros(n, np.int64)
        nxt[:-1] = plan.token_ids[1:]
        last = plan.last_token_index()   # sampling rows' last tokens, in sample order
        sampled = np.zeros(n, bool)
        sampled[last] = True
        sampled &= ~same
        slots = np.where(same | sampled, plan.slot_mapping, -1).astype(np.int32)
        ids = to_device(np.where(same, nxt, 0), self.device)
        if sampled.any():
            at = np.flatnonzero(sampled)
            order = np.searchsorted(last, at)   # each one's sample
            ids[to_device(at, self.device)] = samples.index_select(0, to_device(order, self.device))
        run(self.executors, StepInputs(plan, ids=ids, hidden=self.head.fuse(self.features),
                                       slot_mapping=slots, logits=False))

    @torch.inference_mode()
    def propose(self, drafts: DraftPlan, samples: torch.Tensor, table: SeqTable,
                step_id: int = 0) -> torch.Tensor:
        """As Drafter.propose (greedy drafts only); pass j writes the head's KV at the newest
        token's position - 1 + j."""
        newest, start, k = drafts.settle(samples.cpu().numpy(), table)   # (the sync)
        n, width = len(k), int(drafts.k.max())
        dev = self.device
        out = torch.full((n, width), -1, dtype=torch.int64, device=dev)
        ids = samples.index_select(0, to_device(newest, dev))
        rows_tok = drafts.first_token + (newest - drafts.first_sample)   # who sampled them
        hidden = self.head.fuse(self.features.index_select(0, to_device(rows_tok, dev)))
        for j in range(int(k.max())):
            live = np.flatnonzero(k > j)
            idx = None if len(live) == n else to_device(live, dev)
            pos = start[live] - 1 + j
            plan = table.decode_plan(drafts.rows[live], pos)
            x, h = (ids, hidden) if idx is None else (ids.index_select(0, idx),
                                                      hidden.index_select(0, idx))
            fwd = run(self.executors, StepInputs(plan, ids=x, hidden=h))
            nxt, h = fwd.out, fwd.features
            if idx is None:
                ids, hidden = nxt, h
                out[:, j] = nxt
            else:
                ids, hidden = ids.index_copy(0, idx, nxt), hidden.index_copy(0, idx, h)
                out[:, j].index_copy_(0, idx, nxt)
        return to_host(out.to(torch.int32))
