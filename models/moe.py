"""Qwen3-MoE's sparse MLP: a router picks each token's top-k experts, each expert a SwiGLU.

Tensor parallel as the dense MLP: every rank holds every expert, sliced along the expert's
intermediate dimension (gate/up rows, down columns), and one all-reduce sums the ranks'
partial outputs. Parameters are stacked per layer, as Hugging Face keeps them in memory:
`experts.gate_up_proj` [E, 2 * I / tp, H] (gate rows, then up rows) and
`experts.down_proj` [E, H, I / tp]; the loader fills them from the per-expert tensors
(`experts.{e}.gate_proj.weight`, ...) that Qwen publishes, or from already-stacked ones.
GPTQ / AWQ experts stay packed (`experts.gate_up_qweight` [E, H / P, 2 * I / tp], ...: each
expert in models/quantized.py's layout, gate/up column-parallel, down row-parallel), filled
from `experts.{e}.gate_proj.qweight`, ...

On a GPU the router is one kernel (kernels/moe_route.py; `route` here is its reference) and
the experts run through kernels/fused_moe.py (tokens sorted to their experts, two grouped
GEMMs: only the selected experts' weights are read and their FLOPs spent; no host sync, so
it runs inside the decode CUDA graphs). Elsewhere, and as its test's reference,
`moe_reference`: every expert over every token, weighted by a dense [T, E] routing matrix
that is zero outside each token's top k (exact, E / k times the FLOPs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_linear import FP8, quantize_rows
from kernels.fused_moe import PackedExperts, fused_moe
from kernels.quant_linear import dequantize_ref
from kernels.moe_route import route_topk
from models import kernel_choice
from models.decode_step import ExpertsStep, LinearStep, MoEStep, QuantWeightStep, TPShard
from models.parallel import TPGroup, check_shape, divide, replicated_weight_loader
from models.quantized import KINDS, Slot, WeightQuant, convert, trivial_g_idx, weight_quant


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), the top k, renormalised if asked: (weights [T, k] in
    the logits' dtype, expert ids [T, k]). Hugging Face's Qwen3MoeTopKRouter, step for step."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H], gate_up
    [E, 2I, H], down [E, H, I] (one rank's slices: the result is that rank's partial sum)."""
    routing = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    routing.scatter_(1, ids, weights)                                    # [T, E]
    gate, up = torch.einsum("th,eih->tei", x, gate_up).chunk(2, dim=-1)  # [T, E, I] each
    out = torch.einsum("tei,ehi->teh", F.silu(gate) * up, down)          # [T, E, H]
    return torch.einsum("teh,te->th", out, routing)


class MoEExperts(nn.Module):
    """Every expert's weights of one layer, stacked; this rank's slice of each."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TPGroup, quant: WeightQuant | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.quant = quant
        self.inter = divide(intermediate_size, tp.size, "moe_intermediate_size")
        self.gate_up_scale = self.down_scale = None   # buffers once quantize_fp8 ran
        if quant is not None:
            self._init_packed(num_experts, hidden_size, intermediate_size, quant)
            return
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter),
                                      requires_grad=False)
        for param, parts in ((self.gate_up_proj, ("gate", "up")), (self.down_proj, ("down",))):
            param.weight_loader = self.weight_loader
            param.expected_shards = {(e, p) for e in range(num_experts) for p in parts}

    def _init_packed(self, num_experts: int, hidden: int, inter_full: int,
                     quant: WeightQuant) -> None:
        """Packed stacks (kernels/fused_moe.py's PackedExperts): gate_up [H, 2I_local] and
        down [I_local, H] per expert; down keeps every group of the full I (g_idx indexes)."""
        self.register_parameter("gate_up_proj", None)
        self.register_parameter("down_proj", None)
        per, inter, first = quant.per_word, self.inter, self.tp.rank * self.inter
        for k in (hidden, inter):
            if k % per:
                raise ValueError(f"{quant.method} experts: {k} input rows per rank are not whole "
                                 f"{per}-value words")
        for stack, k, n, rows, k_full, parts in (
                ("gate_up", hidden, 2 * inter, range(hidden), hidden, ("gate", "up")),
                ("down", inter, hidden, range(first, first + inter), inter_full, ("down",))):
            groups = quant.groups(k_full)
            tensors = {"qweight": torch.empty(num_experts, k // per, n, dtype=torch.int32),
                       "qzeros": torch.empty(num_experts, groups, n),
                       "scales": torch.empty(num_experts, groups, n),
                       "g_idx": trivial_g_idx(rows, k_full // groups).repeat(num_experts, 1)}
            for kind in KINDS:
                param = nn.Parameter(tensors[kind], requires_grad=False)
                param.weight_loader, param.quant_kind = self.packed_loader, kind
                param.expected_shards = ({(e, p) for e in range(num_experts) for p in parts}
                                         if kind != "g_idx" or quant.desc_act else set())
                setattr(self, f"{stack}_{kind}", param)

    @property
    def packed(self) -> tuple[PackedExperts, PackedExperts] | None:
        """fused_moe's int4 / int8 stacks (gate_up's, down's); None: not GPTQ / AWQ."""
        if self.quant is None:
            return None
        return tuple(PackedExperts(*(getattr(self, f"{stack}_{kind}") for kind in
                                     ("qweight", "scales", "qzeros", "g_idx")), self.quant.bits)
                     for stack in ("gate_up", "down"))

    def packed_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str]) -> None:
        """One expert's GPTQ / AWQ tensor (gate, up or down) -> this rank's slice of it."""
        expert, part = shard_id
        kind, inter = param.quant_kind, self.inter
        what = f"expert {expert} {part}_proj {self.quant.method} {kind}"
        hidden = self.down_qweight.shape[2]
        slot = (Slot(False, self.tp.rank, self.tp.size, 0, hidden, inter) if part == "down" else
                Slot(True, self.tp.rank, self.tp.size, 0 if part == "gate" else inter, inter,
                     hidden))
        t = convert(self.quant, kind, loaded, slot, what)
        dst = (param.data[expert] if kind == "g_idx"
               else param.data[expert].narrow(-1, slot.out_offset, slot.out_size))
        check_shape(dst, t, what)
        dst.copy_(t)

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fused_moe's FP8 scales (gate_up's [E, 2I], down's [E, H]); None: not quantized."""
        return None if self.gate_up_scale is None else (self.gate_up_scale, self.down_scale)

    def quantize_fp8(self) -> None:
        """Both stacks -> e4m3 with a float32 scale per output row, [E, 2I] and [E, H]
        (fused_moe's FP8 path, weight-only): half the memory, and half the bytes each decode
        step streams from the experts it touches. A few experts at a time, so the float32
        temporaries stay small next to the layer."""
        stacks = []
        for param in (self.gate_up_proj, self.down_proj):
            w = param.data
            q = torch.empty(w.shape, dtype=FP8, device=w.device)
            scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(0, w.shape[0], 16):
                rows, s = quantize_rows(w[e:e + 16].reshape(-1, w.shape[2]))
                q[e:e + 16] = rows.view(-1, *w.shape[1:])
                scale[e:e + 16] = s.view(-1, w.shape[1])
            stacks.append((nn.Parameter(q, requires_grad=False), scale))
        (self.gate_up_proj, gu_scale), (self.down_proj, d_scale) = stacks
        del self.gate_up_scale, self.down_scale   # plain attributes -> buffers (move with .to())
        self.register_buffer("gate_up_scale", gu_scale)
        self.register_buffer("down_scale", d_scale)

    def decode_step(self) -> ExpertsStep:
        """The stacks and their FP8 scales (or packed stacks), by reference
        (models/decode_step.py)."""
        packed = self.packed
        quant = None if packed is None else tuple(
            QuantWeightStep(p.qweight, p.scales, p.zeros, p.g_idx, p.bits, self.quant.group_size)
            for p in packed)
        return ExpertsStep(self.gate_up_proj, self.down_proj, self.gate_up_scale,
                           self.down_scale, TPShard(self.tp.rank, self.tp.size, 0), quant)

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) in dtype, dequantized if FP8 or packed: moe_reference's operands."""
        if self.quant is not None:
            gate_up, down = (torch.stack([dequantize_ref(p.qweight[e], p.scales[e], p.zeros[e],
                                                         p.g_idx[e], p.bits).T
                                          for e in range(p.qweight.shape[0])]).to(dtype)
                             for p in self.packed)
            return gate_up, down
        if self.scales is None:
            return self.gate_up_proj, self.down_proj
        return tuple((w.float() * s[..., None]).to(dtype)
                     for w, s in zip((self.gate_up_proj, self.down_proj), self.scales))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str] | None = None) -> None:
        """shard_id (expert, "gate" | "up" | "down") for one expert's [out, in] tensor;
        None for an already-stacked [E, ...] tensor of the whole parameter."""
        size, start = self.inter, self.tp.rank * self.inter
        if shard_id is None:
            if param is self.gate_up_proj:
                full = loaded.shape[1] // 2
                for e in range(loaded.shape[0]):
                    self.weight_loader(param, loaded[e, :full], (e, "gate"))
                    self.weight_loader(param, loaded[e, full:], (e, "up"))
            else:
                for e in range(loaded.shape[0]):
                    self.weight_loader(param, loaded[e], (e, "down"))
            return
        expert, part = shard_id
        if part == "down":
            dst, src = param.data[expert], loaded.narrow(1, start, size)
        else:
            dst = param.data[expert].narrow(0, 0 if part == "gate" else size, size)
            src = loaded.narrow(0, start, size)
        check_shape(dst, src, f"expert {expert} {part}_proj")
        dst.copy_(src)


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router + experts. reduce=False: the output is this rank's partial sum over its slice
    of every expert (the decoder layer's next RMSNorm sums it, as RowParallelLinear's)."""

    def __init__(self, config, tp: TPGroup, reduce: bool = True) -> None:
        super().__init__()
        self.reduce = reduce
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (Qwen3-MoE uses silu)")
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.gate.weight.weight_loader = replicated_weight_loader
        self.experts = MoEExperts(config.num_experts, config.hidden_size,
                                  config.moe_intermediate_size, tp, weight_quant(config))
        self.fused = False   # CPU: True runs the fused kernels (Triton's interpreter; tests)

    def decode_step(self) -> MoEStep:
        """Router, top-k rule and experts (models/decode_step.py)."""
        tp = self.tp
        router = LinearStep(weight=self.gate.weight, bias=None, weight_scale=None,
                            parts=(self.gate.weight.shape[0],),
                            shard=TPShard(tp.rank, tp.size, None), reduce=False, lora=None)
        return MoEStep(router, self.top_k, self.norm_topk_prob, self.experts.decode_step(),
                       self.reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = kernel_choice.paths(x).triton or self.fused
        weights, ids = (route_topk if fused else route)(self.gate(x), self.top_k,
                                                        self.norm_topk_prob)
        e = self.experts
        if fused:
            out = fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids, e.scales,
                            packed=e.packed)
        else:
            out = moe_reference(x, *e.dense(x.dtype), weights, ids)
        return self.tp.all_reduce(out) if self.reduce else out


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Hugging Face's rule: an MoE layer unless listed in mlp_only_layers or off the
    decoder_sparse_step grid."""
    return (getattr(config, "num_experts", 0) > 0
            and layer_idx not in (getattr(config, "mlp_only_layers", None) or ())
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)
