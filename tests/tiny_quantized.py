"""Tiny GPTQ and AutoAWQ (GEMM) checkpoints, quantized from a tiny random model and written
in the exact on-disk layout Hugging Face checkpoints carry, beside a float checkpoint of
the dequantized weights (what Hugging Face runs as the reference).

The packing is written here from the formats' specs, independently of the loader
(models/quantized.py):
- GPTQ (AutoGPTQ / GPTQModel, "checkpoint_format": "gptq"): qweight [K/P, N] int32, input
  row k at bits (k % P) * bits of word k // P; qzeros [G, N/P] int32 packed the same way
  along the output columns, storing zero - 1; scales [G, N] fp16; g_idx [K] int32 (act-order:
  rows quantized in a permuted order, each row's group where its turn fell).
- AutoAWQ GEMM: qweight [K, N/8] int32, nibble i of word c holding column 8c + (0, 2, 4, 6,
  1, 3, 5, 7)[i]; qzeros [G, N/8] packed the same way (the zero itself); scales [G, N] fp16;
  groups of consecutive input rows.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny_checkpoint import make_tiny_qwen3

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 bits -> int32 with the same bits."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


def pack_along_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    words = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for r in range(q.shape[0]):
        words[r // per] |= q[r].long() << ((r % per) * bits)
    return _to_int32(words)


def pack_along_columns(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                       ) -> torch.Tensor:
    per = 32 // bits
    order = order or tuple(range(per))
    words = torch.zeros(q.shape[0], q.shape[1] // per, dtype=torch.int64)
    for c in range(words.shape[1]):
        for i in range(per):
            words[:, c] |= q[:, c * per + order[i]].long() << (i * bits)
    return _to_int32(words)


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, act_order: bool, seed: int):
    """w [N, K] (a Linear's weight) -> (q [K, N] ints, scales [G, N] fp16, zeros [G, N] ints,
    g_idx [K], dequantized w [N, K] float32). Zeros stay >= 1 so that GPTQ's stored
    zero - 1 is never negative."""
    N, K = w.shape
    group = K if group == -1 else group     # GPTQ's -1: one group over all input rows
    maxq = (1 << bits) - 1
    gen = torch.Generator().manual_seed(seed)
    turn = torch.randperm(K, generator=gen) if act_order else torch.arange(K)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[turn] = (torch.arange(K) // group).to(torch.int32)
    groups = K // group
    wt = w.T.double()                                        # [K, N]
    scales = torch.empty(groups, N, dtype=torch.float16)
    zeros = torch.empty(groups, N, dtype=torch.int32)
    q = torch.empty(K, N, dtype=torch.int32)
    for g in range(groups):
        rows = (g_idx == g).nonzero().flatten()
        x = wt[rows]
        lo, hi = x.min(0).values.clamp(max=0), x.max(0).values.clamp(min=0)
        if sym:
            hi = torch.maximum(hi, -lo)
            lo = -hi
        scale = ((hi - lo) / maxq).clamp(min=1e-6).half()
        zero = (torch.full_like(hi, (maxq + 1) // 2) if sym
                else (-lo / scale.double()).round().clamp(1, maxq)).to(torch.int32)
        scales[g], zeros[g] = scale, zero
        q[rows] = ((x / scale.double()).round() + zero).clamp(0, maxq).to(torch.int32)
    deq = (q.double() - zeros[g_idx.long()].double()) * scales[g_idx.long()].double()
    return q, scales, zeros, g_idx, deq.T.float().contiguous()


def make_quantized(path: Path, fmt: str, bits: int = 4, group: int = 32, sym: bool = True,
                   act_order: bool = False, gptq_v2: bool = False, **model_kw) -> tuple[Path, Path]:
    """Write `path`/quant (a GPTQ or AWQ checkpoint of a tiny random model) and
    `path`/deq (float32, the same model with the dequantized weights): (quant, deq).
    gptq_v2: GPTQ zeros stored as they are ("checkpoint_format": "gptq_v2")."""
    base = make_tiny_qwen3(path / "base", **model_kw)
    quant_dir, deq_dir = path / "quant", path / "deq"
    for d in (quant_dir, deq_dir):
        shutil.copytree(base, d)
    state = load_file(str(base / "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stacked = state.pop(name)        # transformers 5 keeps experts stacked; Qwen's
        prefix = name.rsplit(".", 1)[0]  # quantized checkpoints have one tensor each
        for e, w in enumerate(stacked):
            if name.endswith("gate_up_proj"):
                gate, up = w.chunk(2)
                state[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                state[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:
                state[f"{prefix}.{e}.down_proj.weight"] = w.contiguous()
    quant_state, deq_state = {}, {}
    for name, w in sorted(state.items()):
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS):
            quant_state[name] = deq_state[name] = w
            continue
        # act-order permutes by the input's statistics: projections of one input share it
        shared_input = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace(
            "up_proj", "gate_proj")
        q, scales, zeros, g_idx, deq = quantize(w, bits, group, sym, act_order,
                                                seed=sorted(state).index(shared_input + ".weight"))
        deq_state[name] = deq
        if fmt == "gptq":
            quant_state[f"{module}.qweight"] = pack_along_rows(q, bits)
            quant_state[f"{module}.qzeros"] = pack_along_columns(zeros - (0 if gptq_v2 else 1), bits)
            quant_state[f"{module}.scales"] = scales
            quant_state[f"{module}.g_idx"] = g_idx
        else:
            quant_state[f"{module}.qweight"] = pack_along_columns(q, 4, AWQ_PACK_ORDER)
            quant_state[f"{module}.qzeros"] = pack_along_columns(zeros, 4, AWQ_PACK_ORDER)
            quant_state[f"{module}.scales"] = scales
    save_file(quant_state, str(quant_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(deq_state, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
         "sym": sym, "checkpoint_format": "gptq_v2" if gptq_v2 else "gptq",
         "true_sequential": True}
        if fmt == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm", "modules_to_not_convert": None})
    (quant_dir / "config.json").write_text(json.dumps(config, indent=2))
    return quant_dir, deq_dir
