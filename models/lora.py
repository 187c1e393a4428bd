"""LoRA adapters on the tensor-parallel linear layers, many at once (multi-LoRA serving).

A targeted layer holds, for each of `max_loras` slots, an adapter's A (stacked over the
layer's parts: q/k/v of qkv_proj, gate/up of gate_up_proj) and B (one per part), zero
where an adapter leaves a module out or has a smaller rank than the maximum. One step
mixes adapters: `LoraContext.rows` maps each token row to its slot (-1: the base model)
and is shared by every layer, so a forward is y = x W^T + scale[slot] * (x A^T) B^T per
row, the shrink (x A^T) once per layer for all its parts (kernels/lora.py).

Tensor parallelism needs no collective of its own: column-parallel layers (qkv, gate_up)
keep A whole and shard B like their output rows; row-parallel layers (o, down) shard A
like their input columns and keep B whole, so each rank's delta is a partial sum that
the layer's all-reduce adds up with the base GEMM's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.lora import LoraRows, lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref

# Hugging Face module name -> (our layer's attribute, its part): q/k/v and gate/up are
# merged layers here (models/qwen3.py packed_modules_mapping).
MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
           "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}


@dataclass
class LoraContext:
    """The step's row -> slot grouping (None: no row uses an adapter), set by the runner."""
    rows: LoraRows | None = None


class LoraSlots:
    """One linear layer's adapter weights for every slot (not module state: no checkpoint
    holds them)."""

    def __init__(self, layer: nn.Module, parts: list[int], row_parallel: bool, num_slots: int,
                 max_rank: int, ctx: LoraContext) -> None:
        w = layer.weight
        dtype = w.dtype if w.dtype.is_floating_point and w.element_size() > 1 else torch.bfloat16
        self.ctx = ctx
        self.tp = layer.tp
        self.row_parallel = row_parallel
        self.parts = parts                       # this rank's output rows of each part
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]
        self.in_local = w.shape[1]
        self.max_rank = max_rank
        self.a = torch.zeros(num_slots, len(parts) * max_rank, self.in_local, dtype=dtype,
                             device=w.device)
        self.b = [torch.zeros(num_slots, n, max_rank, dtype=dtype, device=w.device) for n in parts]
        self.scale = torch.zeros(num_slots, dtype=torch.float32, device=w.device)

    def full_shapes(self, part: int) -> tuple[int, int]:
        """(in, out) of one part over all ranks: what a checkpoint's A and B must match."""
        tp = self.tp.size
        if self.row_parallel:
            return self.in_local * tp, self.parts[part]
        return self.in_local, self.parts[part] * tp

    def shard(self, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slices of a whole A [r, in] and B [out, r]."""
        rank = self.tp.rank
        if self.row_parallel:
            return a.narrow(1, rank * self.in_local, self.in_local), b
        n = self.parts[part]
        return a, b.narrow(0, rank * n, n)

    def load(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]],
             scale: float) -> None:
        """Write one adapter's (already sharded) parts into a slot, zeros elsewhere."""
        r_max = self.max_rank
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        for p, (a, b) in parts.items():
            r = a.shape[0]
            self.a[slot, p * r_max:p * r_max + r].copy_(a, non_blocking=True)
            self.b[p][slot, :, :r].copy_(b, non_blocking=True)
        self.scale[slot] = scale if parts else 0.0

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's adapter delta, in place (y: the base GEMM's output, before any
        all-reduce)."""
        rows = self.ctx.rows
        if rows is None:
            return
        cuda = x.is_cuda
        h = (lora_shrink if cuda else lora_shrink_ref)(x, self.a, rows)
        expand = lora_expand if cuda else lora_expand_ref
        r = self.max_rank
        for p, (b, off) in enumerate(zip(self.b, self.offsets)):
            hp = h if len(self.parts) == 1 else h[:, p * r:(p + 1) * r].contiguous()
            expand(hp, b, self.scale, rows, y, off)


def attach(model: nn.Module, num_slots: int, max_rank: int) -> tuple[LoraContext, dict[str, tuple]]:
    """Give every targetable linear layer of `model` its LoraSlots. Returns the shared
    context and a map from each Hugging Face module name (model.layers.N.self_attn.q_proj)
    to (LoraSlots, part) for the adapter loader. MoE experts are not targetable."""
    from models.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    ctx = LoraContext()
    targets: dict[str, tuple] = {}
    for name, layer in list(model.named_modules()):
        prefix, _, attr = name.rpartition(".")
        if ".experts" in name or attr not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            continue
        if isinstance(layer, QKVParallelLinear):
            parts = [layer.q_size, layer.kv_size, layer.kv_size]
        elif isinstance(layer, MergedColumnParallelLinear):
            parts = [n // layer.tp.size for n in layer.output_sizes]
        elif isinstance(layer, RowParallelLinear):
            parts = [layer.weight.shape[0]]
        else:
            continue
        layer.lora = LoraSlots(layer, parts, isinstance(layer, RowParallelLinear), num_slots,
                               max_rank, ctx)
        for hf, (ours, part) in MODULES.items():
            if ours == attr:
                targets[f"{prefix}.{hf}"] = (layer.lora, part)
    return ctx, targets
