"""Qwen3-MoE's sparse MLP: a router picks each token's top-k experts, each expert a SwiGLU.

Tensor parallel as the dense MLP: every rank holds every expert, sliced along the expert's
intermediate dimension (gate/up rows, down columns), and one all-reduce sums the ranks'
partial outputs. Parameters are stacked per layer, as Hugging Face keeps them in memory:
`experts.gate_up_proj` [E, 2 * I / tp, H] (gate rows, then up rows) and
`experts.down_proj` [E, H, I / tp]; the loader fills them from the per-expert tensors
(`experts.{e}.gate_proj.weight`, ...) that Qwen publishes, or from already-stacked ones.

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
from kernels.fused_moe import fused_moe
from kernels.moe_route import route_topk
from models import kernel_choice
from models.decode_step import ExpertsStep, LinearStep, MoEStep, TPShard
from models.parallel import TPGroup, check_shape, divide, replicated_weight_loader


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
                 tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.inter = divide(intermediate_size, tp.size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter),
                                      requires_grad=False)
        for param, parts in ((self.gate_up_proj, ("gate", "up")), (self.down_proj, ("down",))):
            param.weight_loader = self.weight_loader
            param.expected_shards = {(e, p) for e in range(num_experts) for p in parts}
        self.gate_up_scale = self.down_scale = None   # buffers once quantize_fp8 ran

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
        """The stacks and their FP8 scales, by reference (models/decode_step.py)."""
        return ExpertsStep(self.gate_up_proj, self.down_proj, self.gate_up_scale,
                           self.down_scale, TPShard(self.tp.rank, self.tp.size, 0))

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) in dtype, dequantized if FP8: moe_reference's operands."""
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
                                  config.moe_intermediate_size, tp)
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
            out = fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids, e.scales)
        else:
            out = moe_reference(x, *e.dense(x.dtype), weights, ids)
        return self.tp.all_reduce(out) if self.reduce else out


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Hugging Face's rule: an MoE layer unless listed in mlp_only_layers or off the
    decoder_sparse_step grid."""
    return (getattr(config, "num_experts", 0) > 0
            and layer_idx not in (getattr(config, "mlp_only_layers", None) or ())
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)
