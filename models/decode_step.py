"""What each layer's decode step reads and runs, as data.

A persistent small-batch decode kernel (issue 63) must derive its task list from the same
modules and weights the per-op path runs, not from a second hand-written model. So each
layer type has a `decode_step()` returning one of these frozen descriptions, and
`Qwen3ForCausalLM.decode_step()` the whole model's, layer by layer in execution order.

They hold references to the module's own tensors (same storage: no copy of any weight), so
build them after loading, FP8 quantization, adapter attachment and KV binding; they are
cheap, and built fresh on each call, never cached (quantize_fp8 and the runner replace
tensors). Which kernel an op takes for a given batch is not here: models/kernel_choice.py.
tests/test_decode_step.py runs a decode step from a description alone, which checks that
the descriptions are complete.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPShard:
    """How a layer's tensors are split over the tensor-parallel ranks."""
    rank: int
    size: int
    dim: int | None   # of the weight [out, in]: 0 output rows (column-parallel, vocab
                      # shards), 1 input columns (row-parallel), None replicated


@dataclass(frozen=True)
class LoraStep:
    """A linear layer's adapter slots (models/lora.py's layout): row t adds
    scale[s] * (x A_s^T) B_s^T, s its slot in the step's LoraContext.rows (-1: none)."""
    a: torch.Tensor                 # [slots, parts * max_rank, in_local]
    b: torch.Tensor                 # [slots, out_local, max_rank]
    scale: torch.Tensor             # [slots] float32
    part_sizes: tuple[int, ...]     # output rows of each part (B's stacking along out)
    max_rank: int


@dataclass(frozen=True)
class QuantWeightStep:
    """A GPTQ / AWQ weight in kernels/quant_linear.py's layout (W is [in, out] here):
    W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] with g = g_idx[k]."""
    qweight: torch.Tensor                # [in_local / (32 / bits), out_local] int32, packed along in
    scales: torch.Tensor                 # [groups, out_local] model dtype
    zeros: torch.Tensor                  # [groups, out_local] model dtype (true zero points)
    g_idx: torch.Tensor                  # [in_local] int32: each input row's group
    bits: int                            # 4 or 8
    group_size: int                      # input rows per group (-1: all of them)


@dataclass(frozen=True)
class LinearStep:
    """y = x W^T (* weight_scale per output row for e4m3 W) (+ bias) (+ adapters' deltas).

    Row-parallel (shard.dim == 1): y is a partial sum over the ranks; reduce=True sums it
    here, else the next norm does (NormStep.tp_sum), and the bias is added once (after the
    sum, or by rank 0 alone). A GPTQ / AWQ layer has weight None and its packed W in quant."""
    weight: torch.Tensor | None          # [out_local, in_local]: bf16 / fp16 / fp32 or e4m3
    bias: torch.Tensor | None            # [out_local]
    weight_scale: torch.Tensor | None    # [out_local, 1] float32 where weight is e4m3
    parts: tuple[int, ...]               # output rows of each merged matrix (q, k, v / gate, up)
    shard: TPShard
    reduce: bool                         # all-reduced here (row-parallel layers only)
    lora: LoraStep | None                # adapter slots, where adapters are served
    quant: QuantWeightStep | None = None  # int4 / int8 weight (GPTQ, AWQ), where weight is None

    @property
    def in_features(self) -> int:
        if self.quant is not None:
            return self.quant.g_idx.shape[0]
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        if self.quant is not None:
            return self.quant.qweight.shape[1]
        return self.weight.shape[0]


@dataclass(frozen=True)
class NormStep:
    """RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, in float32. On the residual stream it
    first adds the residual (x + residual becomes the new residual)."""
    weight: torch.Tensor                 # [features]
    eps: float
    tp_sum: bool                         # x (given with a residual) is a partial sum over
                                         # the TP ranks: all-reduce it before the add


@dataclass(frozen=True)
class RotaryStep:
    """Neox-style rotary embedding (rotate halves) at each token's absolute position."""
    cos_sin_cache: torch.Tensor          # [max_position, head_dim] float32: cos | sin halves
    head_dim: int


@dataclass(frozen=True)
class AttentionStep:
    """Store this step's k/v at meta.slot_mapping, then attend over each sequence's blocks
    (meta.block_tables, meta.context_lens), causally within the step's own tokens."""
    k_cache: torch.Tensor                # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None         # [num_blocks, block_size] float32: e4m3 caches
    v_scale: torch.Tensor | None
    num_heads: int                       # this rank's
    num_kv_heads: int
    head_dim: int
    scale: float                         # softmax scale

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]


@dataclass(frozen=True)
class AttentionBlockStep:
    """qkv -> per-head q/k norm (Qwen3; None for Llama / Qwen2) -> rotary -> attention -> o."""
    qkv: LinearStep                      # parts (q, k, v)
    q_norm: NormStep | None
    k_norm: NormStep | None
    rotary: RotaryStep
    attn: AttentionStep
    o_proj: LinearStep                   # row-parallel

    def ops(self) -> tuple[tuple[str, object], ...]:
        """(module name under the block, description) in execution order."""
        norms = () if self.q_norm is None else (("q_norm", self.q_norm), ("k_norm", self.k_norm))
        return (("qkv_proj", self.qkv), *norms, ("rotary_emb", self.rotary), ("attn", self.attn),
                ("o_proj", self.o_proj))


@dataclass(frozen=True)
class MLPStep:
    """down(silu(gate) * up) with gate and up the two parts of one projection."""
    gate_up: LinearStep                  # parts (gate, up)
    down: LinearStep                     # row-parallel

    def ops(self) -> tuple[tuple[str, object], ...]:
        return (("gate_up_proj", self.gate_up), ("down_proj", self.down))


@dataclass(frozen=True)
class ExpertsStep:
    """Every expert's SwiGLU of one layer, stacked; this rank's slice of each (the output a
    partial sum over the ranks)."""
    gate_up: torch.Tensor | None         # [E, 2 * I_local, H] (gate rows, then up rows)
    down: torch.Tensor | None            # [E, H, I_local]
    gate_up_scale: torch.Tensor | None   # [E, 2 * I_local] float32 where e4m3
    down_scale: torch.Tensor | None      # [E, H]
    shard: TPShard                       # dim 0 of each expert's gate/up rows
    quant: tuple[QuantWeightStep, QuantWeightStep] | None = None   # GPTQ / AWQ experts
    # (gate_up's [H, 2 * I_local], down's [I_local, H] per expert, stacked on a leading E
    # dimension); gate_up and down are None then


@dataclass(frozen=True)
class MoEStep:
    """router logits -> softmax (float32) -> top_k (renormalised if norm_topk_prob) ->
    the weighted sum of those experts' outputs."""
    router: LinearStep                   # [E, H], replicated
    top_k: int
    norm_topk_prob: bool
    experts: ExpertsStep
    reduce: bool                         # all-reduced here; False: the next norm sums it

    def ops(self) -> tuple[tuple[str, object], ...]:
        return (("gate", self.router), ("experts", self.experts))


@dataclass(frozen=True)
class DecoderLayerStep:
    """Pre-norm block: norm (+ residual) -> attention -> norm (+ residual) -> MLP or MoE."""
    index: int
    input_norm: NormStep                 # no residual (nor TP sum) in layer 0
    attn: AttentionBlockStep
    post_attention_norm: NormStep
    mlp: MLPStep | MoEStep

    def ops(self) -> tuple[tuple[str, object], ...]:
        """(module name under the layer, leaf description) in execution order."""
        return (("input_layernorm", self.input_norm),
                *((f"self_attn.{n}", s) for n, s in self.attn.ops()),
                ("post_attention_layernorm", self.post_attention_norm),
                *((f"mlp.{n}", s) for n, s in self.mlp.ops()))


@dataclass(frozen=True)
class VocabStep:
    """A vocab-parallel matrix [shard_rows, H]: rank r holds vocab rows [start, end), the
    rest of its shard zero. As the embedding: look ids up (other ranks' ids as zeros), then
    all-reduce; as the LM head: hidden @ weight^T, all-gather, cut to num_embeddings."""
    weight: torch.Tensor
    vocab_start: int
    vocab_end: int
    num_embeddings: int
    shard: TPShard


@dataclass(frozen=True)
class ModelStep:
    """A decoder-only model's decode step: embed -> layers -> final norm (+ the last
    layer's residual) -> LM head over the rows that need logits."""
    embed: VocabStep
    layers: tuple[DecoderLayerStep, ...]
    norm: NormStep
    lm_head: VocabStep                   # weight is embed's where embeddings are tied

    def ops(self) -> tuple[tuple[str, object], ...]:
        """Every leaf op with its module name under the model, in execution order."""
        return (("model.embed_tokens", self.embed),
                *((f"model.layers.{layer.index}.{n}", s)
                  for layer in self.layers for n, s in layer.ops()),
                ("model.norm", self.norm), ("lm_head", self.lm_head))
