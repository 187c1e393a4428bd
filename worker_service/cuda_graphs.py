"""CUDA graphs for steps: one captured forward (+ LM head) per bucket.

A forward of a 0.6B model is ~250-300 small kernels; launched from Python that is
milliseconds of CPU per step, longer than the GPU work. A graph replays them with one
launch. Graphs need static shapes and addresses, so every input lives in a persistent
buffer sized for the largest bucket, and a step runs the smallest bucket that holds it,
padded (slot -1: nothing stored).

* DecodeGraphs: decode batches, bucketed by batch size; padding rows have context
  length 0 (attention yields zeros) and the first n rows of the logits are the answer.
  Rows that are one sequence's fast-forward tokens come with their runs
  (kernels.attention_metadata.decode_runs), which the Triton decode kernel reads from a
  buffer like every other input: a step with runs replays the same graph.
* PrefillGraphs: prefills of one sequence (online serving's usual prefill step: one new
  prompt, or one chunk of one), bucketed by token count; padding tokens belong to no
  sequence (attention skips them) and only the last real token's logits are computed.
  A prefill step of a few sequences replays one graph per sequence; larger batches stay
  eager: their launches are spread over many prompts' tokens.

With LoRA adapters (models/lora.py) each token's adapter slot is one more static input
(-1 for padding and the base model): the graph groups the rows by slot itself
(kernels.lora.lora_rows), so one graph serves any mix of adapters.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import AttentionMetadata
from kernels.lora import lora_rows
from worker_service.transfers import to_device


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(buckets + [max_batch]))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor        # [bucket, vocab] output buffer of the captured LM head


def _capture(forward, pool, device: torch.device):
    """Run forward() once (Triton compiles, cuBLAS handles), then capture it into a graph
    in the memory pool the buckets share -> (the _Graph, that pool)."""
    forward()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = forward()
    return _Graph(graph, logits), graph.pool() if pool is None else pool


class DecodeGraphs:
    def __init__(self, model, backend, max_batch: int, max_model_len: int, block_size: int,
                 num_kv_heads: int, device: torch.device, lora=None, num_slots: int = 0) -> None:
        self.model = model
        self.lora, self.num_slots = lora, num_slots   # models/lora.LoraContext, its slots
        self.backend = backend
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.num_kv_heads = num_kv_heads
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.buckets = batch_buckets(max_batch)
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.slot_mapping = torch.full((max_batch,), -1, **i32)
        self.context_lens = torch.zeros(max_batch, **i32)
        self.block_tables = torch.zeros(max_batch, self.max_blocks, **i32)
        self.cu_seqlens_q = torch.arange(max_batch + 1, **i32)
        self.cu_seqlens_k = torch.zeros(max_batch + 1, **i32)   # unused by decode kernels
        self.runs = torch.zeros(2 * max_batch, **i32)   # bucket bs: [:2 * bs] viewed as [2, bs]
        self.lora_slot = torch.full((max_batch,), -1, **i32)
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        # The target's features for an EAGLE-3 head (Qwen3Model.aux_hidden), each bucket's
        # as its graph leaves them; last_aux: the last replay's rows
        self.aux: dict[int, torch.Tensor] = {}
        self.last_aux: torch.Tensor | None = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            cu_seqlens_k=self.cu_seqlens_k[:bs + 1], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, is_decode=True,
            decode_runs=self.runs[:2 * bs].view(2, bs))

    def _forward(self, bs: int) -> torch.Tensor:
        if self.lora is not None:
            self.lora.rows = lora_rows(self.lora_slot[:bs], self.num_slots)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        from kernels.paged_attention import default_num_splits
        saved = getattr(self.backend, "decode_splits", None)
        try:
            for bs in reversed(self.buckets):
                if hasattr(self.backend, "decode_splits"):   # the grid is frozen in the graph
                    self.backend.decode_splits = default_num_splits(
                        bs, self.num_kv_heads, self.max_model_len, self.device)
                self.graphs[bs], self.pool = _capture(lambda: self._forward(bs), self.pool,
                                                      self.device)
                inner = getattr(self.model, "model", None)
                if getattr(inner, "aux_layers", ()):
                    self.aux[bs] = inner.aux_hidden
        finally:
            if hasattr(self.backend, "decode_splits"):
                self.backend.decode_splits = saved
        torch.cuda.synchronize(self.device)

    def load(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
             block_tables: np.ndarray, fill: tuple[torch.Tensor, torch.Tensor] | None = None,
             runs: np.ndarray | None = None, lora: np.ndarray | None = None) -> int:
        """Copy one decode step of n = len(input_ids) rows into the static inputs; returns
        the bucket that holds it (run() replays its graph).

        block_tables: [n, w] int32 with w <= max_blocks (context length = position + 1);
        fill: (rows, device ids) written over input_ids (placeholder inputs); runs: [2, n]
        (decode_runs) where some rows are one sequence's tokens, None: a sequence each;
        lora: [n] adapter slots (None: the base model for all)."""
        n = len(input_ids)
        bs = next(b for b in self.buckets if b >= n)
        w = block_tables.shape[1]
        # One H2D copy: ids | positions | slots | context lengths | runs' places | rows left
        # in runs (each bs long; padding rows store nothing, attend to nothing and are runs
        # of one) | the n rows' tables | (LoRA) each row's adapter slot, bs long.
        extra = bs if self.lora is not None else 0
        host = np.zeros(6 * bs + n * w + extra, dtype=np.int64)
        host[:n] = input_ids
        host[bs:bs + n] = positions
        host[2 * bs:3 * bs] = -1
        host[2 * bs:2 * bs + n] = slot_mapping
        host[3 * bs:3 * bs + n] = positions + 1
        host[5 * bs:6 * bs] = 1
        if runs is not None:
            host[4 * bs:4 * bs + n] = runs[0]
            host[5 * bs:5 * bs + n] = runs[1]
        host[6 * bs:6 * bs + n * w] = block_tables.ravel()
        if extra:
            host[6 * bs + n * w:] = -1
            if lora is not None:
                host[6 * bs + n * w:6 * bs + n * w + n] = lora
        dev = to_device(host, self.device)
        self.input_ids[:bs].copy_(dev[:bs])
        self.positions[:bs].copy_(dev[bs:2 * bs])
        self.slot_mapping[:bs].copy_(dev[2 * bs:3 * bs])
        self.context_lens[:bs].copy_(dev[3 * bs:4 * bs])
        self.runs[:2 * bs].copy_(dev[4 * bs:6 * bs])
        self.block_tables[:n, :w].copy_(dev[6 * bs:6 * bs + n * w].view(n, w))
        if extra:
            self.lora_slot[:bs].copy_(dev[6 * bs + n * w:])
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        return bs

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            block_tables: np.ndarray, fill: tuple[torch.Tensor, torch.Tensor] | None = None,
            runs: np.ndarray | None = None, lora: np.ndarray | None = None) -> torch.Tensor:
        """One decode step (see load) -> logits [n, vocab]."""
        bs = self.load(input_ids, positions, slot_mapping, block_tables, fill, runs, lora)
        self.graphs[bs].graph.replay()
        aux = self.aux.get(bs)
        self.last_aux = None if aux is None else aux[:len(input_ids)]
        return self.graphs[bs].logits[:len(input_ids)]


def token_buckets(max_tokens: int) -> list[int]:
    """Prefill graph sizes: every 64 tokens up to 512, then every 128 up to max_tokens, so
    a prompt pads by at most 63 (127) tokens."""
    small = list(range(64, min(max_tokens, 512) + 1, 64))
    return small + list(range(640, max_tokens + 1, 128))


# A replay costs ~2 ms of GPU time even for a few tokens (every weight is read), an eager
# prefill step ~14 ms of launches (H100 host, Qwen3-0.6B: tests/gpu/RESULTS.md): past a
# few sequences, one eager step beats a replay per sequence.
MAX_ROWS = 4


class PrefillGraphs:
    """Prefill steps of up to MAX_ROWS sequences of up to `max_tokens` tokens each, cached
    prefix or not, one replay per sequence. Attention must be the Triton paged prefill:
    its grid is sized by the bucket and its programs past the sequence's own tokens return
    at once."""

    def __init__(self, model, max_tokens: int, max_model_len: int, block_size: int,
                 device: torch.device, lora=None, num_slots: int = 0) -> None:
        self.model = model
        self.lora, self.num_slots = lora, num_slots   # models/lora.LoraContext, its slots
        self.buckets = token_buckets(max_tokens)
        if not self.buckets:
            raise ValueError(f"prefill graphs need max_tokens >= 64, got {max_tokens}")
        self.max_tokens = t = self.buckets[-1]
        self.max_model_len = max_model_len
        self.max_blocks = mb = -(-max_model_len // block_size)
        self.device = device
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(t, **i64)
        self.positions = torch.zeros(t, **i64)
        self.slot_mapping = torch.full((t,), -1, **i32)
        self.last = torch.zeros(1, **i64)                 # row of the last real token
        self.context_lens = torch.zeros(1, **i32)
        self.cu_seqlens_q = torch.zeros(2, **i32)
        self.cu_seqlens_k = torch.zeros(2, **i32)
        self.block_tables = torch.zeros(1, mb, **i32)
        self.lora_slot = torch.full((t,), -1, **i32)
        self.graphs: dict[int, _Graph] = {}
        self.pool = None

    def fits(self, plan) -> bool:
        return (len(plan.rows) <= MAX_ROWS and not plan.is_decode and plan.fill is None
                and int(plan.num_tokens.max()) <= self.max_tokens
                and plan.block_tables.shape[1] <= self.max_blocks)

    def load(self, plan, row: int = 0, lora: np.ndarray | None = None) -> int:
        """Copy one row (sequence) of a fitting plan into the static inputs, padded;
        returns its bucket. lora: the plan's [T] adapter slots (None: the base model)."""
        n = int(plan.num_tokens[row])
        first = int(plan.num_tokens[:row].sum())   # the row's tokens in the plan's arrays
        rows = slice(first, first + n)
        t, bucket = self.max_tokens, next(b for b in self.buckets if b >= n)
        ctx = int(plan.start_pos[row]) + n
        # One H2D copy: ids | positions | slots | last, ctx, n, ctx | table.
        extra = t if self.lora is not None else 0
        host = np.zeros(3 * t + 4 + self.max_blocks + extra, dtype=np.int64)
        host[:n] = plan.token_ids[rows]
        host[t:t + n] = plan.positions[rows]
        host[2 * t:3 * t] = -1
        host[2 * t:2 * t + n] = plan.slot_mapping[rows]
        host[3 * t:3 * t + 4] = (n - 1, ctx, n, ctx)
        w = plan.block_tables.shape[1]
        host[3 * t + 4:3 * t + 4 + w] = plan.block_tables[row]
        lo = 3 * t + 4 + self.max_blocks
        if extra:
            host[lo:] = -1
            if lora is not None:
                host[lo:lo + n] = lora[rows]
        dev = to_device(host, self.device)
        self.input_ids.copy_(dev[:t])
        self.positions.copy_(dev[t:2 * t])
        self.slot_mapping.copy_(dev[2 * t:3 * t])
        self.last.copy_(dev[3 * t:3 * t + 1])
        self.context_lens.copy_(dev[3 * t + 1:3 * t + 2])
        self.cu_seqlens_q[1:].copy_(dev[3 * t + 2:3 * t + 3])
        self.cu_seqlens_k[1:].copy_(dev[3 * t + 3:3 * t + 4])
        self.block_tables[0].copy_(dev[3 * t + 4:lo])
        if extra:
            self.lora_slot.copy_(dev[lo:])
        return bucket

    def forward(self, bucket: int) -> torch.Tensor:
        """The captured computation: the first `bucket` static tokens -> logits [1, vocab]."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables,
            context_lens=self.context_lens, cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k, max_seqlen_q=bucket,
            max_seqlen_k=self.max_model_len, is_decode=False)   # prefix_free unset: paged kernel
        if self.lora is not None:
            self.lora.rows = lora_rows(self.lora_slot[:bucket], self.num_slots)
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], meta)
        return self.model.compute_logits(hidden.index_select(0, self.last))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool. The static inputs
        hold no sequence while capturing: nothing is stored, attention returns at once."""
        for bucket in reversed(self.buckets):
            self.graphs[bucket], self.pool = _capture(lambda: self.forward(bucket), self.pool,
                                                      self.device)
        torch.cuda.synchronize(self.device)

    def run(self, plan, lora: np.ndarray | None = None) -> torch.Tensor | None:
        """A fitting plan's prefill -> logits [sampling rows, vocab] of each sampling row's
        last token (None: none samples). Each replay's logits are copied out before the
        next load (stream order)."""
        out = []
        for row in range(len(plan.rows)):
            g = self.graphs[self.load(plan, row, lora)]
            g.graph.replay()
            if plan.sample[row]:
                out.append(g.logits if len(plan.rows) == 1 else g.logits.clone())
        if not out:
            return None
        return out[0] if len(out) == 1 else torch.cat(out)


class HeadGraphs(DecodeGraphs):
    """An EAGLE-3 head's decode steps (models/eagle3.py): DecodeGraphs with one more static
    input, each row's hidden state, and (next ids, pre-norm hidden) as the output. Its
    forward is a dozen small kernels, each a Python-side Triton launch: eager, a pass cost
    ~0.6 ms of host time for ~0.3 ms of GPU work at Qwen3-8B_eagle3's shapes."""

    def __init__(self, head, backend, max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        super().__init__(head, backend, max_batch, max_model_len, block_size,
                         head.cfg.num_kv_heads, device)
        self.hidden = torch.zeros(max_batch, head.cfg.hidden_size, dtype=head.fc.weight.dtype,
                                  device=device)

    def _forward(self, bs: int):
        return self.model(self.input_ids[:bs], self.hidden[:bs], self.positions[:bs],
                          self._meta(bs))

    def run(self, ids: torch.Tensor, hidden: torch.Tensor, positions: np.ndarray,
            slot_mapping: np.ndarray, block_tables: np.ndarray, runs: np.ndarray | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of n rows (ids and hidden on the device) -> (next ids [n], hidden [n, H])."""
        n = len(positions)
        bs = self.load(np.zeros(n, np.int64), positions, slot_mapping, block_tables,
                       (torch.arange(n, device=self.device), ids), runs)
        self.hidden[:n].copy_(hidden)
        self.graphs[bs].graph.replay()
        out_ids, out_h = self.graphs[bs].logits
        return out_ids[:n], out_h[:n]
