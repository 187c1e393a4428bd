"""What a worker loads once at start: the device, the attention backend, the model and its
draft (a proposer), LoRA slots and the grammar tokenizer, each timed as a start-up phase.
The runner (model_runner.py) then owns them; nothing here runs per step."""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import torch

from kernels.attention import select_backend
from kernels.backend_choice import AttentionShapes
from models import kernel_choice
from models.loader import config_dtype, load_config, load_model
from models.parallel import TPGroup
from models.qwen3 import _head_dim
from nanoserve.grammar_tokenizer import load_tokenizer
from worker_service.adapters import AdapterStore
from worker_service.cuda_graphs import token_buckets
from worker_service.phases import phase
from worker_service.proposer import Proposer, load_proposer

log = logging.getLogger("nanoserve.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Loaded:
    device: torch.device
    backend: object                 # kernels.attention backend
    model: torch.nn.Module
    hf_config: object
    dtype: torch.dtype
    drafter: Proposer | None
    adapters: AdapterStore | None
    fingerprint: str                # config.json's hash (WorkerInfo: ranks must agree)
    eos_token_id: int
    grammar_tokenizer: object | None   # llguidance's, on the sampling rank


def open_device(name: str, phases: dict[str, float]) -> torch.device:
    """The runner's device, made current (CUDA: driver + context, seconds, timed apart)."""
    device = torch.device(name)
    if device.type == "cuda":
        with phase(phases, "cuda context"):
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            torch.empty(1, device=device)
    return device


def set_deterministic(on: bool, tp: TPGroup, small_batch_kernel: str = "off") -> None:
    """--deterministic (issue 68): every kernel computes a row's result in an order that no
    other row, batch size, graph bucket, chunk boundary or prefix-cache hit changes. The
    rules live with the choices they change: models/kernel_choice.py (the GEMMs), the
    attention backend (kernels/attention.py: select_backend's deterministic), the sampler
    (sampler.py: a row's sampling path follows its own parameters, mode or not). A
    process serves one mode. Refused where the order is not ours: TP > 1 (the
    all-reduce's algorithm, hence its order, follows the message size, i.e. the batch) and
    the persistent small-batch kernel (its own GEMV order)."""
    if on and tp.size > 1:
        raise ValueError("--deterministic covers one rank (TP=1): the all-reduce's order "
                         "follows the batch's size")
    if on and small_batch_kernel != "off":
        raise ValueError("--deterministic and --small-batch-kernel exclude each other: the "
                         "persistent kernel reduces a row in its own order")
    kernel_choice.DETERMINISTIC = on


def prefill_graphs_wanted(config) -> bool:
    """Whether the runner means to capture prefill CUDA graphs (model_runner: graphs on and
    a bucket at all; an EAGLE-3 head, found later, still turns them off)."""
    return (not config.enforce_eager
            and bool(token_buckets(min(config.max_prefill_graph_tokens,
                                       config.max_num_batched_tokens))))


def load(config, tp: TPGroup, kv_fp8: bool, phases: dict[str, float]) -> Loaded:
    """Everything of RunnerConfig `config` a rank loads before its profile run."""
    set_deterministic(config.deterministic, tp, config.small_batch_kernel)
    device = open_device(config.device, phases)
    dtype = None if config.dtype == "auto" else DTYPES[config.dtype]
    # auto times flash_attn (when its build covers the model) and triton on this
    # rank's attention shapes and keeps the faster (kernels/backend_choice.py), unless the
    # prefill CUDA graphs will be captured: they need triton.
    with phase(phases, "config"):
        hf = load_config(config.model_dir, config.hf_overrides)
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    shapes = AttentionShapes(num_heads=hf.num_attention_heads // tp.size,
                             num_kv_heads=max(1, kv_heads // tp.size),
                             head_dim=_head_dim(hf), dtype=dtype or config_dtype(hf))
    with phase(phases, "attention backend"):
        backend = select_backend(config.attention_backend, device, shapes=shapes, kv_fp8=kv_fp8,
                                 deterministic=config.deterministic,
                                 prefill_graphs=prefill_graphs_wanted(config))
    log.info("attention backend: %s", backend.name)
    model, hf_config = load_model(config.model_dir, tp=tp, dtype=dtype, device=device,
                                  attn_backend=backend, quantization=config.quantization,
                                  phases=phases, hf_overrides=config.hf_overrides)
    dtype = next(model.parameters()).dtype
    drafter = None
    if config.draft_model:
        with phase(phases, "draft weights"):
            drafter = load_proposer(config.draft_model, model, config.model_dir, tp, dtype,
                                    device, backend, config.quantization, config.draft_sampling)
    # LoRA slots before the profile run, so the KV budget leaves them their room
    adapters = (AdapterStore(model, config.max_loras, config.max_lora_rank)
                if config.max_loras else None)
    with open(os.path.join(config.model_dir, "config.json"), "rb") as f:
        fingerprint = hashlib.sha256(f.read()).hexdigest()[:16]
    eos = hf_config.eos_token_id
    eos_token_id = (eos[0] if isinstance(eos, list) else eos) or 0
    # llguidance's tokenizer (~0.5 s to build for a 150k vocabulary): once, at start.
    with phase(phases, "grammar tokenizer"):
        grammar_tokenizer = (load_tokenizer(config.model_dir, hf_config.vocab_size, eos_token_id)
                             if tp.rank == 0 else None)
    return Loaded(device, backend, model, hf_config, dtype, drafter, adapters, fingerprint,
                  eos_token_id, grammar_tokenizer)
