"""ModelRunner: owns the weights and the KV cache of one rank and executes Step batches.

The scheduler decides placement (block tables, slots); this class only turns a
StepRequest into tensors, runs the model, and samples. Per-sequence state kept between
steps is just the block table and the sampling params, so steps carry diffs.

A step is `launch`ed (inputs copied, kernels queued, sampled ids copied to pinned host
memory asynchronously) and later `finish`ed (wait, answer). The server launches step N+1
before finishing step N when it has already arrived, so the GPU never waits for the
answer round trip. A decode input token of -1 means "the id you sampled for this
sequence in the previous step": it is taken from the GPU tensor of that step's samples,
which lets the scheduler send step N+1 before it has read step N's ids.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.attention import AttentionMetadata, select_backend
from models.loader import load_model
from models.parallel import TPGroup
from models.qwen3 import kv_cache_layers
from nanoserve.v1 import worker_pb2
from worker_service.sampler import SamplingBatch, SamplingParams, sample


class StepError(ValueError):
    """A StepRequest that contradicts the worker's state (bad ids, unknown sequence)."""


@dataclass
class RunnerConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "auto"                   # auto = config's torch_dtype
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9   # CUDA: fraction of total memory for weights+activations+KV
    kv_cache_gb: float = 1.0              # CPU: KV cache size
    max_num_batched_tokens: int = 8192    # largest prefill the profiler plans for
    max_model_len: int = 0                # 0 = from the model config
    max_num_seqs: int = 256               # largest decode batch (CUDA graph buckets)
    enforce_eager: bool = False           # True: no CUDA graphs


PLACEHOLDER = -1


@dataclass
class PendingStep:
    """A launched step: its sampled ids are on their way to pinned host memory."""
    step_id: int
    t0: float
    tokens: torch.Tensor | None = None       # host (pinned on CUDA), int32
    logprobs: torch.Tensor | None = None     # host, float32
    events: tuple | None = None              # CUDA (start, end) events


@dataclass
class SeqState:
    block_table: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)


log = logging.getLogger("nanoserve.worker")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _i32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


class ModelRunner:
    def __init__(self, config: RunnerConfig, tp: TPGroup = TPGroup()):
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        self.backend = select_backend(config.attention_backend, self.device)
        self.model, self.hf_config = load_model(config.model_dir, tp=tp, dtype=dtype,
                                                device=self.device, attn_backend=self.backend)
        self.dtype = next(self.model.parameters()).dtype
        self.vocab_size = self.hf_config.vocab_size
        self.max_model_len = min(config.max_model_len or self.hf_config.max_position_embeddings,
                                 self.hf_config.max_position_embeddings)
        with open(os.path.join(config.model_dir, "config.json"), "rb") as f:
            self.fingerprint = hashlib.sha256(f.read()).hexdigest()[:16]
        eos = self.hf_config.eos_token_id
        self.eos_token_id = (eos[0] if isinstance(eos, list) else eos) or 0
        self.attn_layers = kv_cache_layers(self.model)
        self.num_kv_heads = self.attn_layers[0].num_kv_heads   # this rank's share
        self.head_dim = self.attn_layers[0].head_dim
        self.kv_cache: torch.Tensor | None = None
        self.block_size = 0
        self.seqs: dict[int, SeqState] = {}
        self.graphs = None                  # DecodeGraphs, captured at init_kv on CUDA
        # Samples of the last launched step (on device), for placeholder inputs.
        self.last_sampled: torch.Tensor | None = None
        self.last_rows: dict[int, int] = {}
        self._profiling = True
        self.peak_activation_bytes = self._profile() if self.device.type == "cuda" else 0
        self._profiling = False

    # ---- sizing ---------------------------------------------------------------------

    def block_bytes(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.attn_layers) * block_size * self.num_kv_heads * self.head_dim * elem

    def kv_capacity(self, block_size: int) -> int:
        """How many KV blocks of `block_size` tokens fit in this rank's budget."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_now = total - free
            budget = total * self.config.gpu_memory_utilization - used_now - self.peak_activation_bytes
        else:
            budget = self.config.kv_cache_gb * (1 << 30)
        return max(int(budget // self.block_bytes(block_size)), 0)

    @torch.inference_mode()
    def _profile(self) -> int:
        """Run the largest prefill once and return the activation memory it needed."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        block_size = 256
        n_tokens = self.config.max_num_batched_tokens
        seq_len = min(self.max_model_len, n_tokens)
        lens = [seq_len] * (n_tokens // seq_len) + ([n_tokens % seq_len] if n_tokens % seq_len else [])
        blocks_per_seq = -(-seq_len // block_size)
        self.init_kv(blocks_per_seq * len(lens), block_size)
        kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        works, slots = [], []
        for i, n in enumerate(lens):
            table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            works.append((i, n, 0, table, True))
            slots.append(np.arange(n) + table[0] * block_size)
        self._forward_and_sample(np.zeros(n_tokens, dtype=np.int32), works,
                                 np.concatenate(slots).astype(np.int32))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - kv_bytes
        self.kv_cache = None
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.seqs.clear()
        torch.cuda.empty_cache()
        return int(peak)

    def init_kv(self, num_blocks: int, block_size: int) -> None:
        """(Re)allocate the KV cache; forgets every sequence."""
        self._bind_device()
        self.kv_cache = None
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.kv_cache = torch.empty(2, len(self.attn_layers), num_blocks, block_size,
                                    self.num_kv_heads, self.head_dim,
                                    dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        self.block_size = block_size
        self.seqs.clear()
        self.last_sampled, self.last_rows = None, {}
        self.graphs = None
        if self.device.type == "cuda" and not self.config.enforce_eager and not self._profiling:
            from worker_service.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, self.backend, self.config.max_num_seqs,
                                       self.max_model_len, block_size, self.num_kv_heads,
                                       self.device)
            t0 = time.perf_counter()
            self.graphs.capture()
            log.info("captured %d decode CUDA graphs in %.1fs", len(self.graphs.buckets),
                     time.perf_counter() - t0)

    def _bind_device(self) -> None:
        """Make this runner's GPU the calling thread's current device. gRPC calls arrive on
        pool threads, whose current device is cuda:0: Triton kernels, CUDA events and
        empty_cache() follow the current device, so rank 1 (cuda:1) would break there."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def num_blocks(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.shape[2]

    # ---- one step -------------------------------------------------------------------

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        return self.finish(self.launch(req))

    @torch.inference_mode()
    def launch(self, req: worker_pb2.StepRequest) -> PendingStep:
        """Validate, queue the step's GPU work and the copy of its samples; no host sync."""
        if self.kv_cache is None:
            raise StepError("Step before Init: no KV cache allocated")
        self._bind_device()
        pending = PendingStep(req.step_id, time.perf_counter())
        for seq_id in req.drop_seq_ids:
            self.seqs.pop(seq_id, None)
        token_ids = _i32(req.token_ids_i32)
        slot_mapping = _i32(req.slot_mapping_i32)
        works = []
        for w in req.seqs:
            state = self._update_state(w)
            works.append((w.seq_id, w.num_tokens, w.start_pos, state.block_table, w.sample))
        fill = self._placeholders(token_ids, works)
        self._validate(token_ids, slot_mapping, works, fill)
        if self.device.type == "cuda":
            pending.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        tokens, logprobs = self._forward_and_sample(token_ids, works, slot_mapping, fill,
                                                    pending.events)
        rows = [w[0] for w in works if w[4]]
        if self.tp.size > 1:   # every rank needs the samples for the next step's placeholders
            if tokens is None:
                tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            self.tp.broadcast(tokens)
        if rows:
            self.last_sampled, self.last_rows = tokens, {seq_id: i for i, seq_id in enumerate(rows)}
        if tokens is not None and self.tp.rank == 0:
            pending.tokens = _to_host(tokens.to(torch.int32))
            if logprobs is not None:
                pending.logprobs = _to_host(logprobs.float())
        if pending.events:
            pending.events[1].record()
        return pending

    def is_done(self, pending: PendingStep) -> bool:
        return pending.events is None or pending.events[1].query()

    def finish(self, pending: PendingStep) -> worker_pb2.StepResponse:
        """Wait for a launched step and answer it."""
        resp = worker_pb2.StepResponse(step_id=pending.step_id)
        if pending.events:
            pending.events[1].synchronize()
            resp.gpu_ms = pending.events[0].elapsed_time(pending.events[1])
        if pending.tokens is not None:
            resp.sampled_token_ids_i32 = pending.tokens.numpy().astype("<i4", copy=False).tobytes()
            if pending.logprobs is not None:
                resp.logprobs_f32 = pending.logprobs.numpy().astype("<f4", copy=False).tobytes()
        resp.step_ms = (time.perf_counter() - pending.t0) * 1e3
        return resp

    def _placeholders(self, token_ids: np.ndarray, works: list) -> tuple[np.ndarray, np.ndarray] | None:
        """(positions in the step, rows of last_sampled) for -1 input tokens, or None."""
        where = np.flatnonzero(token_ids == PLACEHOLDER)
        if not len(where):
            return None
        ends = np.cumsum([w[1] for w in works]) - 1
        owner = np.searchsorted(ends, where)
        rows = []
        for pos, i in zip(where.tolist(), owner.tolist()):
            seq_id = works[i][0]
            if pos != ends[i] or seq_id not in self.last_rows:
                raise StepError(f"sequence {seq_id}: a placeholder input (-1) must be its last "
                                "token and follow a step that sampled for it")
            rows.append(self.last_rows[seq_id])
        return where, np.array(rows, dtype=np.int64)

    def _update_state(self, w: worker_pb2.SeqWork) -> SeqState:
        blocks = _i32(w.block_table_i32).tolist()
        if w.reset_block_table:
            s = w.sampling
            state = SeqState(blocks, SamplingParams(
                temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p,
                seed=s.seed if s.has_seed else None, logprobs=s.logprobs))
            self.seqs[w.seq_id] = state
            return state
        state = self.seqs.get(w.seq_id)
        if state is None:
            raise StepError(f"sequence {w.seq_id} unknown to this worker: resend it in full")
        state.block_table.extend(blocks)
        return state

    def _validate(self, token_ids: np.ndarray, slot_mapping: np.ndarray, works: list,
                  fill=None) -> None:
        total = sum(w[1] for w in works)
        if len(token_ids) != total or len(slot_mapping) != total:
            raise StepError(f"step has {len(token_ids)} token ids and {len(slot_mapping)} slots "
                            f"for {total} scheduled tokens")
        real = token_ids if fill is None else np.delete(token_ids, fill[0])
        if len(real) and (real.min() < 0 or real.max() >= self.vocab_size):
            raise StepError(f"token id out of range [0, {self.vocab_size})")
        if total and slot_mapping.max() >= self.num_blocks * self.block_size:
            raise StepError("slot out of range of the KV cache")
        for seq_id, n, start, table, _ in works:
            if n <= 0 or start + n > len(table) * self.block_size:
                raise StepError(f"sequence {seq_id}: {start}+{n} tokens exceed its "
                                f"{len(table)} blocks")
            if start + n > self.max_model_len:
                raise StepError(f"sequence {seq_id}: position {start + n} past max_model_len")
            if table and (min(table) < 0 or max(table) >= self.num_blocks):
                raise StepError(f"sequence {seq_id}: block id out of range")

    def _forward_and_sample(self, token_ids: np.ndarray, works: list, slot_mapping: np.ndarray,
                            fill: tuple[np.ndarray, np.ndarray] | None = None, events=None):
        """works: (seq_id, num_tokens, start_pos, block_table, sample) per sequence; fill:
        placeholder positions and the rows of last_sampled that replace them; events[0]
        is recorded just before the first device work (GPU time excludes host prep)."""
        n_tok = np.array([w[1] for w in works], dtype=np.int64)
        starts = np.array([w[2] for w in works], dtype=np.int64)
        ctx = starts + n_tok
        is_decode = bool((n_tok == 1).all())
        max_blocks = max(len(w[3]) for w in works)
        tables = np.zeros((len(works), max_blocks), dtype=np.int32)
        for i, w in enumerate(works):
            tables[i, :len(w[3])] = w[3]
        dev = self.device
        ids = np.where(token_ids == PLACEHOLDER, 0, token_ids) if fill is not None else token_ids
        if events is not None:
            events[0].record()
        fill_dev = None
        if fill is not None:
            fill_dev = (_to(fill[0], dev), self.last_sampled.index_select(0, _to(fill[1], dev)))
        rows = [i for i, w in enumerate(works) if w[4]]
        if is_decode and self.graphs is not None and len(works) <= self.graphs.max_batch \
                and max_blocks <= self.graphs.max_blocks:
            logits = self.graphs.run(ids, starts, slot_mapping, tables, fill_dev)
            logits = logits if len(rows) == len(works) else logits[rows]
        else:
            cu_q = np.zeros(len(works) + 1, dtype=np.int32)
            np.cumsum(n_tok, out=cu_q[1:])
            cu_k = np.zeros(len(works) + 1, dtype=np.int32)
            np.cumsum(ctx, out=cu_k[1:])
            positions = starts if is_decode else np.concatenate(
                [np.arange(s, s + n) for s, n in zip(starts, n_tok)])
            meta = AttentionMetadata(
                slot_mapping=_to(slot_mapping.astype(np.int32), dev),
                block_tables=_to(tables, dev),
                context_lens=_to(ctx.astype(np.int32), dev),
                cu_seqlens_q=_to(cu_q, dev),
                cu_seqlens_k=_to(cu_k, dev),
                max_seqlen_q=int(n_tok.max()),
                max_seqlen_k=int(ctx.max()),
                is_decode=is_decode,
                prefix_free=not starts.any(),
            )
            input_ids = _to(ids.astype(np.int64), dev)
            if fill_dev is not None:
                input_ids[fill_dev[0]] = fill_dev[1]
            hidden = self.model(input_ids, _to(positions.astype(np.int64), dev), meta)
            if not rows:
                return None, None
            last = _to(cu_q[1:][rows].astype(np.int64) - 1, dev)
            logits = self.model.compute_logits(hidden.index_select(0, last))
        if not rows or self.tp.rank != 0:
            return None, None
        params = [self.seqs[works[i][0]].sampling if works[i][0] in self.seqs else SamplingParams(0.0)
                  for i in rows]
        batch = SamplingBatch.build(params, [int(ctx[i]) for i in rows], self.vocab_size, dev)
        return sample(logits, batch)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor to host memory (pinned on CUDA: asynchronous)."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _to(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
