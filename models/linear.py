"""Linear layers sharded for tensor parallelism (Megatron style).

Column-parallel layers split the output features across ranks, so their output stays
sharded and needs no communication; row-parallel layers split the input features, take
the sharded activation, and all-reduce the partial sums. An attention block or MLP is
one column-parallel layer followed by one row-parallel layer: one all-reduce each.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)` that copies
this rank's slice of a full checkpoint tensor into it. After loading, `quantize_fp8()` turns
a layer's weight into e4m3 with per-output-channel scales (kernels/fp8_linear.py), each rank
quantizing its own slice. Built with `quant` (a GPTQ / AWQ checkpoint's WeightQuant), a
layer holds packed int4 / int8 weights instead (models/quantized.py: qweight, scales,
qzeros, g_idx; kernels/quant_linear.py multiplies them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_linear import FP8, QuantizedRows, fp8_linear, quantize_rows
import kernels.quant_linear
from kernels.batch_invariant import invariant_linear
from kernels.gemv import GemvLora, GemvNorm, gemv
from kernels.small_m import small_m_linear
from kernels.quant_linear import consecutive_group, quant_linear, quant_linear_ref
from models import activation, kernel_choice
from models.decode_step import LinearStep, QuantWeightStep, TPShard
from models.layernorm import DeferredNorm
from models.parallel import TPGroup, check_shape, divide, replicated_weight_loader
from models.quantized import KINDS, Slot, WeightQuant, convert, trivial_g_idx


class LinearBase(nn.Module):
    """Holds weight [out_local, in_local] (or, quantized, qweight / scales / qzeros / g_idx)
    and optional bias [out_local]."""

    shard_dim: int | None = None   # the weight's dimension split over the TP ranks
    reduce = False                 # whether forward all-reduces (row-parallel layers)

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TPGroup,
                 quant: WeightQuant | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.lora = None   # models/lora.py LoraSlots, when adapters are served
        self.quant = quant
        self.in_local, self.out_local = in_local, out_local
        if quant is None:
            self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            self.register_parameter("weight", None)
            self._init_quantized(quant)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        raise NotImplementedError

    def out_slot(self, shard_id: object) -> tuple[int, int]:
        """(first local output column, local columns) of a checkpoint part (None: all)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} got unexpected shard id {shard_id!r}")
        return 0, self.out_local

    def _init_quantized(self, quant: WeightQuant) -> None:
        """Empty packed parameters in kernels/quant_linear.py's layout; g_idx starts as
        consecutive groups (this rank's rows), which a GPTQ checkpoint's g_idx replaces."""
        row_parallel = self.shard_dim == 1
        in_full = self.in_local * self.tp.size if row_parallel else self.in_local
        groups = quant.groups(in_full)
        if self.in_local % quant.per_word:
            raise ValueError(f"{type(self).__name__}: {self.in_local} input rows per rank are "
                             f"not whole {quant.per_word}-value words")
        first = self.tp.rank * self.in_local if row_parallel else 0
        tensors = {
            "qweight": torch.empty(self.in_local // quant.per_word, self.out_local, dtype=torch.int32),
            "qzeros": torch.empty(groups, self.out_local),
            "scales": torch.empty(groups, self.out_local),
            "g_idx": trivial_g_idx(range(first, first + self.in_local), in_full // groups),
        }
        for kind in KINDS:
            param = nn.Parameter(tensors[kind], requires_grad=False)
            param.weight_loader, param.quant_kind = self.quant_loader, kind
            setattr(self, kind, param)
        if not quant.desc_act:   # consecutive groups unless the checkpoint says otherwise
            self.g_idx.expected_shards = set()
        self._g_idx_parts: set = set()
        # the GEMV's group path, from the loaded g_idx at the first matmul (a host read: on
        # a GPU that is the worker's eager profile run, before any CUDA graph is captured)
        self.quant_group: int | None = None

    def quant_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: object = None) -> None:
        """One GPTQ / AWQ checkpoint tensor (of one part) -> this rank's slice of param."""
        if shard_id is None and len(self.part_sizes()) > 1:
            raise ValueError(f"{type(self).__name__}: a merged {self.quant.method} "
                             f"{param.quant_kind} is not supported (one tensor per projection)")
        offset, size = self.out_slot(shard_id)
        kind = param.quant_kind
        what = f"{type(self).__name__} {self.quant.method} {kind}" + (
            f" part {shard_id}" if shard_id is not None else "")
        t = convert(self.quant, kind, loaded, Slot(self.shard_dim == 0, self.tp.rank,
                                                    self.tp.size, offset, size, self.in_local), what)
        if kind == "g_idx":
            check_shape(param, t, what)
            if self._g_idx_parts and not torch.equal(param.data, t.to(param.device)):
                raise ValueError(f"{what}: act-order g_idx differs between the merged "
                                 "projections (they share one input)")
            self._g_idx_parts.add(shard_id)
            param.data.copy_(t)
            return
        dst = param.data.narrow(1, offset, size)
        check_shape(dst, t, what)
        dst.copy_(t)

    def quantize_fp8(self) -> None:
        """Weight -> e4m3 + a float32 scale per output channel (`weight_scale` [out, 1])."""
        q, scale = quantize_rows(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale)

    @property
    def fp8_scale(self) -> torch.Tensor | None:
        """weight_scale where the weight is e4m3, else None: what the GEMV, the GEMM and
        decode_step all read."""
        return self.weight_scale if self.weight is not None and self.weight.dtype == FP8 else None

    def part_sizes(self) -> tuple[int, ...]:
        """This rank's output rows of each matrix merged into this one."""
        return (self.out_local,)

    def decode_step(self) -> LinearStep:
        """This layer's own tensors and sharding (models/decode_step.py)."""
        quant = None if self.quant is None else QuantWeightStep(
            self.qweight, self.scales, self.qzeros, self.g_idx, self.quant.bits,
            self.quant.group_size)
        return LinearStep(weight=self.weight, bias=self.bias, weight_scale=self.fp8_scale,
                          parts=self.part_sizes(),
                          shard=TPShard(self.tp.rank, self.tp.size, self.shard_dim),
                          reduce=self.reduce,
                          lora=None if self.lora is None else self.lora.decode_step(),
                          quant=quant)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether matmul(x) would quantize x per token (kernel_choice.fp8_rows): then the
        kernel that makes x (RMSNorm, SiLU-and-mul) hands it over as QuantizedRows, one
        launch less."""
        return self.weight is not None and kernel_choice.fp8_rows(x, self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               lora: GemvLora | None = None, quantized: QuantizedRows | None = None
               ) -> torch.Tensor:
        if self.quant is not None:
            assert lora is None and quantized is None
            if not (kernel_choice.paths(x).triton or kernels.quant_linear.ON_CPU):
                return quant_linear_ref(x, self.qweight, self.scales, self.qzeros, self.g_idx,
                                        self.quant.bits, bias)
            group = self.quant_group
            if group is None:   # (a capture cannot read g_idx: the general path, same sums)
                capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
                group = 0 if capturing else consecutive_group(self.g_idx)
                self.quant_group = None if capturing else group
            return quant_linear(x, self.qweight, self.scales, self.qzeros, self.g_idx,
                                self.quant.bits, bias, group_size=group)
        scale = self.fp8_scale
        p = kernel_choice.paths(x)
        if p.invariant:   # --deterministic: one kernel, one order, for every row count
            return invariant_linear(x, self.weight, scale, bias)
        if p.gemv:
            return gemv(x, self.weight, scale, bias, lora=lora)
        assert lora is None
        if scale is not None:
            return fp8_linear(x, self.weight, scale, bias, quantized)
        if self.on_small_m(x):
            return small_m_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def on_small_m(self, x: torch.Tensor) -> bool:
        """Whether x's rows take kernels/small_m.py (kernel_choice's small_m): bf16 / fp16
        weights in x's dtype, not e4m3 (their small-M path quantizes x), not int4/int8."""
        return (kernel_choice.paths(x).small_m and self.quant is None
                and self.fp8_scale is None and self.weight.dtype == x.dtype
                and x.dtype in (torch.bfloat16, torch.float16))

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether x's rows go to a kernel that can take the norm before it and the SwiGLU
        after it (fused_matmul): the one-token GEMV, or the small-M kernel (on_small_m)."""
        return kernel_choice.paths(x).gemv or self.on_small_m(x)

    def fused_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, *,
                     gated: bool = False, norm: GemvNorm | None = None) -> torch.Tensor:
        """x W^T with the norm before it (norm) and / or the SwiGLU after it (gated) in the
        kernel: the one-token GEMV, or the small-M kernel (fuses said so)."""
        if kernel_choice.paths(x).gemv:
            return gemv(x, self.weight, self.fp8_scale, bias, gated=gated, norm=norm)
        return small_m_linear(x, self.weight, bias, gated=gated, norm=norm)

    def takes_norm(self, x: torch.Tensor) -> bool:
        """Whether this layer's GEMV (or small-M kernel) would take x's norm into its
        prologue (DeferredNorm): kernel_choice's normed_linear, no adapter, no int4/int8."""
        if self.quant is not None or self.lora is not None or self.weight is None:
            return False
        return kernel_choice.paths(x).normed_linear and self.fuses(x)

    def project(self, x: torch.Tensor | QuantizedRows | DeferredNorm,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) plus each row's adapter delta (models/lora.py): one token on the
        GEMV gets it in the GEMV's epilogue (no expand launch), others after the GEMM. A
        DeferredNorm (takes_norm) is normalized in the fused kernel's prologue."""
        if isinstance(x, DeferredNorm):
            return self.fused_matmul(x.x, bias, norm=x.norm)
        quantized = x if isinstance(x, QuantizedRows) else None
        x = quantized.x if quantized is not None else x
        lora = self.lora
        if lora is None or lora.ctx.rows is None:
            return self.matmul(x, bias, quantized=quantized)
        if kernel_choice.lora_in_gemv(kernel_choice.paths(x), lora.kernels(x)):
            return self.matmul(x, bias, lora.shrink(x))
        y = self.matmul(x, bias, quantized=quantized)
        lora.apply(x, y)
        return y

    def forward(self, x: torch.Tensor | QuantizedRows | DeferredNorm) -> torch.Tensor:
        return self.project(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y[:, rank's rows] = x @ W[rank's rows].T: output features are sharded."""

    shard_dim = 0

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPGroup = TPGroup(), quant: WeightQuant | None = None) -> None:
        super().__init__(input_size, divide(output_size, tp.size, "output size"), bias, tp,
                         quant)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} got unexpected shard id {shard_id!r}")
        size = param.shape[0]
        shard = loaded_weight.narrow(0, self.tp.rank * size, size)
        check_shape(param, shard, type(self).__name__)
        param.data.copy_(shard)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one GEMM (gate_proj + up_proj).

    Each rank holds [its slice of part 0; its slice of part 1; ...], so the local output
    splits back into the parts with a plain chunk."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup = TPGroup(), quant: WeightQuant | None = None) -> None:
        for size in output_sizes:
            divide(size, tp.size, "output size")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp, quant)

    def part_sizes(self) -> tuple[int, ...]:
        return tuple(size // self.tp.size for size in self.output_sizes)

    def out_slot(self, shard_id: object) -> tuple[int, int]:
        if shard_id not in range(len(self.output_sizes)):
            raise ValueError(f"merged linear has no part {shard_id!r}")
        sizes = self.part_sizes()
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is None:  # an already-merged checkpoint tensor: split and recurse
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        offset, size = self.out_slot(shard_id)
        dst = param.data.narrow(0, offset, size)
        shard = loaded_weight.narrow(0, self.tp.rank * size, size)
        check_shape(dst, shard, f"merged linear part {shard_id}")
        dst.copy_(shard)

    def swiglu(self, x: torch.Tensor | QuantizedRows, fp8: bool = False):
        """silu(gate) * up of this [gate, up] layer (as QuantizedRows where fp8). Where the
        GEMV or the small-M kernel takes x (fuses), with no adapter in play and fused kernels
        on, straight from its epilogue (one launch less per MLP); otherwise this layer, then
        the activation."""
        if isinstance(x, DeferredNorm):   # (takes_norm said so: no adapter, no bias)
            return self.fused_matmul(x.x, gated=True, norm=x.norm)
        lora = self.lora
        if (not fp8 and len(self.output_sizes) == 2 and not isinstance(x, QuantizedRows)
                and kernel_choice.paths(x).gated_linear and self.bias is None
                and self.quant is None
                and (lora is None or lora.ctx.rows is None) and self.fuses(x)):
            return self.fused_matmul(x, gated=True)
        return activation.swiglu(self(x), fp8=fp8)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM, sharded by attention head.

    Each rank holds its q heads, then its k heads, then its v heads; GQA groups stay
    whole because both head counts must divide by the TP size."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, tp: TPGroup = TPGroup(),
                 quant: WeightQuant | None = None) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp.size, "num_key_value_heads")
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias, tp, quant)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def part_sizes(self) -> tuple[int, ...]:
        return (self.q_size, self.kv_size, self.kv_size)

    def out_slot(self, shard_id: object) -> tuple[int, int]:
        offsets = {"q": (0, self.q_size),
                   "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        if shard_id not in offsets:
            raise ValueError(f"qkv linear has no part {shard_id!r}")
        return offsets[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        q_total, kv_total = self.q_size * self.tp.size, self.kv_size * self.tp.size
        if shard_id is None:  # an already-fused qkv checkpoint tensor: split and recurse
            q, k, v = loaded_weight.split([q_total, kv_total, kv_total], dim=0)
            for sid, part in (("q", q), ("k", k), ("v", v)):
                self.weight_loader(param, part, sid)
            return
        offset, size = self.out_slot(shard_id)
        dst = param.data.narrow(0, offset, size)
        shard = loaded_weight.narrow(0, self.tp.rank * size, size)
        check_shape(dst, shard, f"qkv part {shard_id}")
        dst.copy_(shard)


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x[:, rank's cols] @ W[:, rank's cols].T (+ bias once).

    The bias is replicated and counted once: added after the all-reduce, or with
    reduce=False by rank 0 alone. reduce=False returns this rank's partial sum for the
    caller to reduce: the decoder layers sum it inside the next RMSNorm (models/layernorm.py),
    where the all-reduce, the residual add and the norm can be one kernel."""

    shard_dim = 1

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPGroup = TPGroup(), reduce: bool = True,
                 quant: WeightQuant | None = None) -> None:
        super().__init__(divide(input_size, tp.size, "input size"), output_size, bias, tp,
                         quant)
        self.reduce = reduce
        if self.bias is not None:
            self.bias.weight_loader = replicated_weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear got unexpected shard id {shard_id!r}")
        size = param.shape[1]
        shard = loaded_weight.narrow(1, self.tp.rank * size, size)
        check_shape(param, shard, "RowParallelLinear")
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)   # the adapter's delta a partial sum too, like the GEMM's (lora.py)
        if not self.reduce:
            return y if self.bias is None or self.tp.rank else y + self.bias
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
