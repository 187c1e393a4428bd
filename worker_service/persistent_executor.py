"""The persistent small-batch decode kernel (kernels/persistent_decode.py) as executors
(executors.py): eager, and under CUDA graphs one per batch bucket up to MAX_ROWS rows.

The kernel's task list comes from the model's own description of its decode step
(Qwen3ForCausalLM.decode_step(), models/decode_step.py): the same weights and KV views the
per-op path runs, so a model family is written once. `unsupported` says why a model is
not covered (the runner then keeps the per-op path); `fits` declines a step the kernel
does not run (fast-forward runs, adapters, drafts' own ids, more rows than MAX_ROWS): the
next executor takes it.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from kernels.attention import decode_runs
from kernels.interpret import INTERPRET_ENV
from kernels.persistent_decode import (MAX_ROWS, TABLE_WIDTH, Dims, Workspace, decode_step)
from models.decode_step import LinearStep, MLPStep, ModelStep
from worker_service.cuda_graphs import DecodeGraphs
from worker_service.executors import Executor, Forward, StepInputs, input_ids
from worker_service.phases import phase
from worker_service.transfers import to_device

log = logging.getLogger("nanoserve.worker")


def unsupported(step: ModelStep, tp_size: int) -> str | None:
    """Why the kernel cannot run this model's decode step (None: it can)."""
    if tp_size != 1:
        return "tensor parallelism"
    layer = step.layers[0]
    if not isinstance(layer.mlp, MLPStep):
        return "mixture-of-experts layers"
    linears: list[LinearStep] = [s for x in step.layers for s in (x.attn.qkv, x.attn.o_proj,
                                                                    x.mlp.gate_up, x.mlp.down)]
    if any(s.bias is not None for s in linears):
        return "biased projections"
    if any(s.weight_scale is not None for s in linears):
        return "FP8 weights"
    if any(s.quant is not None for s in linears):
        return "GPTQ / AWQ weights"
    if any(s.lora is not None for s in linears):
        return "LoRA adapters"
    attn = layer.attn.attn
    if attn.k_scale is not None:
        return "an FP8 KV cache"
    if attn.head_dim % 2 or attn.head_dim & (attn.head_dim - 1):
        return f"head_dim {attn.head_dim} (a power of two is needed)"
    if layer.attn.rotary.cos_sin_cache.shape[-1] != attn.head_dim:
        return "partial rotary"
    if layer.input_norm.tp_sum:
        return "tensor parallelism"
    return None


def _dims(step: ModelStep, max_blocks: int) -> Dims:
    layer = step.layers[0]
    a = layer.attn.attn
    return Dims(hidden=layer.input_norm.weight.shape[0], heads=a.num_heads,
                kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                intermediate=layer.mlp.down.in_features, vocab=step.lm_head.weight.shape[0],
                layers=len(step.layers), block_size=a.block_size, max_blocks=max_blocks,
                qk_norm=layer.attn.q_norm is not None, eps=layer.input_norm.eps, scale=a.scale)


def _table(step: ModelStep, device: torch.device) -> torch.Tensor:
    """[layers, TABLE_WIDTH] int64: each layer's tensors' addresses, in the kernel's order."""
    rows = []
    for x in step.layers:
        att = x.attn
        tensors = (att.qkv.weight, att.o_proj.weight, x.mlp.gate_up.weight, x.mlp.down.weight,
                   x.input_norm.weight, x.post_attention_norm.weight,
                   (att.q_norm or x.input_norm).weight, (att.k_norm or x.input_norm).weight,
                   att.attn.k_cache, att.attn.v_cache)
        assert all(t.is_contiguous() for t in tensors[:8])
        assert all(t.stride() == tensors[8].stride() for t in tensors[8:])
        rows.append([t.data_ptr() for t in tensors])
    assert len(rows[0]) == TABLE_WIDTH
    return torch.tensor(rows, dtype=torch.int64, device=device)


class PersistentDecode:
    """Eager executor: the kernel over a step's own inputs (the interpreter's path on a CPU,
    and a GPU run without graphs). Build it after the KV cache is bound."""

    def __init__(self, model, device: torch.device, max_model_len: int) -> None:
        step = model.decode_step()
        self.model, self.device = model, device
        self.max_blocks = -(-max_model_len // step.layers[0].attn.attn.block_size)
        self.dims = _dims(step, self.max_blocks)
        self.table = _table(step, device)   # (holds addresses: the model keeps the tensors)
        self.lm_head, self.final_norm = step.lm_head.weight, step.norm.weight
        self.cos_sin = step.layers[0].attn.rotary.cos_sin_cache
        self.kv_cache = step.layers[0].attn.attn.k_cache   # (its dtype and strides)
        self.ws = Workspace.allocate(self.dims, device)
        self.logits = torch.empty(MAX_ROWS, self.dims.vocab, dtype=self.lm_head.dtype,
                                  device=device)
        self.sms = (1 if INTERPRET_ENV or device.type != "cuda"
                         else torch.cuda.get_device_properties(device).multi_processor_count)

    def fits(self, step: StepInputs) -> bool:
        plan = step.plan
        return (plan.is_decode and len(plan.rows) <= MAX_ROWS and step.hidden is None
                and step.slot_mapping is None and decode_runs(plan.rows) is None
                and (step.lora is None or bool((step.lora < 0).all()))
                and plan.block_tables.shape[1] <= self.max_blocks)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """The kernel over device inputs of n rows (block_tables [n, max_blocks]) -> logits
        [n, vocab] (a view of a buffer the next call overwrites)."""
        n = ids.shape[0]
        self.ws.resid[:n].copy_(self.model.model.embed_tokens(ids))
        decode_step(self.table, self.lm_head, self.final_norm, self.cos_sin, self.dims, self.ws,
                    positions, slots, context_lens, block_tables, self.logits, self.kv_cache,
                    self.sms)
        return self.logits[:n]

    def run(self, step: StepInputs) -> Forward:
        plan, dev = step.plan, self.device
        tables = np.zeros((len(plan.rows), self.max_blocks), np.int32)
        tables[:, :plan.block_tables.shape[1]] = plan.block_tables
        logits = self.forward(input_ids(step, dev), to_device(plan.positions, dev),
                              to_device(plan.slot_mapping, dev),
                              to_device((plan.positions + 1).astype(np.int32), dev),
                              to_device(tables, dev))
        return _sampling(logits, step)


def _sampling(logits: torch.Tensor, step: StepInputs) -> Forward:
    plan = step.plan
    if not step.logits or not plan.num_samples:
        return Forward(None)
    if plan.sample.all():
        return Forward(logits)
    return Forward(logits.index_select(0, to_device(np.flatnonzero(plan.sample), logits.device)))


class PersistentGraphs(DecodeGraphs):
    """The kernel captured per bucket (1, 2, 4, 8 rows) on DecodeGraphs' static inputs."""

    def __init__(self, model, backend, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.kernel = PersistentDecode(model, device, max_model_len)
        super().__init__(model, backend, MAX_ROWS, max_model_len, block_size,
                         self.kernel.dims.kv_heads, device)

    def fits(self, step: StepInputs) -> bool:
        return super().fits(step) and self.kernel.fits(step)

    def _forward(self, bs: int) -> Forward:
        return Forward(self.kernel.forward(self.input_ids[:bs], self.positions[:bs],
                                           self.slot_mapping[:bs], self.context_lens[:bs],
                                           self.block_tables[:bs]))


def small_batch_executor(model, tp_size: int, needs_features: bool, backend,
                         device: torch.device, max_model_len: int, block_size: int,
                         graphs: bool, phases: dict[str, float]) -> Executor | None:
    """The runner's first executor for --small-batch-kernel persistent (captured per bucket
    where `graphs`), or None where the kernel does not cover the model (logged why).
    needs_features: an EAGLE-3 head drafts from the target's features, which it does not
    return."""
    why = unsupported(model.decode_step(), tp_size)
    if needs_features:
        why = "an EAGLE-3 head needs the target's features"
    if why:
        log.info("no persistent decode kernel: %s", why)
        return None
    if not graphs:
        return PersistentDecode(model, device, max_model_len)
    captured = PersistentGraphs(model, backend, max_model_len, block_size, device)
    with phase(phases, f"{len(captured.buckets)} persistent decode graphs"):
        captured.capture()
    return captured
