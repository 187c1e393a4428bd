"""LoRA adapters on the tensor-parallel linear layers, many at once (multi-LoRA serving).

A targeted layer holds, for each of `max_loras` slots, an adapter's A (stacked over the
layer's parts: q/k/v of qkv_proj, gate/up of gate_up_proj) and B (stacked along the
output at each part's columns), zero where an adapter leaves a module out or has a
smaller rank than the maximum. One step mixes adapters: `LoraContext.rows` maps each
token row to its slot (-1: the base model) and is shared by every layer, so a forward is
y = x W^T + scale[slot] * (x A^T) B^T per row, in two launches per layer whatever its
parts: one shrink (x A^T) and one expand (kernels/lora.py). A single token (batch-1
decode) takes one: its GEMV adds the delta in its epilogue (`shrink`, kernels/gemv.py),
which took the batch-1 step's added latency from +17.7% to +12.7% at Qwen3-8B shapes.

The shrink's h lives in a per-step workspace of the context, not one allocation per layer.
Where the step's shrinks split K (atomics into h, decode sizes) it is two buffers zeroed
once per step (one memset) and used in turn: each layer's shrink accumulates into one and
zeroes the other's rows of adapters, which the next layer's shrink accumulates into (the
expand that read it ran before, in stream order). Otherwise (no K split) one unzeroed
buffer serves every layer: the shrink stores h, and the rows of slot -1 it leaves alone
are never read.

Tensor parallelism needs no collective of its own: column-parallel layers (qkv, gate_up)
keep A whole and shard B like their output rows; row-parallel layers (o, down) shard A
like their input columns and keep B whole, so each rank's delta is a partial sum that
the layer's all-reduce adds up with the base GEMM's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.gemv import GemvLora
from kernels.lora import (LoraRows, lora_expand, lora_expand_ref, lora_max_split_k, lora_shrink,
                          lora_shrink_ref)
from models import kernel_choice
from models.decode_step import LoraStep

# Hugging Face module name -> (our layer's attribute, its part): q/k/v and gate/up are
# merged layers here (models/qwen3.py packed_modules_mapping).
MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
           "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}


@dataclass
class _Workspace:
    """One step's h buffers (see the module docstring)."""
    rows: LoraRows                  # the step they belong to
    bufs: torch.Tensor              # [2, T, width] zeroed (K split) or [1, T, width] not
    split: bool                     # the shrinks may split K: ping-pong, each clearing the other
    turn: int = 0                   # buffer of the next shrink
    dirty: list[int] = field(default_factory=lambda: [0, 0])   # columns written, per buffer


@dataclass
class LoraContext:
    """The step's row -> slot grouping (None: no row uses an adapter), set by the runner,
    and the step's h workspace (kept here; a new `rows` starts a new one)."""
    rows: LoraRows | None = None
    width: int = 0                  # the widest layer's h columns (parts x max_rank)
    _ws: _Workspace | None = field(default=None, repr=False)

    def h_buffers(self, width: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """For the next layer's shrink of this step: (its h [T, width], the buffer to zero
        on the way or None, whether K may be split). Call once per layer, in launch order.
        A new `rows` object starts a new workspace (zeroed where K splits): every forward
        builds its own (the runner's set_rows; cuda_graphs.py inside the captured
        computation, so a graph's replay runs the memset and the layers' fixed turns)."""
        rows = self.rows
        ws = self._ws
        if ws is None or ws.rows is not rows or ws.bufs.device != device:
            T = rows.num_rows
            split = lora_max_split_k(T, rows.num_slots, device) > 1
            alloc = torch.zeros if split else torch.empty
            ws = self._ws = _Workspace(rows, alloc(2 if split else 1, T, max(self.width, width),
                                                   dtype=torch.float32, device=device), split)
        if ws.bufs.shape[2] < width:        # a layer wider than announced: a fresh step
            self._ws = None
            self.width = width
            return self.h_buffers(width, device)
        if not ws.split:
            return ws.bufs[0, :, :width], None, False
        cur, other = ws.turn, 1 - ws.turn
        clear = ws.bufs[other, :, :ws.dirty[other]] if ws.dirty[other] else None
        ws.dirty[other] = 0
        ws.dirty[cur] = width
        ws.turn = other
        return ws.bufs[cur, :, :width], clear, True


class LoraSlots:
    """One linear layer's adapter weights for every slot (not module state: no checkpoint
    holds them): a [S, P*max_rank, in_local] (part p's A at rows p*max_rank..), b
    [S, sum(parts), max_rank] (part p's B at rows offsets[p]..offsets[p]+parts[p])."""

    use_kernels: bool | None = None     # None: the Triton kernels on CUDA, the references
                                        # elsewhere (the tests force the kernels on CPU)

    def __init__(self, layer: nn.Module, parts: list[int], row_parallel: bool, num_slots: int,
                 max_rank: int, ctx: LoraContext) -> None:
        w = layer.weight
        dtype = w.dtype if w.dtype.is_floating_point and w.element_size() > 1 else torch.bfloat16
        self.ctx = ctx
        self.tp = layer.tp
        self.row_parallel = row_parallel
        self.parts = parts                       # this rank's output rows of each part
        self.part_sizes = tuple(parts)
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]
        self.in_local = w.shape[1]
        self.max_rank = max_rank
        self.a = torch.zeros(num_slots, len(parts) * max_rank, self.in_local, dtype=dtype,
                             device=w.device)
        self.b = torch.zeros(num_slots, sum(parts), max_rank, dtype=dtype, device=w.device)
        self.scale = torch.zeros(num_slots, dtype=torch.float32, device=w.device)
        ctx.width = max(ctx.width, len(parts) * max_rank)

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
        self.b[slot].zero_()
        for p, (a, b) in parts.items():
            r, off = a.shape[0], self.offsets[p]
            assert b.shape == (self.parts[p], r), (b.shape, self.parts[p], r)
            self.a[slot, p * r_max:p * r_max + r].copy_(a, non_blocking=True)
            self.b[slot, off:off + self.parts[p], :r].copy_(b, non_blocking=True)
        self.scale[slot] = scale if parts else 0.0

    def decode_step(self) -> LoraStep:
        """The slots' tensors, by reference (models/decode_step.py)."""
        return LoraStep(self.a, self.b, self.scale, self.part_sizes, self.max_rank)

    def kernels(self, x: torch.Tensor) -> bool:
        return kernel_choice.paths(x).triton if self.use_kernels is None else self.use_kernels

    def shrink(self, x: torch.Tensor) -> GemvLora:
        """One token's h (lora_shrink into the step's workspace) and what the GEMV needs to
        add its delta in its epilogue (kernels/gemv.py), in place of apply's expand."""
        rows = self.ctx.rows
        h, clear, split = self.ctx.h_buffers(self.a.shape[1], x.device)
        lora_shrink(x, self.a, rows, out=h, clear=clear, split_k=None if split else 1)
        return GemvLora(h, self.b, self.scale, rows.slot, self.part_sizes)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's adapter delta, in place (y: the base GEMM's output, before any
        all-reduce)."""
        rows = self.ctx.rows
        if rows is None:
            return
        if not self.kernels(x):
            h = lora_shrink_ref(x, self.a, rows)
            lora_expand_ref(h, self.b, self.scale, rows, y, 0, self.part_sizes)
            return
        h, clear, split = self.ctx.h_buffers(self.a.shape[1], x.device)
        lora_shrink(x, self.a, rows, out=h, clear=clear, split_k=None if split else 1)
        lora_expand(h, self.b, self.scale, rows, y, 0, self.part_sizes)


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
        if getattr(layer, "quant", None) is not None:
            raise ValueError(f"LoRA adapters on {layer.quant.method} (int{layer.quant.bits}) "
                             "layers are not supported")
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
