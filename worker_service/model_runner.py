"""ModelRunner: owns the weights and the KV cache of one rank and executes Step batches.

The scheduler decides placement (block tables, slots); this class only turns a
StepRequest into tensors, runs the model, and samples. Per-sequence state kept between
steps (block tables, positions, sampling params) lives in a step_plan.SeqTable, so steps
carry diffs.

A step is `launch`ed (inputs copied, kernels queued, sampled ids copied to pinned host
memory asynchronously) and later `finish`ed (wait, answer). The server launches each step
as it arrives and finishes steps on another thread (finish touches only its PendingStep),
so the GPU never waits for the answer round trip and no launch delays an answer. A
decode input token of -1 means "the id you sampled for this sequence in the previous
step": it is taken from the GPU tensor of that step's samples, which lets the scheduler
send step N+1 before it has read step N's ids.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import decode_runs, new_kv_cache, select_backend
from kernels.backend_choice import AttentionShapes
from kernels.grammar_mask import apply_token_bitmask_, apply_token_bitmask_ref
from kernels.kv_quant import FP8_DTYPE
from models.loader import config_dtype, load_config, load_model
from models.parallel import TPGroup
from models.qwen3 import _head_dim, kv_cache_layers
from nanoserve.grammar_tokenizer import load_tokenizer
from nanoserve.v1 import worker_pb2
from worker_service.adapters import AdapterStore
from models.eagle3 import is_eagle3
from worker_service.drafter import Drafter, Eagle3Drafter
from worker_service.grammar import GrammarState
from worker_service.host_tier import HostTier, check_ops
from worker_service.penalties import PenaltyState
from worker_service.sampler import (DraftCheck, SamplingBatch, StepSamples, compile_fused_sampling,
                                    sample_step)
from worker_service.step_meta import step_metadata
from worker_service.step_plan import SamplingParams, SeqTable, StepError, StepPlan, draft_ids
from worker_service.transfers import to_device, to_host


@dataclass
class RunnerConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "auto"                   # auto = config's torch_dtype
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"          # auto = the model's dtype; fp8 = e4m3 + per-token scales
    quantization: str = "auto"            # weights: auto (as the checkpoint) | none | fp8
    gpu_memory_utilization: float = 0.9   # CUDA: fraction of total memory for weights+activations+KV
    kv_cache_gb: float = 1.0              # CPU: KV cache size
    max_num_batched_tokens: int = 8192    # largest prefill the profiler plans for
    max_model_len: int = 0                # 0 = from the model config
    max_num_seqs: int = 256               # largest decode batch (CUDA graph buckets)
    max_prefill_graph_tokens: int = 2048  # one-sequence prefills up to this replay a graph; 0: none
    enforce_eager: bool = False           # True: no CUDA graphs
    host_kv_cache_gb: float = 0.0         # host tier of the prefix cache (0: none)
    max_loras: int = 0                    # LoRA adapters resident at once (0: no LoRA)
    max_lora_rank: int = 16
    draft_model: str = ""                 # speculative decoding's draft model (drafter.py)
    draft_sampling: str = "greedy"        # or sampled: drafts drawn from q (drafter.py)


@dataclass
class PendingStep:
    """A launched step: its sampled ids are on their way to pinned host memory."""
    step_id: int
    t0: float
    tokens: torch.Tensor | None = None       # host (pinned on CUDA), int32
    logprobs: torch.Tensor | None = None     # host, float32
    top_ids: torch.Tensor | None = None      # host, int32 [rows, K]
    top_logprobs: torch.Tensor | None = None # host, float32 [rows, K]
    events: tuple | None = None              # CUDA (start, end) events
    drafts: torch.Tensor | None = None       # host, int32 [D, max k]: the drafter's proposals,
    num_drafts: np.ndarray | None = None     # and how many of each row were asked for


log = logging.getLogger("nanoserve.worker")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "fp8")


@contextlib.contextmanager
def phase(phases: dict[str, float], name: str):
    """Time a start-up phase into `phases` (seconds; the worker logs them in one line)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


def phases_line(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + \
        f"; total {sum(phases.values()):.1f} s"


def _i32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


def _host_ids(pending: PendingStep):
    """A getter of a launched step's sampled ids on the host (waits for their copy)."""
    def ids() -> np.ndarray:
        if pending.events:
            pending.events[1].synchronize()
        return pending.tokens.numpy()
    return ids


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens of the constrained rows to -inf: the kernel on a GPU (in place on
    this step's own copy of the logits), its torch reference elsewhere."""
    if logits.device.type == "cuda":
        return apply_token_bitmask_(logits, rows, masks)
    return apply_token_bitmask_ref(logits, rows, masks)


def logit_bias(params: list[SamplingParams], context_lens: list[int], device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, ids, biases) of the step's logit_bias entries, for index_put_ on the sampling
    rows' logits, with -inf for the ids a row's min_tokens still bans (its context length
    below banned_until); None where no sampling row has any (the usual case)."""
    entries = [(i, p.bias_ids, p.biases) for i, p in enumerate(params) if p.bias_ids]
    entries += [(i, p.banned_ids, (-np.inf,) * len(p.banned_ids)) for i, (p, n) in
                enumerate(zip(params, context_lens)) if p.banned_ids and n < p.banned_until]
    if not entries:
        return None
    rows = np.concatenate([np.full(len(ids), i, np.int64) for i, ids, _ in entries])
    ids = np.concatenate([np.asarray(ids, np.int64) for _, ids, _ in entries])
    biases = np.concatenate([np.asarray(b, np.float32) for _, _, b in entries])
    return to_device(rows, device), to_device(ids, device), to_device(biases, device)


class ModelRunner:
    def __init__(self, config: RunnerConfig, tp: TPGroup = TPGroup()):
        self.config = config
        self.tp = tp
        self.phases: dict[str, float] = {}        # start-up time by phase
        self.init_phases: dict[str, float] = {}   # the last Init's, likewise
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            with phase(self.phases, "cuda context"):   # driver + context: seconds, named apart
                if self.device.index is None:
                    self.device = torch.device("cuda", torch.cuda.current_device())
                torch.cuda.set_device(self.device)
                torch.empty(1, device=self.device)
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        if config.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {config.kv_cache_dtype!r}: expected "
                             f"{' or '.join(KV_CACHE_DTYPES)}")
        self.kv_fp8 = config.kv_cache_dtype == "fp8"
        # auto times flash_attn (when its build covers the model) and triton on this
        # rank's attention shapes and keeps the faster: kernels/backend_choice.py.
        with phase(self.phases, "config"):
            hf = load_config(config.model_dir)
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        shapes = AttentionShapes(num_heads=hf.num_attention_heads // tp.size,
                                 num_kv_heads=max(1, kv_heads // tp.size),
                                 head_dim=_head_dim(hf), dtype=dtype or config_dtype(hf))
        with phase(self.phases, "attention backend"):
            self.backend = select_backend(config.attention_backend, self.device, shapes=shapes,
                                          kv_fp8=self.kv_fp8)
        log.info("attention backend: %s", self.backend.name)
        self.model, self.hf_config = load_model(config.model_dir, tp=tp, dtype=dtype,
                                                device=self.device, attn_backend=self.backend,
                                                quantization=config.quantization,
                                                phases=self.phases)   # weights and their parts
        self.dtype = next(self.model.parameters()).dtype
        self.drafter: Drafter | Eagle3Drafter | None = None
        self.step_aux: torch.Tensor | None = None   # EAGLE-3: the last forward's features
        if config.draft_model:
            with phase(self.phases, "draft weights"):
                if is_eagle3(config.draft_model):
                    self.drafter = Eagle3Drafter(config.draft_model, self.model, self.hf_config,
                                                 self.backend, self.device, self.dtype)
                else:
                    self.drafter = Drafter(config.draft_model, config.model_dir,
                                           self.hf_config.vocab_size, tp, self.dtype,
                                           self.device, self.backend, config.quantization,
                                           config.draft_sampling)
        # LoRA slots before the profile run, so the KV budget leaves them their room
        self.adapters = (AdapterStore(self.model, config.max_loras, config.max_lora_rank)
                         if config.max_loras else None)
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
        self.host: HostTier | None = None   # the prefix cache's host tier (host_tier.py)
        self.copy_stream = None      # CUDA: the host tier's copies run here, beside forwards
        self._copies_done = None     # CUDA event: the last step's copies (the next waits)
        self.kv_scales: torch.Tensor | None = None   # fp8: [2, layers, blocks, block_size] fp32
        self.block_size = 0
        self.table: SeqTable | None = None  # per-sequence state, reset by init_kv
        self.penalties: PenaltyState | None = None   # rank 0 (it samples): penalized seqs
        self.grammar: GrammarState | None = None     # rank 0: constrained seqs' matchers
        # llguidance's tokenizer (~0.5 s to build for a 150k vocabulary): once, at start.
        with phase(self.phases, "grammar tokenizer"):
            self.grammar_tokenizer = (load_tokenizer(config.model_dir, self.vocab_size,
                                                     self.eos_token_id) if tp.rank == 0 else None)
        self.graphs = None                  # DecodeGraphs, captured at init_kv on CUDA
        self.prefill_graphs = None          # PrefillGraphs, likewise (triton backend)
        # Samples of the last step that sampled (on device), for placeholder inputs.
        self.last_sampled: torch.Tensor | None = None
        self._await_group()
        self._profiling = True
        with phase(self.phases, "profile run"):
            self.peak_activation_bytes = self._profile() if self.device.type == "cuda" else 0
        self._profiling = False
        self.kv_budget_bytes = self._kv_budget_bytes()

    def _await_group(self) -> None:
        """TP ranks (distributed.TPModelRunner) wait here for the rest of their group's
        set-up, which ran beside the weights load; nothing to wait for alone."""

    # ---- sizing ---------------------------------------------------------------------

    @property
    def kv_cache_dtype_name(self) -> str:
        return "fp8_e4m3" if self.kv_fp8 else str(self.dtype).removeprefix("torch.")

    def block_bytes(self, block_size: int, draft: bool = True) -> int:
        """K and V bytes of one block over all layers (fp8: values + a 4-byte scale per
        token), the draft model's included (draft=False: the target's alone)."""
        def layers_bytes(layers, heads: int, head_dim: int) -> int:
            values = heads * head_dim
            per_token = values + 4 if self.kv_fp8 else values * self.dtype.itemsize
            return 2 * len(layers) * block_size * per_token
        d = self.drafter
        return layers_bytes(self.attn_layers, self.num_kv_heads, self.head_dim) + (
            layers_bytes(d.layers, d.num_kv_heads, d.head_dim) if draft and d else 0)

    def _kv_budget_bytes(self) -> float:
        """What the KV cache may take on this rank, measured once, before there is a cache:
        a scheduler that connects again (a restarted engine core) gets the room the first
        one got, not what is left beside the cache and CUDA graphs this worker already
        holds (init_kv replaces both)."""
        if self.device.type != "cuda":
            return self.config.kv_cache_gb * (1 << 30)
        free, total = torch.cuda.mem_get_info(self.device)
        return total * self.config.gpu_memory_utilization - (total - free) - self.peak_activation_bytes

    def host_capacity(self, block_size: int) -> int:
        """Host-tier slots of `block_size` tokens that --host-kv-cache-gb holds."""
        return int(self.config.host_kv_cache_gb * (1 << 30)
                   // self.block_bytes(block_size, draft=False))

    def kv_capacity(self, block_size: int) -> int:
        """How many KV blocks of `block_size` tokens fit in this rank's budget."""
        return max(int(self.kv_budget_bytes // self.block_bytes(block_size)), 0)

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
        kv_bytes = self.block_bytes(block_size) * self.num_blocks
        req = worker_pb2.StepRequest(step_id=0)
        for i, n in enumerate(lens):
            req.seqs.add(seq_id=i, num_tokens=n, start_pos=0, reset_block_table=True, sample=True,
                         block_table_i32=np.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq,
                                                   dtype="<i4").tobytes())
        req.token_ids_i32 = np.zeros(n_tokens, dtype="<i4").tobytes()
        self._forward_and_sample(self.table.plan(req))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - kv_bytes
        self.table = None
        self._free_kv()
        torch.cuda.empty_cache()
        return int(peak)

    def init_kv(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        """(Re)allocate the KV cache (and its host tier); forgets every sequence."""
        self._bind_device()
        if self.copy_stream is not None:   # copies in flight must not outlive their buffers
            self.copy_stream.synchronize()
        self._copies_done = None
        self.host = None
        self._free_kv()
        self.init_phases = phases = {}
        with phase(phases, "kv cache"):
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.kv_cache, self.kv_scales = self._bind_kv(self.attn_layers, num_blocks, block_size)
            if self.drafter is not None:
                d = self.drafter
                d.kv_cache, d.kv_scales = self._bind_kv(d.layers, num_blocks, block_size)
        if num_host_blocks:
            with phase(phases, "host tier"):
                self.host = HostTier.allocate(self.kv_cache, self.kv_scales, num_host_blocks)
        self.block_size = block_size
        self.table = SeqTable(num_blocks, block_size, self.vocab_size, self.max_model_len)
        self.penalties = PenaltyState(self.vocab_size, self.device) if self.tp.rank == 0 else None
        self.grammar = (GrammarState(self.grammar_tokenizer, self.vocab_size, self.eos_token_id)
                        if self.grammar_tokenizer is not None else None)
        if self.tp.rank == 0 and self.device.type == "cuda":
            with phase(phases, "sampling kernels"):
                compile_fused_sampling(self.vocab_size, self.dtype, self.device)
        self.last_sampled = None
        self.graphs = self.prefill_graphs = None
        if self.device.type == "cuda" and not self.config.enforce_eager and not self._profiling:
            self._capture_graphs(block_size, phases)

    def _free_kv(self) -> None:
        self.kv_cache = self.kv_scales = None
        layers = self.attn_layers
        if self.drafter is not None:
            self.drafter.kv_cache = self.drafter.kv_scales = self.drafter.graphs = None
            self.drafter.clear()
            layers = layers + self.drafter.layers
        for layer in layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
            layer.k_scale = layer.v_scale = None

    def _bind_kv(self, layers, num_blocks: int, block_size: int):
        """A KV cache for `layers` (the target's or the draft's), each layer given its views
        -> (cache, fp8 scales or None)."""
        heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        cache = new_kv_cache(len(layers), num_blocks, block_size, heads, head_dim,
                             FP8_DTYPE if self.kv_fp8 else self.dtype, self.device)
        scales = (torch.ones(2, len(layers), num_blocks, block_size, dtype=torch.float32,
                             device=self.device) if self.kv_fp8 else None)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
            if scales is not None:
                layer.k_scale, layer.v_scale = scales[0, i], scales[1, i]
        return cache, scales

    def _capture_graphs(self, block_size: int, phases: dict[str, float]) -> None:
        """Capture every step graph, timed into `phases` (the Init log line)."""
        from worker_service.cuda_graphs import DecodeGraphs, HeadGraphs, PrefillGraphs, token_buckets
        lora = self.adapters.ctx if self.adapters is not None else None
        self.graphs = DecodeGraphs(self.model, self.backend, self.config.max_num_seqs,
                                   self.max_model_len, block_size, self.num_kv_heads, self.device,
                                   lora, self.config.max_loras)
        with phase(phases, f"{len(self.graphs.buckets)} decode graphs"):
            self.graphs.capture()
        if isinstance(self.drafter, Eagle3Drafter):   # its passes: a few rows, small kernels
            self.drafter.graphs = HeadGraphs(self.drafter.head, self.backend,
                                             min(self.config.max_num_seqs, 64),
                                             self.max_model_len, block_size, self.device)
            with phase(phases, f"{len(self.drafter.graphs.buckets)} EAGLE-3 head graphs"):
                self.drafter.graphs.capture()
        if isinstance(self.drafter, Drafter):
            d = self.drafter
            d.graphs = DecodeGraphs(d.model, self.backend, self.config.max_num_seqs,
                                    self.max_model_len, block_size, d.num_kv_heads, self.device)
            with phase(phases, f"{len(d.graphs.buckets)} draft decode graphs"):
                d.graphs.capture()
        max_tokens = min(self.config.max_prefill_graph_tokens, self.max_model_len,
                         self.config.max_num_batched_tokens)
        if not token_buckets(max_tokens):
            return
        if isinstance(self.drafter, Eagle3Drafter):   # (they keep no features for the head)
            log.info("no prefill CUDA graphs: the EAGLE-3 head needs every prefill's features")
            return
        if self.backend.name != "triton":   # the graphs need its paged prefill (see there)
            log.info("no prefill CUDA graphs: attention backend %s", self.backend.name)
            return
        self.prefill_graphs = PrefillGraphs(self.model, max_tokens, self.max_model_len,
                                            block_size, self.device, lora, self.config.max_loras)
        with phase(phases, f"{len(self.prefill_graphs.buckets)} prefill graphs "
                           f"(<= {self.prefill_graphs.max_tokens} tokens)"):
            self.prefill_graphs.capture()

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
        plan = self.table.plan(req)
        if self._copies_done is not None:   # the previous step's host-tier copies
            torch.cuda.current_stream(self.device).wait_event(self._copies_done)
            self._copies_done = None
        if req.kv_transfers_i32:
            self._transfer(np.frombuffer(req.kv_transfers_i32, "<i4").reshape(-1, 3),
                           req.kv_transfers_sync)
        if self.penalties is not None:
            self.penalties.update(req)
        if self.grammar is not None:
            self.grammar.update(req)
        if self.device.type == "cuda":
            pending.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        check = None
        if self.drafter is not None:
            self.drafter.forget([*req.drop_seq_ids,
                                 *(w.seq_id for w in req.seqs if w.reset_block_table)])
            check = self.drafter.match(plan)
        samples = self._forward_and_sample(plan, pending.events, check)
        tokens = samples.tokens if samples is not None else None
        self.table.commit(plan)
        if self.tp.size > 1 and plan.num_samples:   # every rank needs the samples (placeholders)
            if tokens is None:
                tokens = torch.empty(plan.num_samples, dtype=torch.int64, device=self.device)
            self.tp.broadcast(tokens)
        if self.drafter is not None:   # the draft's KV follows the target's, step by step
            self.drafter.mirror(self, plan, tokens)
        if plan.drafts is not None:
            if self.drafter is None:
                raise StepError("drafts asked for, but this worker has no --draft-model")
            drafts = self.drafter.propose(plan.drafts, tokens, self.table, plan.step_id)
            if self.tp.rank == 0:
                pending.drafts, pending.num_drafts = drafts, plan.drafts.k
        if plan.num_samples:
            self.last_sampled = tokens
        if tokens is not None and self.tp.rank == 0:
            pending.tokens = to_host(tokens.to(torch.int32))
            if samples.logprobs is not None:
                pending.logprobs = to_host(samples.logprobs.float())
            if samples.top_ids is not None:
                pending.top_ids = to_host(samples.top_ids.to(torch.int32))
                pending.top_logprobs = to_host(samples.top_logprobs.float())
        if pending.events:
            pending.events[1].record()
        if samples is not None and samples.constrained:   # their matchers take these ids next
            self.grammar.sampled(samples.constrained, _host_ids(pending))
        return pending

    def _transfer(self, ops: np.ndarray, sync: bool = False) -> None:
        """The host tier's copies, in order: (0, block, slot) block -> host slot; (1, slot,
        block) host slot -> block. On CUDA they run on a copy stream after everything queued
        so far (the steps before) and beside this step's forward, which the scheduler keeps
        off those blocks; the next step waits for them (sync: this one does). On a CPU they
        run at once."""
        if self.host is None:
            raise StepError("kv transfers sent, but this worker has no host tier")
        try:
            checked = check_ops(ops, self.kv_cache.shape[2], self.host.num_slots)
        except ValueError as e:
            raise StepError(str(e)) from None
        if self.device.type != "cuda":
            self.host.copy(checked, self.kv_cache, self.kv_scales)
            return
        compute = torch.cuda.current_stream(self.device)
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(self.device)
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            self.host.copy(checked, self.kv_cache, self.kv_scales)
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        if sync:
            compute.wait_event(done)
        else:
            self._copies_done = done

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
            if pending.top_ids is not None:
                resp.top_logprobs_k = pending.top_ids.shape[1]
                resp.top_token_ids_i32 = pending.top_ids.numpy().astype("<i4", copy=False).tobytes()
                resp.top_logprobs_f32 = pending.top_logprobs.numpy().astype("<f4", copy=False).tobytes()
        if pending.drafts is not None:
            resp.draft_token_ids_i32 = draft_ids(pending.drafts.numpy(), pending.num_drafts)
        resp.step_ms = (time.perf_counter() - pending.t0) * 1e3
        return resp

    def _forward_and_sample(self, plan: StepPlan, events=None, check: DraftCheck | None = None
                            ) -> StepSamples | None:
        """Run the step's forward and sample its sampling rows (None on ranks that do not
        sample); events[0] is recorded just before the first device work (GPU time
        excludes host prep); check: rows that settle sampled drafts (Drafter.match)."""
        logits = self._logits(plan, events)
        if logits is None or self.tp.rank != 0:
            return None
        dev, sampling = self.device, plan.sample
        ctx = plan.context_lens[sampling].tolist()
        batch = SamplingBatch.build(plan.sampling, ctx, self.vocab_size, dev)
        pen = self.penalties.rows(plan.sampling_seq_ids, plan.sampling) if self.penalties else None
        constrained = self.grammar.rows(plan.sampling_seq_ids) if self.grammar else []
        bias = logit_bias(plan.sampling, ctx, dev)
        if pen is None and not constrained and bias is None:   # the usual case
            return sample_step(logits, batch, check=check)
        masks = self._grammar_masks(constrained) if constrained else None

        def adjust(x: torch.Tensor) -> torch.Tensor:
            """A copy of the logits for sampling to draw from (logprobs stay raw): bias,
            then penalties (vLLM's order), then the formats' masks."""
            if bias is not None:
                x = x.to(torch.float32, copy=True).index_put_(bias[:2], bias[2], accumulate=True)
            if pen is not None:
                x = self.penalties.apply(x, pen)
            elif bias is None:
                x = x.clone()
            return apply_token_bitmask(x, *masks) if masks is not None else x

        samples = sample_step(logits, batch, adjust, check)
        if pen is not None:
            self.penalties.record(pen, samples.tokens)
        samples.constrained = constrained
        return samples

    def _grammar_masks(self, constrained: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, bitmasks) of the constrained sampling rows on the device. Runs while the
        GPU computes this step's forward (already queued): first the matchers take the ids
        of earlier steps (sampled before this forward began), then the masks are filled on
        llguidance's threads into pinned memory and copied over asynchronously."""
        self.grammar.catch_up()
        cuda = self.device.type == "cuda"
        host = torch.empty((len(constrained), self.grammar.words), dtype=torch.int32, pin_memory=cuda)
        self.grammar.fill(constrained, host.numpy())
        rows = np.array([i for i, _ in constrained], dtype=np.int64)
        return to_device(rows, self.device), host.to(self.device, non_blocking=True)

    def placeholders(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(indices into the plan's ids, the previous step's samples for them) on the
        device, where its inputs hold placeholders (-1: the id sampled last step)."""
        if plan.fill is None:
            return None
        dev = self.device
        return (to_device(plan.fill[0], dev),
                self.last_sampled.index_select(0, to_device(plan.fill[1], dev)))

    def input_ids(self, plan: StepPlan) -> torch.Tensor:
        """The plan's input ids on the device, placeholders filled."""
        out = to_device(np.where(plan.token_ids < 0, 0, plan.token_ids), self.device)
        fill = self.placeholders(plan)
        if fill is not None:
            out[fill[0]] = fill[1]
        return out

    def _logits(self, plan: StepPlan, events=None, net: Drafter | None = None
                ) -> torch.Tensor | None:
        """The forward (every rank runs it) -> logits of the sampling rows, None if the step
        samples none: a decode or prefill CUDA graph where one fits, else eager. net: the
        drafter's model instead of the target's (no logits: its KV is what it is run for).
        With an EAGLE-3 drafter the target's features of every token are left in
        self.step_aux ([T, 3 H]: its hidden states before the head's three layers)."""
        dev = self.device
        model, graphs = (self.model, self.graphs) if net is None else (net.model, net.graphs)
        tables = plan.block_tables
        if events is not None:
            events[0].record()
        sampling = plan.sample
        adapters = self.adapters if net is None else None
        lora = (adapters.slots(self.table.adapter[plan.rows], plan.num_tokens)
                if adapters is not None else None)   # [T] slots, None: no adapter
        runs = decode_runs(plan.rows) if plan.is_decode else None   # fast-forward rows
        if plan.is_decode and graphs is not None and len(plan.rows) <= graphs.max_batch \
                and tables.shape[1] <= graphs.max_blocks:
            ids = np.where(plan.token_ids < 0, 0, plan.token_ids)
            logits = graphs.run(ids, plan.positions, plan.slot_mapping, tables,
                                self.placeholders(plan), runs, lora)
            if net is None:
                self.step_aux = graphs.last_aux
            if not plan.num_samples or net is not None:
                return None
            if sampling.all():
                return logits
            # fast-forward rows sample only their last token (a numpy index would be copied
            # from pageable memory: in stream order, after the forward)
            return logits.index_select(0, to_device(np.flatnonzero(sampling), dev))
        if net is None and self.prefill_graphs is not None and self.prefill_graphs.fits(plan):
            return self.prefill_graphs.run(plan, lora)
        if adapters is not None:
            adapters.set_rows(lora)
        meta = step_metadata(plan, dev)
        hidden = model(self.input_ids(plan), to_device(plan.positions, dev), meta)
        if net is None:
            self.step_aux = model.model.aux_hidden
        if not plan.num_samples or net is not None:
            return None
        last = to_device(plan.last_token_index(), dev)
        return self.model.compute_logits(hidden.index_select(0, last))

