"""ModelRunner: owns the weights and the KV cache of one rank and runs each Step batch
through the step pipeline, in this order (`launch`):

  plan            SeqTable.plan: the request checked against per-sequence state (diffs)
  before-forward  host-tier copies, penalty / grammar state, the proposer's check of last
                  step's drafts
  forward         the first executor that takes the step (executors.py: a CUDA graph,
                  else eager) -> logits of the sampling rows (+ an EAGLE-3 head's features);
                  the usual step's ids too where the decode graphs sample in their replay
                  (logits_processors.graph_sampling says which steps are usual)
  sample          rank 0: logits processors (bias, penalties, masks), then sample or verify
                  (logits_processors.py), unless the forward sampled; pooling rows answer
                  their pooled hidden state (an embedding, a reranker score: pooler.py)
  commit          SeqTable.commit; the samples broadcast to every rank (placeholders)
  after-step      the proposer mirrors the step and drafts (proposer.py)

Feature logic stays out of this file: a feature is a stage's collaborator (a logits
processor, a proposer, an executor), not an `if` in the pipeline.

A step is `launch`ed (inputs copied, kernels queued, sampled ids copied to pinned host
memory asynchronously) and later `finish`ed (wait, answer). The server launches each step
as it arrives and finishes steps on another thread (finish touches only its PendingStep),
so the GPU never waits for the answer round trip and no launch delays an answer. A
decode input token of -1 means "the id you sampled for this sequence in the previous
step": it is taken from the GPU tensor of that step's samples, which lets the scheduler
send step N+1 before it has read step N's ids.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from models.parallel import TPGroup
from models.qwen3 import kv_cache_layers
from models.rotary import max_positions
from nanoserve.v1 import worker_pb2
from worker_service import loading
from worker_service.executors import Eager, Executor, Forward, StepInputs, run
from worker_service.grammar import GrammarState
from worker_service.host_tier import HostTier
from worker_service.kv_binding import KVFormat, bind_kv, unbind_kv
from worker_service.logits_processors import graph_sampling, sample_plan
from worker_service.pending_step import PendingStep
from worker_service.penalties import PenaltyState
from worker_service.phases import phase
from worker_service.pooler import Pooled, Pooler
from worker_service.sampler import DraftCheck, StepSamples, compile_fused_sampling
from worker_service.step_plan import SeqTable, StepError, StepPlan


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
    small_batch_kernel: str = "off"       # persistent: persistent_executor.py for <= 8 rows
    host_kv_cache_gb: float = 0.0         # host tier of the prefix cache (0: none)
    max_loras: int = 0                    # LoRA adapters resident at once (0: no LoRA)
    max_lora_rank: int = 16
    draft_model: str = ""                 # speculative decoding's draft model or EAGLE-3 head
    draft_sampling: str = "greedy"        # or sampled: drafts drawn from q (drafter.py)
    tasks: tuple[str, ...] = ("generate",)  # of generate, embed, score (nanoserve/model_task.py)
    hf_overrides: dict | None = None      # config.json fields replaced (--hf-overrides)
    deterministic: bool = False           # batch-invariant kernels (loading.py, issue 68)


log = logging.getLogger("nanoserve.worker")

KV_CACHE_DTYPES = ("auto", "fp8")


class ModelRunner:
    def __init__(self, config: RunnerConfig, tp: TPGroup = TPGroup()):
        if config.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {config.kv_cache_dtype!r}: expected "
                             f"{' or '.join(KV_CACHE_DTYPES)}")
        self.config = config
        self.tp = tp
        self.phases: dict[str, float] = {}        # start-up time by phase
        self.init_phases: dict[str, float] = {}   # the last Init's, likewise
        parts = loading.load(config, tp, config.kv_cache_dtype == "fp8", self.phases)
        self.device, self.backend, self.dtype = parts.device, parts.backend, parts.dtype
        self.model, self.hf_config = parts.model, parts.hf_config
        self.drafter, self.adapters = parts.drafter, parts.adapters
        self.fingerprint, self.eos_token_id = parts.fingerprint, parts.eos_token_id
        self.grammar_tokenizer = parts.grammar_tokenizer
        self.kv_format = KVFormat(self.dtype, config.kv_cache_dtype == "fp8")
        self.vocab_size = self.hf_config.vocab_size
        limit = max_positions(self.hf_config)   # max_position_embeddings, or RoPE scaling's
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.attn_layers = kv_cache_layers(self.model)
        self.num_kv_heads = self.attn_layers[0].num_kv_heads   # this rank's share
        self.head_dim = self.attn_layers[0].head_dim
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None   # fp8: [2, layers, blocks, block_size] fp32
        self.host: HostTier | None = None   # the prefix cache's host tier (host_tier.py)
        self.block_size = 0
        self.table: SeqTable | None = None  # per-sequence state, reset by init_kv
        self.penalties: PenaltyState | None = None   # rank 0 (it samples): penalized seqs
        self.grammar: GrammarState | None = None     # rank 0: constrained seqs' matchers
        self.executors: list[Executor] = self._eager()   # graphs join them at init_kv
        self.pooler = Pooler(self.model, tp)   # pooling rows' answers (embeddings, scores)
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
    def kv_fp8(self) -> bool:
        return self.kv_format.fp8

    @property
    def kv_cache_dtype_name(self) -> str:
        return self.kv_format.name

    def block_bytes(self, block_size: int, draft: bool = True) -> int:
        """K and V bytes of one block over all layers (fp8: values + a 4-byte scale per
        token), the draft's included (draft=False: the target's alone)."""
        d = self.drafter
        return self.kv_format.block_bytes(self.attn_layers, block_size) + (
            self.kv_format.block_bytes(d.layers, block_size) if draft and d else 0)

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
        # a pooling-only worker (--task embed / score) refuses sampled rows: it profiles the
        # same prefill as a chunk that ends nowhere (a vocabulary's logits fewer)
        sample = not self.config.tasks or "generate" in self.config.tasks
        for i, n in enumerate(lens):
            req.seqs.add(seq_id=i, num_tokens=n, start_pos=0, reset_block_table=True, sample=sample,
                         block_table_i32=np.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq,
                                                   dtype="<i4").tobytes())
        req.token_ids_i32 = np.zeros(n_tokens, dtype="<i4").tobytes()
        plan = self.table.plan(req)
        self._sample(plan, self.forward(plan).out)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - kv_bytes
        self.table = None
        self._free_kv()
        torch.cuda.empty_cache()
        return int(peak)

    # ---- the KV cache and what is bound to it ----------------------------------------

    def init_kv(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        """(Re)allocate the KV cache (and its host tier); forgets every sequence."""
        self._bind_device()
        if self.host is not None:   # copies in flight must not outlive their buffers
            self.host.drain()
        self.host = None
        self._free_kv()
        self.init_phases = phases = {}
        with phase(phases, "kv cache"):
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.kv_cache, self.kv_scales = bind_kv(self.attn_layers, num_blocks, block_size,
                                                    self.kv_format, self.device)
            if self.drafter is not None:
                self.drafter.bind_kv(num_blocks, block_size, self.kv_format)
        if num_host_blocks:
            with phase(phases, "host tier"):
                self.host = HostTier.allocate(self.kv_cache, self.kv_scales, num_host_blocks)
        self.block_size = block_size
        self.table = SeqTable(num_blocks, block_size, self.vocab_size, self.max_model_len,
                              self.config.tasks, self.hf_config.hidden_size)
        self.penalties = PenaltyState(self.vocab_size, self.device) if self.tp.rank == 0 else None
        self.grammar = (GrammarState(self.grammar_tokenizer, self.vocab_size, self.eos_token_id)
                        if self.grammar_tokenizer is not None else None)
        if self.tp.rank == 0 and self.device.type == "cuda":
            with phase(phases, "sampling kernels"):
                compile_fused_sampling(self.vocab_size, self.dtype, self.device)
        self.last_sampled = None
        if self.device.type == "cuda" and not self.config.enforce_eager and not self._profiling:
            self._capture_graphs(block_size, phases)
        if self.config.small_batch_kernel == "persistent" and not self._profiling:
            from worker_service.persistent_executor import small_batch_executor
            kernel = small_batch_executor(
                self.model, self.tp.size, bool(self.drafter and self.drafter.feature_layers),
                self.backend, self.device, self.max_model_len, block_size,
                self.device.type == "cuda" and not self.config.enforce_eager, phases)
            if kernel is not None:
                self.executors.insert(0, kernel)

    def _free_kv(self) -> None:
        self.kv_cache = self.kv_scales = None
        self.executors = self._eager()
        unbind_kv(self.attn_layers)
        if self.drafter is not None:
            self.drafter.free_kv()

    def _eager(self) -> list[Executor]:
        features = self.drafter.feature_layers if self.drafter is not None else ()
        return [Eager(self.model, self.device, self.adapters, features)]

    def _capture_graphs(self, block_size: int, phases: dict[str, float]) -> None:
        """Capture every step graph (the target's, the proposer's), timed into `phases`
        (the Init log line); the target's executors become [decode graphs, prefill
        graphs and the two split (where they can be), eager]."""
        from worker_service.cuda_graphs import (DecodeGraphs, PrefillGraphs, SplitGraphs,
                                                token_buckets)
        cfg = self.config
        lora = self.adapters.ctx if self.adapters is not None else None
        features = self.drafter.feature_layers if self.drafter is not None else ()
        graphs = DecodeGraphs(self.model, self.backend, cfg.max_num_seqs, self.max_model_len,
                              block_size, self.num_kv_heads, self.device, lora, cfg.max_loras,
                              features, sample=self.sample_in_graph)
        with phase(phases, f"{len(graphs.buckets)} decode graphs"):
            graphs.capture()
        self.executors = [graphs, *self._eager()]
        if self.drafter is not None:
            self.drafter.capture(cfg.max_num_seqs, self.max_model_len, block_size, phases)
        max_tokens = min(cfg.max_prefill_graph_tokens, self.max_model_len,
                         cfg.max_num_batched_tokens)
        if not token_buckets(max_tokens):
            return
        if features:   # (they keep no features for the head)
            log.info("no prefill CUDA graphs: the EAGLE-3 head needs every prefill's features")
            return
        if self.backend.name != "triton":   # the graphs need its paged prefill (see there)
            log.info("no prefill CUDA graphs: attention backend %s", self.backend.name)
            return
        prefill = PrefillGraphs(self.model, max_tokens, self.max_model_len, block_size,
                                self.device, lora, cfg.max_loras)
        with phase(phases, f"{len(prefill.buckets)} prefill graphs "
                           f"(<= {prefill.max_tokens} tokens)"):
            prefill.capture()
        self.executors[1:1] = [prefill, SplitGraphs(graphs, prefill)]

    @property
    def sample_in_graph(self) -> bool:
        """The decode graphs sample the usual step themselves (DecodeGraphs' sample): on the
        rank that samples, where there are graphs."""
        return (self.tp.rank == 0 and self.device.type == "cuda" and not self.config.enforce_eager
                and "generate" in (self.config.tasks or ("generate",)))

    def _bind_device(self) -> None:
        """Make this runner's GPU the calling thread's current device. gRPC calls arrive on
        pool threads, whose current device is cuda:0: Triton kernels, CUDA events and
        empty_cache() follow the current device, so rank 1 (cuda:1) would break there."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def num_blocks(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.shape[2]

    # ---- one step: the pipeline ------------------------------------------------------

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
        check = self._before_forward(req, plan)
        if self.device.type == "cuda":
            # the stream named: Event.record() looks the current device up through
            # torch.cuda.is_available() each time, tens of us a step on a slow host
            pending.stream = torch.cuda.current_stream(self.device)
            pending.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            pending.events[0].record(pending.stream)   # GPU time excludes the host's preparation
        step = self.inputs(plan)
        if self.sample_in_graph and plan.is_decode:   # (only the decode graphs sample)
            step.sampling = graph_sampling(plan, self.vocab_size, self.penalties, self.grammar,
                                           check)
        fwd = run(self.executors, step)
        samples = (StepSamples(fwd.tokens, None) if fwd.tokens is not None
                   else self._sample(plan, fwd.out, check))
        pooled = self._pool(plan, fwd)
        tokens = self._commit(plan, samples)
        self._after_step(step, fwd, tokens, pending)
        if pooled is not None and self.tp.rank == 0:
            pending.copy_pooled(pooled, plan.pool_at)
        pending.copy_answer(samples, tokens if self.tp.rank == 0 else None)
        if samples is not None and samples.constrained:   # their matchers take these ids next
            self.grammar.sampled(samples.constrained, pending.host_ids)
        return pending

    def _before_forward(self, req: worker_pb2.StepRequest, plan: StepPlan) -> DraftCheck | None:
        """Host-tier copies, the sampling state's updates, and the rows that settle last
        step's sampled drafts."""
        if self.host is not None:   # the previous step's host-tier copies
            self.host.wait(self.device)
        if req.kv_transfers_i32:
            self._transfer(np.frombuffer(req.kv_transfers_i32, "<i4").reshape(-1, 3),
                           req.kv_transfers_sync)
        if self.penalties is not None:
            self.penalties.update(req)
        if self.grammar is not None:
            self.grammar.update(req)
        if self.drafter is None:
            return None
        dropped = [*req.drop_seq_ids, *(w.seq_id for w in req.seqs if w.reset_block_table)]
        return self.drafter.before_forward(plan, dropped)

    def _sample(self, plan: StepPlan, logits: torch.Tensor | None,
                check: DraftCheck | None = None) -> StepSamples | None:
        """Rank 0 samples the sampling rows (None elsewhere, or where none sample)."""
        if logits is None or self.tp.rank != 0:
            return None
        return sample_plan(logits, plan, self.vocab_size, self.penalties, self.grammar, check)

    def _pool(self, plan: StepPlan, fwd: Forward) -> Pooled | None:
        """The pooling rows' answers from their final hidden states (every rank: a score's
        LM head rows are sharded); None where the plan pools none."""
        if fwd.pooled is None:
            return None
        return self.pooler.pool(fwd.pooled, plan.pooling)

    def _commit(self, plan: StepPlan, samples: StepSamples | None) -> torch.Tensor | None:
        """Advance the sequences' state; every rank gets the samples (its placeholders)."""
        tokens = samples.tokens if samples is not None else None
        self.table.commit(plan)
        if self.tp.size > 1 and plan.num_samples:
            if tokens is None:
                tokens = torch.empty(plan.num_samples, dtype=torch.int64, device=self.device)
            self.tp.broadcast(tokens)
        return tokens

    def _after_step(self, step: StepInputs, fwd: Forward, tokens: torch.Tensor | None,
                    pending: PendingStep) -> None:
        """The proposer's KV follows the step; the drafts it was asked for."""
        plan = step.plan
        if self.drafter is not None:
            self.drafter.mirror(step, self.table, fwd, tokens)
        if plan.drafts is not None:
            if self.drafter is None:
                raise StepError("drafts asked for, but this worker has no --draft-model")
            drafts = self.drafter.propose(plan.drafts, tokens, self.table, plan.step_id)
            if self.tp.rank == 0:
                pending.drafts, pending.num_drafts = drafts, plan.drafts.k
        if plan.num_samples:
            self.last_sampled = tokens

    def inputs(self, plan: StepPlan) -> StepInputs:
        """The plan's inputs to a forward: placeholders (-1) stand for the last samples on
        the device (gathered where the executor asks), each token's adapter slot."""
        lora = (self.adapters.slots(self.table.adapter[plan.rows], plan.num_tokens)
                if self.adapters is not None else None)
        return StepInputs(plan, last=self.last_sampled if plan.fill is not None else None,
                          lora=lora)

    def forward(self, plan: StepPlan) -> Forward:
        """The target's forward of a plan alone (every rank runs it): logits of its
        sampling rows and the features a head needs. Tests and benchmarks call it."""
        return run(self.executors, self.inputs(plan))

    def _transfer(self, ops: np.ndarray, sync: bool = False) -> None:
        """The host tier's copies, in order: (0, block, slot) block -> host slot; (1, slot,
        block) host slot -> block (HostTier.transfer)."""
        if self.host is None:
            raise StepError("kv transfers sent, but this worker has no host tier")
        try:
            self.host.transfer(ops, self.kv_cache, self.kv_scales, sync)
        except ValueError as e:
            raise StepError(str(e)) from None

    def finish(self, pending: PendingStep) -> worker_pb2.StepResponse:
        """Wait for a launched step and answer it."""
        return pending.response()
