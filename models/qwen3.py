"""Qwen3 decoder built from tensor-parallel layers over a paged KV cache.

Llama and Qwen2/2.5 checkpoints run through the same code: their layers are Qwen3 layers
without the per-head q/k RMSNorm; Qwen2's q/k/v projections carry biases (its o_proj does
not), Llama's all four or none (`attention_bias`). Qwen3-MoE is Qwen3 whose MLP is, in the
layers `moe.is_sparse_layer` picks, a mixture of experts (models/moe.py).

Parameter names match the Hugging Face checkpoint except where projections are merged
(q/k/v -> qkv_proj, gate/up -> gate_up_proj); `packed_modules_mapping` tells the loader
how to route those. The input is one flat ragged batch of tokens (no padding): positions
give each token's place in its sequence and `meta` says which tokens belong together.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.attention import AttentionMetadata, select_backend
from kernels.fp8_linear import QuantizedRows
from kernels.qk_norm_rotary import NormRotary, qk_norm_rotary
from models import kernel_choice
from models.attention import Attention
from models.decode_step import AttentionBlockStep, DecoderLayerStep, MLPStep, ModelStep
from models.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layernorm import DeferredNorm, RMSNorm
from models.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from models.moe import Qwen3MoeSparseMoeBlock, is_sparse_layer
from models.parallel import TPGroup
from models.quantized import weight_quant
from models.rotary import RotaryEmbedding, rope_from_config


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Attention(nn.Module):
    """qkv GEMM -> per-head q/k RMSNorm -> rotary -> paged attention -> o GEMM."""

    def __init__(self, config, tp: TPGroup, backend) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        quant = weight_quant(config)   # GPTQ / AWQ int4 / int8 projections, else None
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads,
                                          bias=bias or config.model_type == "qwen2", tp=tp,
                                          quant=quant)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=bias and config.model_type != "qwen2", tp=tp,
                                        reduce=False, quant=quant)   # summed in the next norm
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim, rope=rope_from_config(config))
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5, backend)

    def decode_step(self) -> AttentionBlockStep:
        return AttentionBlockStep(
            qkv=self.qkv_proj.decode_step(),
            q_norm=self.q_norm.decode_step() if self.qk_norm else None,
            k_norm=self.k_norm.decode_step() if self.qk_norm else None,
            rotary=self.rotary_emb.decode_step(), attn=self.attn.decode_step(),
            o_proj=self.o_proj.decode_step())

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        fused = self.qk_norm and kernel_choice.paths(q).fused
        if (fused and self.attn.takes_norm_rotary(q, meta)
                and self.rotary_emb.cos_sin_cache.shape[-1] == self.head_dim):
            # decode rows: the attention kernel normalizes, rotates and stores them itself
            nr = NormRotary(k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                            self.rotary_emb.cos_sin_cache, meta.slot_mapping)
            return self.o_proj(self.attn(q, k, v, meta, norm_rotary=nr).reshape(-1, q_size))
        if fused:
            # one kernel for q norm + k norm + rotary + K/V store (kernels/qk_norm_rotary.py);
            # NANOSERVE_FUSED_KERNELS=0 runs the four kernels below instead
            q, k = qk_norm_rotary(q, k, self.q_norm.weight, self.k_norm.weight,
                                  self.q_norm.eps, positions, self.rotary_emb.cos_sin_cache,
                                  v=v, **self.attn.cache(meta))
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta, kv_stored=fused)
        return self.o_proj(out.reshape(-1, q_size))


class Qwen3MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, config, tp: TPGroup) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (Qwen3 uses silu)")
        if getattr(config, "mlp_bias", False):
            raise ValueError("MLP bias is not supported")
        quant = weight_quant(config)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False, tp=tp, quant=quant)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=False, tp=tp, reduce=False,   # summed in the next norm
                                           quant=quant)

    def decode_step(self) -> MLPStep:
        return MLPStep(self.gate_up_proj.decode_step(), self.down_proj.decode_step())

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        return self.gate_up_proj.takes_fp8_rows(x)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        # x may come quantized from the norm, or as the norm itself (DeferredNorm); the
        # activation quantizes for down_proj alike
        plain = x.x if isinstance(x, (QuantizedRows, DeferredNorm)) else x
        return self.down_proj(self.gate_up_proj.swiglu(
            x, fp8=self.down_proj.takes_fp8_rows(plain)))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is passed alongside so the adds fuse into norms.
    Under TP the attention and the MLP return partial sums, and the norm after each (this
    layer's post-attention norm, the next layer's input norm, the model's final norm) sums
    them over the ranks: all-reduce, add and norm in one kernel where it can."""

    def __init__(self, config, tp: TPGroup, backend, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = Qwen3Attention(config, tp, backend)
        self.mlp = (Qwen3MoeSparseMoeBlock(config, tp, reduce=False)
                    if is_sparse_layer(config, layer_idx) else Qwen3MLP(config, tp))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, tp=tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                                tp=tp)

    def decode_step(self) -> DecoderLayerStep:
        return DecoderLayerStep(self.layer_idx, self.input_layernorm.decode_step(),
                                self.self_attn.decode_step(),
                                self.post_attention_layernorm.decode_step(),
                                self.mlp.decode_step())

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                aux: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the embedding (first layer) or the previous layer's MLP output, unreduced.
        aux: gets a copy of the residual stream entering this layer (EAGLE-3's input)."""
        # Before FP8 GEMMs of several tokens the norms also write their output as e4m3
        # (QuantizedRows), saving the GEMMs' quantize launches; before a one-token GEMV
        # that takes it (kernel_choice's normed_linear), a norm is left to that GEMV's
        # prologue (DeferredNorm): no launch of its own
        fp8 = self.self_attn.qkv_proj.takes_fp8_rows(hidden)
        if aux is None and self._defers(self.input_layernorm, self.self_attn.qkv_proj, hidden):
            hidden = self.input_layernorm.deferred(hidden, residual)
            residual = hidden.residual
        elif residual is None:
            hidden, residual = self.input_layernorm(hidden, fp8=fp8), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, fp8=fp8)
        if aux is not None:
            aux.append(residual.clone())   # the norms update the residual in place
        hidden = self.self_attn(positions, hidden, meta)
        mlp = self.mlp if isinstance(self.mlp, Qwen3MLP) else None
        if mlp is not None and mlp.gate_up_proj.bias is None and kernel_choice.paths(
                hidden).gated_linear and self._defers(self.post_attention_layernorm,
                                                    mlp.gate_up_proj, hidden):
            hidden = self.post_attention_layernorm.deferred(hidden, residual)
            return self.mlp(hidden), hidden.residual
        fp8 = mlp is not None and mlp.takes_fp8_rows(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual, fp8=fp8)
        return self.mlp(hidden), residual

    @staticmethod
    def _defers(norm: RMSNorm, linear, x: torch.Tensor) -> bool:
        """Whether `norm` of x is left to `linear`'s GEMV (no TP sum to make first)."""
        return not norm.sums_ranks and linear.takes_norm(x)


class Qwen3Model(nn.Module):
    def __init__(self, config, tp: TPGroup, backend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, tp, backend, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, tp=tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final hidden [T, H], features): features are the residual stream entering each
        of `feature_layers`, concatenated [T, len * H] (what an EAGLE-3 head drafts from,
        models/eagle3.py), None where none are asked for."""
        hidden, residual = self.embed_tokens(input_ids), None
        aux = []
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, meta,
                                     aux if i in feature_layers else None)
        hidden, _ = self.norm(hidden, residual)
        return hidden, (torch.cat(aux, dim=-1) if aux else None)


class Qwen3ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, tp: TPGroup = TPGroup(), attn_backend=None) -> None:
        super().__init__()
        if getattr(config, "use_sliding_window", False) or \
                "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            raise ValueError("sliding-window attention layers are not supported")
        self.config = config
        self.tp = tp
        backend = attn_backend if attn_backend is not None else select_backend("torch")
        self.model = Qwen3Model(config, tp, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden_size] (every token; pick rows for logits)."""
        return self.model(input_ids, positions, meta)[0]

    def features(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As forward, and the features entering `layers` (Qwen3Model.forward)."""
        return self.model(input_ids, positions, meta, layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size], full vocab on every rank."""
        return self.lm_head(hidden)

    def decode_step(self) -> ModelStep:
        """What one decode step reads and runs, layer by layer (models/decode_step.py):
        references to this model's own tensors and KV views, built after loading and KV
        binding."""
        m = self.model
        return ModelStep(m.embed_tokens.decode_step(),
                         tuple(layer.decode_step() for layer in m.layers),
                         m.norm.decode_step(), self.lm_head.decode_step())


def kv_cache_layers(model: nn.Module) -> list[Attention]:
    """Every paged Attention layer in layer order, for the runner to assign KV views."""
    return [m for m in model.modules() if isinstance(m, Attention)]
