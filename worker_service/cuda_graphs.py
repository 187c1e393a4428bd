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
* PrefillGraphs: every other step of up to ROWS rows (prompts, prompt chunks, and decode
  rows beside them: a mixed step; pooling rows), bucketed by the step's token count;
  padding tokens belong to no row and padding rows have no tokens (attention skips both),
  and only each row's last token's logits and hidden state are computed.
* SplitGraphs: a mixed step with more rows than that (a few prompt chunks beside a large
  running batch, --max-background-prefill-tokens's steps) as two replays: its decode rows
  through DecodeGraphs, the rest through PrefillGraphs. Larger prefill steps stay eager:
  their launches are spread over many prompts' tokens.

With LoRA adapters (models/lora.py) each token's adapter slot is one more static input
(-1 for padding and the base model): the graph groups the rows by slot itself
(kernels.lora.lora_rows), so one graph serves any mix of adapters.

Each class is an executor (executors.py): `fits` says whether a step's shape has a graph,
`run` loads the step into the static inputs (by name, one host-to-device copy into one
arena of them: StaticLoad) and replays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import AttentionMetadata, decode_runs
from kernels.lora import lora_rows
from worker_service.executors import Forward, StepInputs
from worker_service.transfers import aligned_offsets, to_device


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(buckets + [max_batch]))


def arena(device: torch.device, specs: list[tuple[int, torch.dtype, int]]) -> list[torch.Tensor]:
    """Static input buffers, (numel, dtype, initial value) each, as views of one device
    allocation, so that StaticLoad fills any of them with one copy. Each starts 256-byte
    aligned, as an allocation of its own would: Triton specializes a pointer on it."""
    offsets, end = aligned_offsets([numel * dtype.itemsize for numel, dtype, _ in specs], 256)
    root = torch.empty(end, dtype=torch.uint8, device=device)
    bufs = [root[at:at + numel * dtype.itemsize].view(dtype)
            for (numel, dtype, _), at in zip(specs, offsets)]
    for buf, (_, _, fill) in zip(bufs, specs):
        buf.fill_(fill)
    return bufs


class StaticLoad:
    """Where one bucket's static inputs come from: a host image of the bytes of the arena
    (above) they lie in, each input's value where a step leaves it unset (padding) in its
    place, copied with one host-to-device transfer (a copy per buffer would cost the
    launching thread a call each: at batch 1 the host, not the GPU, set the step's pace).
    Built once per bucket; a step fills a fresh copy of the template by name, plus at most
    one part whose shape is the step's (its block tables), from the same host buffer."""

    def __init__(self, parts: list[tuple[str, torch.Tensor, int]]) -> None:
        """parts: (name, contiguous view of an arena buffer, padding value)."""
        storage = parts[0][1].untyped_storage()
        root = torch.empty(0, dtype=torch.uint8, device=parts[0][1].device).set_(storage)
        base = root.data_ptr()
        spans = []
        for _, dest, _ in parts:
            assert dest.untyped_storage().data_ptr() == base and dest.is_contiguous(), \
                "parts of one arena"
            spans.append((dest.data_ptr() - base, dest.numel() * dest.element_size()))
        lo, hi = min(at for at, _ in spans), max(at + n for at, n in spans)
        self.dest = root[lo:hi]
        # bytes outside the parts keep their value (a buffer's tail past this bucket: its
        # initial padding), so a load leaves every buffer as valid as it found it
        self.template = self.dest.cpu().numpy().copy()
        self.slices: dict[str, tuple[slice, np.dtype]] = {}
        for (name, dest, fill), (at, n) in zip(parts, spans):
            part = slice(at - lo, at - lo + n)
            dtype = np.dtype(str(dest.dtype).removeprefix("torch."))
            self.slices[name] = (part, dtype)
            self.template[part].view(dtype)[:] = fill
        self.tail_at = -(-len(self.template) // 16) * 16
        self.pin = root.device.type == "cuda"

    def host(self, tail: int = 0) -> "HostImage":
        """A fresh host buffer (pinned on CUDA) holding the padding, with room for `tail`
        int32 values after it; write a step's values by name."""
        host = torch.empty(self.tail_at + 4 * tail, dtype=torch.uint8, pin_memory=self.pin)
        image = HostImage(host, host.numpy())
        image.array[:len(self.template)] = self.template
        return image

    def part(self, host: "HostImage", name: str) -> np.ndarray:
        part, dtype = self.slices[name]
        return host.array[part].view(dtype)

    def copy(self, host: "HostImage", tail: tuple[torch.Tensor, np.ndarray] | None = None
             ) -> None:
        """Copy `host` into the buffers; tail: (int32 destination, values) of the step's own
        shape, staged after the template in the same host buffer."""
        self.dest.copy_(host.tensor[:len(self.template)], non_blocking=True)
        if tail is not None:
            dest, values = tail
            end = self.tail_at + 4 * values.size
            host.array[self.tail_at:end].view(np.int32)[:] = values.reshape(-1)
            src = host.tensor[self.tail_at:end]
            dest.copy_(src.view(torch.int32).view(dest.shape), non_blocking=True)


@dataclass
class HostImage:
    """One step's host buffer and its numpy view (made once: a load writes ~8 parts)."""
    tensor: torch.Tensor
    array: np.ndarray


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor | tuple   # the captured forward's output buffers (logits, or the head's)
    features: torch.Tensor | None = None   # the captured target features for an EAGLE-3 head
    tokens: torch.Tensor | None = None     # the ids the replay sampled (DecodeGraphs' sample)


def _capture(forward, pool, device: torch.device):
    """Run forward() once (Triton compiles, cuBLAS handles), then capture it into a graph
    in the memory pool the buckets share -> (the _Graph, that pool)."""
    forward()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    features = tokens = None
    if isinstance(out, Forward):
        out, features, tokens = out.out, out.features, out.tokens
    return _Graph(graph, out, features, tokens), graph.pool() if pool is None else pool


def _sampling_rows(logits: torch.Tensor, plan) -> torch.Tensor:
    """The sampling rows' logits among a decode step's (fast-forward rows sample only their
    last token; a numpy index is copied from pageable memory: in stream order)."""
    if plan.sample.all():
        return logits
    return logits.index_select(0, to_device(np.flatnonzero(plan.sample), logits.device))


class DecodeGraphs:
    """Decode steps of up to max_batch rows, one graph per bucket. feature_layers: the
    target's features an EAGLE-3 head needs (each graph leaves them in a buffer).
    sample: each replay also samples its rows with the fused kernel (kernels/sampling.py)
    from temperatures and seeds among its static inputs: for the usual step (StepInputs.
    sampling) two kernel launches from Python fewer, which at batch 1 were a quarter of the
    host's time a step; other steps sample after the replay, as before."""

    def __init__(self, model, backend, max_batch: int, max_model_len: int, block_size: int,
                 num_kv_heads: int, device: torch.device, lora=None, num_slots: int = 0,
                 feature_layers: tuple[int, ...] = (), sample: bool = False) -> None:
        self.model = model
        self.sample = sample
        self.lora, self.num_slots = lora, num_slots   # models/lora.LoraContext, its slots
        self.feature_layers = feature_layers
        self.backend = backend
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.num_kv_heads = num_kv_heads
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.buckets = batch_buckets(max_batch)
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        (self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.runs,
         self.lora_slot, self.temperature, self.seeds, self.fill_src) = arena(device, [
            (max_batch, torch.int64, 0), (max_batch, torch.int64, 0), (max_batch, torch.int32, -1),
            (max_batch, torch.int32, 0),
            (2 * max_batch, torch.int32, 0),   # bucket bs's runs: [:2 * bs] viewed as [2, bs]
            (max_batch, torch.int32, -1), (max_batch, torch.float32, 0.0),
            (max_batch, torch.int32, 0),
            (max_batch, torch.int64, 0)])   # each row's place among the last samples
        self.block_tables = torch.zeros(max_batch, self.max_blocks, **i32)
        self.cu_seqlens_q = torch.arange(max_batch + 1, **i32)
        self.cu_seqlens_k = torch.zeros(max_batch + 1, **i32)   # unused by decode kernels
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        self.loads = {bs: self._static_load(bs) for bs in self.buckets}

    def _static_load(self, bs: int) -> StaticLoad:
        """Bucket bs's inputs; padding rows store nothing (slot -1), attend to nothing
        (context 0) and are runs of one (place 0, one row left)."""
        parts = [("input_ids", self.input_ids[:bs], 0), ("positions", self.positions[:bs], 0),
                 ("slot_mapping", self.slot_mapping[:bs], -1),
                 ("context_lens", self.context_lens[:bs], 0),
                 ("run_place", self.runs[:bs], 0), ("run_left", self.runs[bs:2 * bs], 1),
                 ("fill_src", self.fill_src[:bs], 0)]
        if self.lora is not None:
            parts.append(("lora_slot", self.lora_slot[:bs], -1))
        if self.sample:   # padding rows: greedy
            parts += [("temperature", self.temperature[:bs], 0), ("seeds", self.seeds[:bs], 0)]
        return StaticLoad(parts)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            cu_seqlens_k=self.cu_seqlens_k[:bs + 1], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, is_decode=True,
            decode_runs=self.runs[:2 * bs].view(2, bs))

    def _forward(self, bs: int) -> Forward:
        if self.lora is not None:
            self.lora.rows = lora_rows(self.lora_slot[:bs], self.num_slots)
        hidden, features = self.model.features(self.input_ids[:bs], self.positions[:bs],
                                               self._meta(bs), self.feature_layers)
        logits = self.model.compute_logits(hidden)
        tokens = None
        if self.sample:
            from kernels.sampling import gumbel_sample
            tokens = gumbel_sample(logits, self.temperature[:bs], self.seeds[:bs],
                                   logprobs=False)[0]
        return Forward(logits, features, tokens=tokens)

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
        finally:
            if hasattr(self.backend, "decode_splits"):
                self.backend.decode_splits = saved
        torch.cuda.synchronize(self.device)

    def fits(self, step: StepInputs) -> bool:
        plan = step.plan
        return (plan.is_decode and len(plan.rows) <= self.max_batch
                and plan.block_tables.shape[1] <= self.max_blocks)

    def load(self, step: StepInputs) -> int:
        """Copy a fitting decode step of n rows into the static inputs, padded to the
        smallest bucket that holds it (padding rows store nothing, attend to nothing and
        are runs of one); returns that bucket. Rows that are one sequence's fast-forward
        tokens come with their runs (decode_runs)."""
        plan = step.plan
        n, w = len(plan.rows), plan.block_tables.shape[1]
        bs = next(b for b in self.buckets if b >= n)
        load = self.loads[bs]
        host = load.host(plan.block_tables.size)
        # every row a placeholder (the usual decode step): the rows' places among the last
        # samples ride the one copy, and one gather on the device fills the ids
        gather = (step.ids is None and step.fill is None and step.last is not None
                  and plan.fill is not None and len(plan.fill[0]) == n)
        if gather:
            load.part(host, "fill_src")[:n] = plan.fill[1]
        if step.ids is None:
            load.part(host, "input_ids")[:n] = plan.token_ids
        load.part(host, "positions")[:n] = plan.positions
        load.part(host, "slot_mapping")[:n] = (plan.slot_mapping if step.slot_mapping is None
                                               else step.slot_mapping)
        load.part(host, "context_lens")[:n] = plan.positions + 1
        runs = decode_runs(plan.rows)
        if runs is not None:
            load.part(host, "run_place")[:n] = runs[0]
            load.part(host, "run_left")[:n] = runs[1]
        if self.lora is not None and step.lora is not None:
            load.part(host, "lora_slot")[:n] = step.lora
        if self.sample and step.sampling is not None:
            load.part(host, "temperature")[:n], load.part(host, "seeds")[:n] = step.sampling
        load.copy(host, (self.block_tables[:n, :w], plan.block_tables))
        if step.ids is not None:
            self.input_ids[:n] = step.ids
        elif gather:
            torch.index_select(step.last, 0, self.fill_src[:n], out=self.input_ids[:n])
        elif (fill := step.placeholders()) is not None:
            self.input_ids[fill[0]] = fill[1]
        return bs

    def run(self, step: StepInputs) -> Forward:
        """One decode step -> the sampling rows' logits (None where the step asks for none
        or none sample) and the target's features of its n rows."""
        n = len(step.plan.rows)
        g = self.graphs[self.load(step)]
        g.graph.replay()
        features = None if g.features is None else g.features[:n]
        if not step.logits or not step.plan.num_samples:
            return Forward(None, features)
        sampled = g.tokens is not None and step.sampling is not None   # (every row samples)
        return Forward(_sampling_rows(g.out[:n], step.plan), features,
                       tokens=g.tokens[:n] if sampled else None)


def token_buckets(max_tokens: int) -> list[int]:
    """Prefill graph sizes: every 64 tokens up to 512, then every 128 up to max_tokens, so
    a prompt pads by at most 63 (127) tokens."""
    small = list(range(64, min(max_tokens, 512) + 1, 64))
    return small + list(range(640, max_tokens + 1, 128))


# Rows (sequences) one prefill replay holds. A replay costs ~2 ms of GPU time even for a
# few tokens (every weight is read) and an eager step of Qwen3-0.6B 15-25 ms of host
# launches (H200 host: tests/gpu/RESULTS.md), so a step's rows share one replay: prompt
# chunks beside decode rows (a mixed step), an embedding request's documents.
ROWS = 16


class PrefillGraphs:
    """Steps of up to ROWS rows and `max_tokens` tokens in all that are not pure decode
    steps (prompt chunks, cached prefix or not, beside decode rows or not), one replay
    each, padded to a token bucket. Attention must be the Triton paged prefill: its grid
    is sized by (bucket, ROWS) and its programs past a row's own tokens return at once
    (padding rows have no tokens and no context). Returns each row's last token's logits
    and hidden state: the sampling rows' logits and the pooling rows' vectors."""
    pools = True   # returns the pooling rows' hidden states (Forward.pooled)

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
        i64, i32 = torch.int64, torch.int32
        (self.input_ids, self.positions, self.slot_mapping, self.last, self.context_lens,
         self.cu_seqlens_q, self.cu_seqlens_k, self.lora_slot) = arena(device, [
            (t, i64, 0), (t, i64, 0), (t, i32, -1),
            (ROWS, i64, 0),   # each row's last token
            (ROWS, i32, 0), (ROWS + 1, i32, 0), (ROWS + 1, i32, 0), (t, i32, -1)])
        self.block_tables = torch.zeros(ROWS, mb, dtype=i32, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        # padding tokens store nothing and belong to no row; padding rows have no tokens
        parts = [("input_ids", self.input_ids, 0), ("positions", self.positions, 0),
                 ("slot_mapping", self.slot_mapping, -1), ("last", self.last, 0),
                 ("context_lens", self.context_lens, 0), ("cu_q", self.cu_seqlens_q[1:], -1),
                 ("cu_k", self.cu_seqlens_k[1:], -1)]
        if lora is not None:
            parts.append(("lora_slot", self.lora_slot, -1))
        self.static = StaticLoad(parts)   # (+ the step's block tables, in the same copy)

    def fits(self, step: StepInputs) -> bool:
        plan = step.plan
        return (step.logits and step.ids is None and step.hidden is None
                and len(plan.rows) <= ROWS and not plan.is_decode
                and int(plan.num_tokens.sum()) <= self.max_tokens
                and plan.block_tables.shape[1] <= self.max_blocks)

    def load(self, step: StepInputs) -> int:
        """Copy a fitting step into the static inputs, padded to the smallest bucket that
        holds its tokens; returns that bucket."""
        plan = step.plan
        n, r = int(plan.num_tokens.sum()), len(plan.rows)
        bucket = next(b for b in self.buckets if b >= n)
        ctx = plan.start_pos + plan.num_tokens
        load = self.static
        host = load.host(plan.block_tables.size)
        load.part(host, "input_ids")[:n] = np.where(plan.token_ids < 0, 0, plan.token_ids)
        load.part(host, "positions")[:n] = plan.positions
        load.part(host, "slot_mapping")[:n] = (plan.slot_mapping if step.slot_mapping is None
                                               else step.slot_mapping)
        cu_q = np.cumsum(plan.num_tokens)
        load.part(host, "last")[:r] = cu_q - 1
        load.part(host, "context_lens")[:r] = ctx
        load.part(host, "cu_q")[:] = n        # padding rows: empty, after the last real one
        load.part(host, "cu_q")[:r] = cu_q
        load.part(host, "cu_k")[:] = ctx.sum()
        load.part(host, "cu_k")[:r] = np.cumsum(ctx)
        if self.lora is not None and step.lora is not None:
            load.part(host, "lora_slot")[:n] = step.lora
        w = plan.block_tables.shape[1]
        load.copy(host, (self.block_tables[:r, :w], plan.block_tables))
        fill = step.placeholders()   # decode rows' placeholders: last step's samples
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        return bucket

    def forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured computation: the first `bucket` static tokens -> (logits [ROWS,
        vocab], hidden [ROWS, hidden]) of each row's last token."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables,
            context_lens=self.context_lens, cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k, max_seqlen_q=bucket,
            max_seqlen_k=self.max_model_len, is_decode=False)   # prefix_free unset: paged kernel
        if self.lora is not None:
            self.lora.rows = lora_rows(self.lora_slot[:bucket], self.num_slots)
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], meta)
        last = hidden.index_select(0, self.last)
        return self.model.compute_logits(last), last

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool. The static inputs
        hold no sequence while capturing: nothing is stored, attention returns at once."""
        for bucket in reversed(self.buckets):
            self.graphs[bucket], self.pool = _capture(lambda: self.forward(bucket), self.pool,
                                                      self.device)
        torch.cuda.synchronize(self.device)

    def run(self, step: StepInputs) -> Forward:
        g = self.graphs[self.load(step)]
        g.graph.replay()
        return rows_out(step.plan, *g.out)


def rows_out(plan, logits: torch.Tensor, hidden: torch.Tensor) -> Forward:
    """A prefill replay's per-row outputs -> the step's: the sampling rows' logits (None:
    none samples) and the pooling rows' hidden states, each in row order."""
    r = len(plan.rows)
    pooled = None
    if plan.pool is not None:
        pooled = hidden[:r].index_select(0, to_device(np.flatnonzero(plan.pool), hidden.device))
    if not plan.num_samples:
        return Forward(None, None, pooled)
    return Forward(_sampling_rows(logits[:r], plan), None, pooled)


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

    def _forward(self, bs: int) -> Forward:
        return Forward(*self.model(self.input_ids[:bs], self.hidden[:bs], self.positions[:bs],
                                   self._meta(bs)))

    def run(self, step: StepInputs) -> Forward:
        """One step of n rows (ids and hidden on the device) -> (next ids [n], hidden [n, H])."""
        n = len(step.plan.rows)
        bs = self.load(step)
        self.hidden[:n].copy_(step.hidden)
        g = self.graphs[bs]
        g.graph.replay()
        return Forward(g.out[:n], g.features[:n])


class SplitGraphs:
    """Mixed steps PrefillGraphs cannot hold in one replay for their many decode rows: the
    decode rows (a token each, not pooled) replay their DecodeGraphs bucket and the other
    rows a PrefillGraphs bucket. The rows are distinct sequences, so neither replay reads
    what the other writes; the logits come back in the step's sampling order. Two replays
    cost the GPU about what one eager step does, without its ~250 launches from Python."""
    pools = True   # the pooling rows go through PrefillGraphs, which returns them

    def __init__(self, decode: DecodeGraphs, prefill: PrefillGraphs) -> None:
        self.decode, self.prefill = decode, prefill

    @staticmethod
    def decode_rows(plan) -> np.ndarray:
        rows = plan.num_tokens == 1
        return rows if plan.pool is None else rows & ~plan.pool

    def fits(self, step: StepInputs) -> bool:
        plan = step.plan
        if not step.logits or step.ids is not None or step.hidden is not None or plan.is_decode:
            return False
        dec = self.decode_rows(plan)
        n_dec = int(dec.sum())
        return (0 < n_dec <= self.decode.max_batch and 0 < len(dec) - n_dec <= ROWS
                and int(plan.num_tokens[~dec].sum()) <= self.prefill.max_tokens
                and plan.block_tables.shape[1] <= min(self.decode.max_blocks,
                                                      self.prefill.max_blocks))

    def run(self, step: StepInputs) -> Forward:
        plan = step.plan
        dec = self.decode_rows(plan)
        first = self.prefill.run(step.subset(~dec))
        second = self.decode.run(step.subset(dec))
        outs = [f.out for f in (first, second) if f.out is not None]
        if not outs:
            return Forward(None, None, first.pooled)
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        order = np.concatenate([np.flatnonzero(plan.sample & ~dec), np.flatnonzero(plan.sample & dec)])
        if (np.diff(order) < 0).any():   # back to the step's row order
            out = out.index_select(0, to_device(np.argsort(order), out.device))
        return Forward(out, None, first.pooled)

