"""Linear layers sharded for tensor parallelism (Megatron style).

Column-parallel layers split the output features across ranks, so their output stays
sharded and needs no communication; row-parallel layers split the input features, take
the sharded activation, and all-reduce the partial sums. An attention block or MLP is
one column-parallel layer followed by one row-parallel layer: one all-reduce each.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)` that copies
this rank's slice of a full checkpoint tensor into it. After loading, `quantize_fp8()` turns
a layer's weight into e4m3 with per-output-channel scales (kernels/fp8_linear.py), each rank
quantizing its own slice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_linear import FP8, QuantizedRows, fp8_linear, quantize_rows
from kernels.gemv import GemvLora, gemv
from models import activation, kernel_choice
from models.decode_step import LinearStep, TPShard
from models.parallel import TPGroup, check_shape, divide, replicated_weight_loader


class LinearBase(nn.Module):
    """Holds weight [out_local, in_local] and optional bias [out_local]."""

    shard_dim: int | None = None   # the weight's dimension split over the TP ranks
    reduce = False                 # whether forward all-reduces (row-parallel layers)

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.lora = None   # models/lora.py LoraSlots, when adapters are served
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        raise NotImplementedError

    def quantize_fp8(self) -> None:
        """Weight -> e4m3 + a float32 scale per output channel (`weight_scale` [out, 1])."""
        q, scale = quantize_rows(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale)

    @property
    def fp8_scale(self) -> torch.Tensor | None:
        """weight_scale where the weight is e4m3, else None: what the GEMV, the GEMM and
        decode_step all read."""
        return self.weight_scale if self.weight.dtype == FP8 else None

    def part_sizes(self) -> tuple[int, ...]:
        """This rank's output rows of each matrix merged into this one."""
        return (self.weight.shape[0],)

    def decode_step(self) -> LinearStep:
        """This layer's own tensors and sharding (models/decode_step.py)."""
        return LinearStep(weight=self.weight, bias=self.bias, weight_scale=self.fp8_scale,
                          parts=self.part_sizes(),
                          shard=TPShard(self.tp.rank, self.tp.size, self.shard_dim),
                          reduce=self.reduce,
                          lora=None if self.lora is None else self.lora.decode_step())

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether matmul(x) would quantize x per token (kernel_choice.fp8_rows): then the
        kernel that makes x (RMSNorm, SiLU-and-mul) hands it over as QuantizedRows, one
        launch less."""
        return kernel_choice.fp8_rows(x, self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               lora: GemvLora | None = None, quantized: QuantizedRows | None = None
               ) -> torch.Tensor:
        scale = self.fp8_scale
        if kernel_choice.paths(x).gemv:
            return gemv(x, self.weight, scale, bias, lora=lora)
        assert lora is None
        if scale is not None:
            return fp8_linear(x, self.weight, scale, bias, quantized)
        return F.linear(x, self.weight, bias)

    def project(self, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x W^T (+ bias) plus each row's adapter delta (models/lora.py): one token on the
        GEMV gets it in the GEMV's epilogue (no expand launch), others after the GEMM."""
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

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return self.project(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y[:, rank's rows] = x @ W[rank's rows].T: output features are sharded."""

    shard_dim = 0

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPGroup = TPGroup()) -> None:
        super().__init__(input_size, divide(output_size, tp.size, "output size"), bias, tp)

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
                 tp: TPGroup = TPGroup()) -> None:
        for size in output_sizes:
            divide(size, tp.size, "output size")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def part_sizes(self) -> tuple[int, ...]:
        return tuple(size // self.tp.size for size in self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is None:  # an already-merged checkpoint tensor: split and recurse
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        if shard_id not in range(len(self.output_sizes)):
            raise ValueError(f"merged linear has no part {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        dst = param.data.narrow(0, offset, size)
        shard = loaded_weight.narrow(0, self.tp.rank * size, size)
        check_shape(dst, shard, f"merged linear part {shard_id}")
        dst.copy_(shard)

    def swiglu(self, x: torch.Tensor | QuantizedRows, fp8: bool = False):
        """silu(gate) * up of this [gate, up] layer (as QuantizedRows where fp8). Where the
        GEMV takes x, with no adapter in play and fused kernels on, straight from its
        epilogue (one launch less per MLP at one token); otherwise this layer, then the
        activation."""
        lora = self.lora
        if (not fp8 and len(self.output_sizes) == 2 and not isinstance(x, QuantizedRows)
                and kernel_choice.paths(x).gated_gemv and self.bias is None
                and (lora is None or lora.ctx.rows is None)):
            return gemv(x, self.weight, self.fp8_scale, gated=True)
        return activation.swiglu(self(x), fp8=fp8)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM, sharded by attention head.

    Each rank holds its q heads, then its k heads, then its v heads; GQA groups stay
    whole because both head counts must divide by the TP size."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, tp: TPGroup = TPGroup()) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp.size, "num_key_value_heads")
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias, tp)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def part_sizes(self) -> tuple[int, ...]:
        return (self.q_size, self.kv_size, self.kv_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        q_total, kv_total = self.q_size * self.tp.size, self.kv_size * self.tp.size
        if shard_id is None:  # an already-fused qkv checkpoint tensor: split and recurse
            q, k, v = loaded_weight.split([q_total, kv_total, kv_total], dim=0)
            for sid, part in (("q", q), ("k", k), ("v", v)):
                self.weight_loader(param, part, sid)
            return
        offsets = {"q": (0, self.q_size),
                   "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        if shard_id not in offsets:
            raise ValueError(f"qkv linear has no part {shard_id!r}")
        offset, size = offsets[shard_id]
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
                 tp: TPGroup = TPGroup(), reduce: bool = True) -> None:
        super().__init__(divide(input_size, tp.size, "input size"), output_size, bias, tp)
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
