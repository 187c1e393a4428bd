"""GPTQ and AutoAWQ (GEMM) int4 / int8 checkpoints, as Hugging Face writes them.

A quantized linear layer holds the layout of kernels/quant_linear.py: `qweight` [K / P, N]
int32 packed along K, `scales` and `qzeros` [G, N] in the model dtype (qzeros: the true zero
points, unpacked), `g_idx` [K] int32. The parameters keep the checkpoint's names so the
loader routes them as it routes `weight`; each loader takes one checkpoint tensor in its
own format, cuts this rank's slice from the packed tensor along the right axis, and
converts only that slice:

  format  tensor   on disk                    column-parallel (N)   row-parallel (K)
  GPTQ    qweight  [K/P, N], packed along K   columns               packed rows (K_local/P)
  GPTQ    qzeros   [G, N/P], packed along N   packed columns        all groups
  GPTQ    scales   [G, N]                     columns               all groups
  GPTQ    g_idx    [K] (act-order permutes)   all                   this rank's rows
  AWQ     qweight  [K, N/8], packed along N   packed columns        rows
  AWQ     qzeros   [G, N/8], packed along N   packed columns        all groups
  AWQ     scales   [G, N]                     columns               all groups

A row-parallel layer keeps every group's scales and zeros and indexes them through its
slice of g_idx, so act-order (groups scattered over K) needs no special case. GPTQ packs
values in order (value j of a word at bits j*bits); AutoAWQ's GEMM layout interleaves the
8 nibbles of a word as columns (0, 2, 4, 6, 1, 3, 5, 7), so column j sits at nibble
AWQ_REVERSE_ORDER[j]. GPTQ's original format ("checkpoint_format": "gptq") stores zero - 1;
"gptq_v2" stores the zero.

Qwen3-MoE experts (`experts.{e}.gate_proj.qweight`, ...) load the same way into stacks
(models/moe.py), one expert per slice of a leading dimension.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)            # nibble i of a word holds column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)    # column j sits at nibble AWQ_REVERSE_ORDER[j]
KINDS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class WeightQuant:
    """A checkpoint's weight-only quantization (config.json's quantization_config)."""
    method: str            # "gptq" | "awq"
    bits: int              # 4 or 8 (AWQ: 4)
    group_size: int        # input rows per scale; -1: one group over all of K
    desc_act: bool         # GPTQ act-order: g_idx must come with every layer
    zero_plus_one: bool    # GPTQ's original format: zeros stored minus one

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def groups(self, in_features: int) -> int:
        """Groups of a layer with in_features input rows (all ranks)."""
        group = self.group_size if self.group_size > 0 else in_features
        if in_features % group:
            raise ValueError(f"{self.method}: {in_features} input features are not whole "
                             f"groups of {group}")
        return in_features // group


def weight_quant(config) -> WeightQuant | None:
    """The GPTQ / AWQ quantization of a config, None for others (fp8 or none); refuses, with
    the reason, what the kernels and loaders do not cover."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method not in ("gptq", "awq"):
        return None
    bits = int(q.get("bits", q.get("w_bit", 4)))
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    if group == 0 or group < -1:
        raise ValueError(f"{method}: invalid group_size {group}")
    if q.get("lm_head"):
        raise ValueError(f"{method}: a quantized lm_head is not supported")
    skipped = set(q.get("modules_to_not_convert") or ()) - {"lm_head", "gate", "mlp.gate"}
    if skipped:
        raise ValueError(f"{method}: modules_to_not_convert {sorted(skipped)} is not supported "
                         "(every attention and MLP projection is quantized here)")
    if method == "gptq":
        if bits not in (4, 8):
            raise ValueError(f"GPTQ {bits}-bit is not supported (4 and 8 are)")
        if q.get("dynamic"):
            raise ValueError("GPTQ per-module `dynamic` overrides are not supported")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return WeightQuant("gptq", bits, group, bool(q.get("desc_act", False)), fmt == "gptq")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (the GEMM layout is)")
    if bits != 4:
        raise ValueError(f"AWQ {bits}-bit is not supported (4 is)")
    if not q.get("zero_point", True):
        raise ValueError("AWQ without zero points is not supported")
    return WeightQuant("awq", 4, group, False, False)


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                   ) -> torch.Tensor:
    """[R, C] int32 words -> [R, C * P] int32 values; column j of each word at value slot
    order[j] (None: in order)."""
    per_word = 32 // bits
    slots = torch.tensor(order or range(per_word), dtype=torch.int32, device=packed.device)
    values = (packed[:, :, None] >> (slots * bits)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] ints in [0, 2^bits) -> [K / P, N] int32, value k at bits (k % P) * bits of
    word k // P (kernels/quant_linear.py's layout, GPTQ's qweight)."""
    per_word = 32 // bits
    words = torch.zeros(values.shape[0] // per_word, values.shape[1], dtype=torch.int64,
                        device=values.device)
    for i in range(per_word):
        words |= values[i::per_word].long() << (i * bits)
    return (words - ((words >> 31) << 32)).to(torch.int32)   # as two's complement int32


def trivial_g_idx(rows: range, group: int) -> torch.Tensor:
    """Each input row's group where groups are consecutive rows."""
    return torch.arange(rows.start, rows.stop, dtype=torch.int32) // group


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lands in a quantized layer on this rank."""
    column_parallel: bool   # else row-parallel (the input rows are sharded)
    rank: int
    size: int               # TP ranks
    out_offset: int         # this part's first column in the layer (local)
    out_size: int           # this part's columns on this rank
    in_local: int           # this rank's input rows


def disk_shape(quant: WeightQuant, kind: str, k: int, n: int) -> tuple[int, ...]:
    """The checkpoint shape of one projection's tensor, k input and n output features."""
    per, groups = quant.per_word, quant.groups(k)
    return {"qweight": (k // per, n) if quant.method == "gptq" else (k, n // per),
            "qzeros": (groups, n // per), "scales": (groups, n), "g_idx": (k,)}[kind]


def convert(quant: WeightQuant, kind: str, tensor: torch.Tensor, slot: Slot,
            what: str = "") -> torch.Tensor:
    """One checkpoint tensor (one part of a merged layer, full size) -> this rank's slice of
    it in the kernel's layout. `what` names the layer in errors."""
    what = what or f"{quant.method} {kind}"
    if kind in ("qweight", "qzeros") and tensor.dtype != torch.int32:
        raise ValueError(f"{what} is {tensor.dtype}, expected packed int32")
    if kind == "g_idx" and tensor.dtype.is_floating_point:
        raise ValueError(f"{what} is {tensor.dtype}, expected integers")
    k, n = ((slot.in_local, slot.out_size * slot.size) if slot.column_parallel
            else (slot.in_local * slot.size, slot.out_size))
    expected = disk_shape(quant, kind, k, n)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(tensor.shape)}, "
                         f"a {quant.method} layer of {k} inputs and {n} outputs has {expected}")
    per_word, r = quant.per_word, slot.rank
    awq = quant.method == "awq"
    col = slot.column_parallel
    if kind == "scales":
        return tensor.narrow(1, r * slot.out_size, slot.out_size) if col else tensor
    if kind == "g_idx":
        return tensor.to(torch.int32) if col else tensor.narrow(0, r * slot.in_local, slot.in_local).to(torch.int32)
    if kind == "qzeros":
        packed_cols = _whole(slot.out_size, per_word, f"{quant.method} qzeros columns")
        z = tensor.narrow(1, r * packed_cols, packed_cols) if col else tensor
        z = unpack_columns(z, quant.bits, AWQ_REVERSE_ORDER if awq else None)
        return (z + 1 if quant.zero_plus_one else z).float()
    if awq:   # qweight [K, N/8] packed along N -> [K_local / 8, N_local] packed along K
        packed_cols = _whole(slot.out_size, per_word, "AWQ qweight columns")
        w = (tensor.narrow(1, r * packed_cols, packed_cols) if col
             else tensor.narrow(0, r * slot.in_local, slot.in_local))
        return pack_rows(unpack_columns(w, 4, AWQ_REVERSE_ORDER), 4)
    rows = _whole(slot.in_local, per_word, "GPTQ qweight rows")
    return (tensor.narrow(1, r * slot.out_size, slot.out_size) if col
            else tensor.narrow(0, r * rows, rows))


def _whole(n: int, per_word: int, what: str) -> int:
    if n % per_word:
        raise ValueError(f"{what}: {n} per rank is not a whole number of {per_word}-value "
                         "words (a TP size the packing does not divide)")
    return n // per_word

