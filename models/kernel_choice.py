"""Which kernel each kind of op runs for a given input, decided in one place.

The layers (linear.py, embedding.py, layernorm.py, rotary.py, activation.py, moe.py,
qwen3.py) ask `paths(x)` here instead of each testing the device and the knobs in its
`forward`, so the per-op path, CUDA graphs and a future persistent decode kernel (issue
63) read the same rules. `decide` is the rule itself, a pure function of explicit facts
(device kind, token rows, knobs): testable without a GPU.

Knobs, read at call time so tests and tests/gpu/profile_decode.py can flip them:
- FUSED (NANOSERVE_FUSED_KERNELS=0 turns it off, for before/after comparisons): the fused
  Triton kernels (q/k norm + rotary + KV store, SiLU-and-mul, the GEMV's SwiGLU epilogue,
  norms that hand FP8 GEMMs quantized rows); FUSED_ON_CPU: a CPU test runs them in the
  Triton interpreter.
- kernels/gemv.py's GEMV_MAX_TOKENS (NANOSERVE_GEMV_MAX_TOKENS) and ON_CPU: up to that many
  token rows the linear layers take the GEMV (kept beside the kernel,
  whose tuning they are).
- SMALL_M_MAX_ROWS (NANOSERVE_SMALL_M_MAX_ROWS; 0 turns it off): from 2 rows (past the
  GEMV) up to this many, bf16 / fp16 linear layers take kernels/small_m.py's kernel instead
  of cuBLAS, which like the GEMV takes the norm before it and the SwiGLU after it: a small
  batch's decode step then has the batch-1 step's five kernels a layer (0.6B batch 8: 258 ->
  146), all launched with PDL (kernels/pdl.py). On an H200 through the launcher, batch 8: 1.355
  -> 1.318 ms a step (1.384 without PDL; tests/gpu/RESULTS.md, the small-batch step).
- NORM_IN_GEMV (NANOSERVE_NORM_IN_GEMV=0 turns it off): at one token row the decoder
  layer's norms run in the prologue of the GEMV they feed (kernels/gemv.GemvNorm) instead
  of a launch of their own: the 0.6B's batch-1 graph 229 -> 173 kernels, 0.91 -> 0.83 ms
  on an H200, logits bit for bit the same (tests/gpu/RESULTS.md, the small-batch step); the
  small-M kernel's rows likewise.
- NORM_ROTARY_IN_ATTENTION_ROWS (NANOSERVE_NORM_ROTARY_IN_ATTENTION_ROWS; 0 turns it off):
  decode steps of at least this many rows leave the q/k norm, rotary and K/V store to the
  Triton decode attention kernel's prologue (kernels/paged_attention.py; bf16 / fp16
  caches; models/attention.Attention.takes_norm_rotary) instead of a launch of their own.
  On an H200 (0.6B, through the launcher, the knob alone) 8 rows gain (step 1.378 ->
  1.357 ms; graph replay 1.58 -> 1.52), one row loses (0.841 -> 0.923): there the
  prologue lengthens the attention's latency-bound chain more than the launch it saves.
- DETERMINISTIC (the worker's --deterministic, issue 68; set once at load by
  worker_service/loading.py): a row's result must not depend on the rows beside it, so
  every linear layer and the LM head take kernels/batch_invariant.py's GEMM (K in order,
  never split: its tiles may follow the row count, every tile giving the same bits) for
  every row count (no GEMV for one row and GEMM for more: two reduction orders), and
  nothing hands an FP8 GEMM pre-quantized rows. Norms, rotary, SiLU, the q/k norm and
  MoE routing reduce each row alone already (a program per row, or per-row torch ops).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

import kernels.gemv
from kernels.fp8_linear import FP8, ONE_BLOCK_MAX, scaled_mm_supported

FUSED = os.environ.get("NANOSERVE_FUSED_KERNELS", "1") != "0"
FUSED_ON_CPU = False   # tests set it to run the fused kernels in the Triton interpreter
DETERMINISTIC = False  # batch-invariant kernels (--deterministic): see above
NORM_IN_GEMV = os.environ.get("NANOSERVE_NORM_IN_GEMV", "1") != "0"
SMALL_M_MAX_ROWS = int(os.environ.get("NANOSERVE_SMALL_M_MAX_ROWS", "8"))
NORM_ROTARY_IN_ATTENTION_ROWS = int(os.environ.get("NANOSERVE_NORM_ROTARY_IN_ATTENTION_ROWS", "8"))


@dataclass(frozen=True)
class Paths:
    """The kernels one input takes, by kind of op."""
    gemv: bool         # linear layers: kernels/gemv.py (a few rows), else a GEMM
    fused: bool        # the fused Triton kernels (see FUSED), else one kernel per op
    gated_linear: bool   # gate_up's GEMV (or small-M kernel) may apply SiLU-and-mul in its
                       # epilogue (where the layer has no bias, no adapter rows, two parts,
                       # no FP8 activation)
    triton: bool       # RMSNorm, rotary, MoE routing and experts: Triton, else torch refs
    invariant: bool = False   # linear layers, LM head: kernels/batch_invariant.py (DETERMINISTIC)
    normed_linear: bool = False   # the norm before a GEMV (or small-M kernel) in its prologue
    small_m: bool = False   # bf16 / fp16 linear layers: kernels/small_m.py (2..SMALL_M_MAX_ROWS)


@functools.lru_cache(maxsize=1024)
def decide(on_cuda: bool, rows: int, fused_kernels: bool, fused_on_cpu: bool,
           gemv_max_tokens: int, gemv_on_cpu: bool, deterministic: bool = False,
           norm_in_gemv: bool = False, small_m_max_rows: int = 0) -> Paths:
    """The rule: the GEMV up to gemv_max_tokens rows (on CUDA, or in the interpreter), fused
    kernels where enabled. The gated GEMV needs the GEMV and FUSED alone (not the device:
    a GEMV on CPU already runs in the interpreter); the small-M kernel past the GEMV's rows
    up to small_m_max_rows, with fused kernels on (gemv_on_cpu: in the interpreter too).
    deterministic: the batch-invariant GEMM at every row count, never the GEMV. Cached:
    every layer of every eager step asks (a lookup ~1 us, building the answer ~3)."""
    gemv = (on_cuda or gemv_on_cpu) and rows <= gemv_max_tokens and not deterministic
    small_m = ((on_cuda or gemv_on_cpu) and not gemv and 2 <= rows <= small_m_max_rows
               and fused_kernels and not deterministic)
    return Paths(gemv=gemv, fused=(on_cuda or fused_on_cpu) and fused_kernels,
                 gated_linear=(gemv or small_m) and fused_kernels, triton=on_cuda,
                 invariant=deterministic,
                 normed_linear=((gemv and rows == 1) or small_m) and fused_kernels
                 and norm_in_gemv, small_m=small_m)


def paths(x: torch.Tensor) -> Paths:
    """decide() for x [..., features] (its token rows) with the knobs as they are now."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    return decide(x.is_cuda, rows, FUSED, FUSED_ON_CPU, kernels.gemv.GEMV_MAX_TOKENS,
                  kernels.gemv.ON_CPU, DETERMINISTIC, NORM_IN_GEMV, SMALL_M_MAX_ROWS)


def fp8_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a GEMM of `weight` quantizes x per token (an e4m3 weight of rows up to
    ONE_BLOCK_MAX, not the GEMV, fused kernels on, _scaled_mm on x's device): then the
    kernel that makes x (RMSNorm, SiLU-and-mul) hands it over as QuantizedRows."""
    if weight.dtype != FP8 or weight.shape[1] > ONE_BLOCK_MAX:
        return False
    p = paths(x)
    return not p.gemv and not p.invariant and p.fused and scaled_mm_supported(x.device)


def lora_in_gemv(p: Paths, adapter_kernels: bool) -> bool:
    """Whether an adapted layer's delta rides in the GEMV's epilogue (LoraSlots.shrink)
    rather than a shrink + expand after the matmul."""
    return p.gemv and adapter_kernels
