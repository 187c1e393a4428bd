"""Build a Qwen3 model from a Hugging Face checkpoint directory and load this rank's shards.

Every checkpoint tensor must land in a parameter, and every parameter (every part of a
merged one) must be filled: a silent partial load produces a model that runs and emits
garbage, the worst failure to debug from a server.

FP8: checkpoints published in block-scaled e4m3 (`quantization_config.quant_method` "fp8",
`weight_block_size`, a `weight_scale_inv` beside each quantized weight, as Qwen's) are
dequantized tensor by tensor as they load; with quantization "fp8" (such a checkpoint's
default, or `--quantization fp8` on a bf16 one) every linear layer is then requantized per
output channel (kernels/fp8_linear.py), and MoE experts per output row, weight-only
(models/moe.py). Embeddings, the LM head and norms stay in the model's dtype.

GPTQ / AWQ: checkpoints with `quant_method` "gptq" (int4 / int8) or "awq" (GEMM int4) build
their attention and MLP projections packed (models/quantized.py), each rank cutting its
slice of the packed tensors as they load; what those layers do not cover is refused there.
Their MoE experts stay packed too (models/moe.py), run by the fused MoE kernel.
"""
from __future__ import annotations

import glob
import os
import time

import torch
from safetensors import safe_open
from torch import nn

from kernels.fp8_linear import FP8, dequantize_blocks
from models.checkpoint_reader import read_tensors
from models.config import ModelConfig, load_config
from models.linear import LinearBase
from models.moe import MoEExperts
from models.parallel import TPGroup
from models.quantized import KINDS, weight_quant
from models.qwen3 import Qwen3ForCausalLM

QUANTIZATIONS = ("auto", "none", "fp8")   # auto: what the checkpoint is (fp8 or none)


def config_dtype(config) -> torch.dtype:
    """The checkpoint's dtype: `dtype` (transformers 5) or `torch_dtype` (4.x); float32 if unset."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unsupported checkpoint dtype {dtype!r}")
    return dtype


_EXPERT_PARTS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def _destination(name: str, mapping: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id) via the model's packed_modules_mapping;
    one expert's `...experts.{e}.gate_proj.weight` -> (`...experts.gate_up_proj`,
    (e, "gate")) (models/moe.py stacks the experts), its GPTQ / AWQ `...gate_proj.qweight`
    -> (`...experts.gate_up_qweight`, (e, "gate"))."""
    parts = name.split(".")
    if (len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit()
            and parts[-2] in _EXPERT_PARTS and parts[-1] in ("weight", *KINDS)):
        stack = _EXPERT_PARTS[parts[-2]]
        if parts[-1] != "weight":
            stack = stack.removesuffix("_proj") + "_" + parts[-1]
        return (".".join(parts[:-3] + [stack]), (int(parts[-3]), parts[-2].removesuffix("_proj")))
    if len(parts) >= 2 and parts[-2] in mapping:
        target, shard_id = mapping[parts[-2]]
        return ".".join(parts[:-2] + [target, parts[-1]]), shard_id
    return name, None


def _expected_shards(param: nn.Parameter, param_name: str,
                     mapping: dict[str, tuple[str, object]]) -> set:
    """Which shard ids must be loaded into a parameter before it is complete."""
    if hasattr(param, "expected_shards"):
        return param.expected_shards
    parts = param_name.split(".")
    shards = {sid for target, sid in mapping.values() if len(parts) >= 2 and parts[-2] == target}
    return shards or {None}


def fp8_blocks(config) -> tuple[int, int] | None:
    """The block shape of a block-scaled FP8 checkpoint (None for an unquantized one)."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") in ("gptq", "awq"):   # int weights: models/quantized.py
        return None
    if q.get("quant_method") != "fp8":
        raise ValueError(f"unsupported quantization_config {q.get('quant_method')!r} "
                         "(supported: fp8 with weight_block_size, gptq, awq)")
    block = q.get("weight_block_size")
    if not block or q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("only block-scaled FP8 checkpoints with dynamic activation scales "
                         f"are supported, got {q}")
    return int(block[0]), int(block[1])


def load_weights(model: nn.Module, model_dir: str, blocks: tuple[int, int] | None = None
                 ) -> float:
    """Copy every *.safetensors tensor in model_dir into model via each param's weight_loader
    (blocks: a block-scaled FP8 checkpoint's block shape: its weights are dequantized). The
    tensors arrive on the model's device (models/checkpoint_reader.py), where the loaders
    cut out this rank's shards. Returns the seconds spent waiting for the reads."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    scales: dict[str, str] = {}   # FP8 checkpoints: weight name -> the file of its scale
    if blocks is not None:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                scales.update({n.removesuffix("_scale_inv"): path for n in f.keys()
                               if n.endswith(".weight_scale_inv")})
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {name: set() for name in params}
    unexpected: list[str] = []
    device = next(model.parameters()).device
    waited = 0.0
    for path in files:
        tensors = read_tensors(path, device)
        while True:
            t = time.perf_counter()
            name, tensor = next(tensors, (None, None))
            waited += time.perf_counter() - t
            if name is None:
                break
            if ((tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")
                    or name.endswith(".weight_scale_inv")):
                continue
            param_name, shard_id = _destination(name, mapping)
            param = params.get(param_name)
            if param is None:
                unexpected.append(name)
                continue
            weight_loader = param.weight_loader
            if tensor.dtype == FP8:
                if name not in scales:
                    raise ValueError(f"{name} is FP8 but has no weight_scale_inv "
                                     "(or the config has no quantization_config)")
                with safe_open(scales[name], framework="pt", device="cpu") as g:
                    scale = g.get_tensor(name + "_scale_inv").to(device)
                tensor = dequantize_blocks(tensor, scale, blocks, param.dtype)
            if shard_id is None:
                weight_loader(param, tensor)
                loaded[param_name] |= getattr(param, "expected_shards", {None})
            else:
                weight_loader(param, tensor, shard_id)
                loaded[param_name].add(shard_id)
    missing = [f"{name}[{sid}]" if sid is not None else name
               for name, param in params.items()
               for sid in sorted(_expected_shards(param, name, mapping) - loaded[name], key=str)]
    if unexpected or missing:
        raise ValueError(f"checkpoint {model_dir} does not match the model: "
                         f"tensors with no destination: {unexpected or 'none'}; "
                         f"parameters never loaded: {missing or 'none'}")
    return waited


def load_model(model_dir: str, tp: TPGroup = TPGroup(), dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", attn_backend=None, quantization: str = "auto",
               phases: dict[str, float] | None = None, hf_overrides: dict | None = None
               ) -> tuple[Qwen3ForCausalLM, ModelConfig]:
    """Build the model directly on `device` in `dtype` (default: the checkpoint's) and load
    this TP rank's shards; quantization (QUANTIZATIONS): FP8 linear layers or not;
    hf_overrides: config.json fields replaced before the model is built. Returns
    (model in eval mode, config). `phases` gets the seconds of each part (the worker's
    start-up line): model build, weights (copies), waiting for reads, fp8 quantize."""
    phases = {} if phases is None else phases
    t = time.perf_counter()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}: expected one of {QUANTIZATIONS}")
    config = load_config(model_dir, hf_overrides)
    blocks = fp8_blocks(config)
    quant = weight_quant(config)
    if quant is not None and quantization not in ("auto", quant.method):
        raise ValueError(f"{model_dir} is a {quant.method} int{quant.bits} checkpoint: it runs "
                         f"as such (--quantization auto), not {quantization}")
    dtype = dtype or config_dtype(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config, tp=tp, attn_backend=attn_backend)
    finally:
        torch.set_default_dtype(previous)
    phases["model build"] = time.perf_counter() - t
    t = time.perf_counter()
    waited = load_weights(model, model_dir, blocks)
    _sync(device)
    phases["weights"] = time.perf_counter() - t - waited
    phases["checkpoint reads waited"] = waited
    if quantization == "fp8" or (quantization == "auto" and blocks is not None):
        t = time.perf_counter()
        for module in model.modules():
            if isinstance(module, (LinearBase, MoEExperts)):
                module.quantize_fp8()
        _sync(device)
        phases["fp8 quantize"] = time.perf_counter() - t
    return model.eval(), config


def _sync(device: torch.device | str) -> None:
    """Queued device work done: the time lands in the phase that queued it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
