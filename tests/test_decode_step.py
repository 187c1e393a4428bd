"""Modules that describe their decode step (models/decode_step.py) and the one place that
picks kernels (models/kernel_choice.py), on CPU.

- A tiny random model's description lists every op in execution order (checked against
  forward hooks), each under the module that runs it, and its tensors ARE that module's
  parameters, buffers and KV views (same objects, same storage): no weight is copied, and
  every one is covered.
- One decode step re-implemented in torch from the description alone (plus the step's
  positions and block tables) gives the model's logits: the description is complete.
- The kernel-choice rule, with explicit facts (a CUDA-like input without a GPU) and with
  the knobs read live.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels.gemv
from kernels.fp8_linear import FP8, ONE_BLOCK_MAX
from models import kernel_choice
from models.decode_step import (AttentionBlockStep, AttentionStep, DecoderLayerStep, LinearStep,
                                MLPStep, MoEStep, ModelStep, NormStep, QuantWeightStep,
                                RotaryStep)
from models.kernel_choice import Paths, decide
from models.loader import load_model
from paged_kv import PagedKV
from test_qwen3_vs_hf import assert_close, random_prompts, run_step
from tiny_checkpoint import tiny_qwen3_dir

SHAPES = {
    "qwen3": dict(seed=3),
    "qwen2-bias-tied": dict(qwen2=True, num_heads=4, num_kv_heads=2, head_dim=16,
                            tie_word_embeddings=True, seed=5),
    "moe": dict(num_layers=3, seed=7, moe=dict(num_experts=5, num_experts_per_tok=2,
                                                norm_topk_prob=True, moe_intermediate_size=32,
                                                mlp_only_layers=[1])),
    # GPTQ int4 act-order (packed projections) and AWQ MoE (packed experts): tiny_quantized
    "gptq4": dict(quant=dict(fmt="gptq", bits=4, group=32, sym=False, act_order=True)),
    "awq-moe": dict(quant=dict(fmt="awq", group=64), num_layers=3, seed=7, moe=dict(
        num_experts=3, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=64,
        mlp_only_layers=[1])),
}


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def model_dir(request, tmp_path_factory):
    kw = dict(SHAPES[request.param])
    if "quant" in kw:
        from tiny_quantized import make_quantized
        return make_quantized(tmp_path_factory.mktemp(request.param), **kw.pop("quant"),
                              hidden_size=128, num_heads=8, head_dim=16,
                              intermediate_size=256, **kw)[0]
    return tiny_qwen3_dir(tmp_path_factory, **kw)


def tensors(step) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a leaf description holds (nested descriptions included)."""
    out = []
    for f in dataclasses.fields(step):
        value = getattr(step, f.name)
        if isinstance(value, torch.Tensor):
            out.append((f.name, value))
        elif dataclasses.is_dataclass(value):
            out += [(f"{f.name}.{n}", t) for n, t in tensors(value)]
        elif isinstance(value, tuple):      # packed experts: (gate_up's, down's)
            out += [(f"{f.name}.{i}.{n}", t) for i, v in enumerate(value)
                    if dataclasses.is_dataclass(v) for n, t in tensors(v)]
    return out


def owned(module) -> list[torch.Tensor]:
    """A module's own tensors: parameters, buffers, KV views, adapter slots."""
    found = [*module.parameters(), *module.buffers()]
    found += [t for a in ("k_cache", "v_cache", "k_scale", "v_scale")
              if isinstance(t := getattr(module, a, None), torch.Tensor)]
    lora = getattr(module, "lora", None)
    return found + ([lora.a, lora.b, lora.scale] if lora is not None else [])


def test_description_lists_every_op_in_order_by_reference(model_dir):
    model, config = load_model(str(model_dir))
    prompts = random_prompts(config.vocab_size, [5, 9], seed=1)
    cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
    step = model.decode_step()
    assert isinstance(step, ModelStep) and len(step.layers) == config.num_hidden_layers
    assert [layer.index for layer in step.layers] == list(range(config.num_hidden_layers))
    ops = step.ops()
    names = [name for name, _ in ops]
    assert len(set(names)) == len(names)

    # execution order: the modules forward calls, in the order it calls them
    called = []
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, args, n=n: called.append(n)) for n in names]
    run_step(model, cache, prompts, [(i, 0, len(p)) for i, p in enumerate(prompts)])
    for h in hooks:
        h.remove()
    assert called == [n for n in names if n in called]
    assert set(names) - set(called) <= {n for n in names if n.endswith(".experts")}

    # by reference: each tensor is its module's own; every parameter and buffer is covered
    seen = set()
    for name, leaf in ops:
        mine = owned(model.get_submodule(name))
        for field, t in tensors(leaf):
            assert any(t is o for o in mine), f"{name}.{field} is not the module's tensor"
            assert any(t.data_ptr() == o.data_ptr() for o in mine)
            seen.add(id(t))
    for pname, p in [*model.named_parameters(), *model.named_buffers()]:
        assert id(p) in seen, f"{pname} missing from the description"
    for layer, attn in zip(step.layers, (l.self_attn.attn for l in model.model.layers)):
        assert layer.attn.attn.k_cache is attn.k_cache and layer.attn.attn.block_size == 4


def test_description_of_a_dense_qwen3_in_order():
    """The leaf ops of a dense Qwen3 layer, in the order a task list runs them."""
    import transformers

    from models.qwen3 import Qwen3ForCausalLM
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=32)
    model = Qwen3ForCausalLM(cfg)
    attn = model.model.layers[0].self_attn.attn
    attn.k_cache = attn.v_cache = torch.zeros(2, 4, 1, 16)
    ops = model.decode_step().ops()
    layer = [("input_layernorm", NormStep), ("self_attn.qkv_proj", LinearStep),
             ("self_attn.q_norm", NormStep), ("self_attn.k_norm", NormStep),
             ("self_attn.rotary_emb", RotaryStep), ("self_attn.attn", AttentionStep),
             ("self_attn.o_proj", LinearStep), ("post_attention_layernorm", NormStep),
             ("mlp.gate_up_proj", LinearStep), ("mlp.down_proj", LinearStep)]
    assert [(n, type(s)) for n, s in ops[1:-2]] == [(f"model.layers.0.{n}", k) for n, k in layer]
    assert [n for n, _ in ops[:1] + ops[-2:]] == ["model.embed_tokens", "model.norm", "lm_head"]


def test_fp8_and_adapter_tensors_are_described_by_reference(tmp_path_factory):
    """FP8 weights bring their per-row scales; served adapters their slots."""
    from models.lora import attach
    model, _ = load_model(str(tiny_qwen3_dir(tmp_path_factory, seed=3)), quantization="fp8")
    attach(model, num_slots=2, max_rank=4)
    PagedKV(model, [4], block_size=4)
    layer, mod = model.decode_step().layers[0], model.model.layers[0]
    qkv = layer.attn.qkv
    assert qkv.weight.dtype == FP8 and qkv.weight_scale is mod.self_attn.qkv_proj.weight_scale
    assert qkv.parts == (mod.self_attn.qkv_proj.q_size, *(2 * [mod.self_attn.qkv_proj.kv_size]))
    assert qkv.lora.a is mod.self_attn.qkv_proj.lora.a and qkv.lora.max_rank == 4
    assert layer.mlp.gate_up.parts == (mod.mlp.gate_up_proj.weight.shape[0] // 2,) * 2
    assert layer.mlp.down.shard.dim == 1 and not layer.mlp.down.reduce
    assert layer.attn.qkv.shard.dim == 0 and layer.attn.o_proj.lora.b is mod.self_attn.o_proj.lora.b


# --- one decode step from the description alone -------------------------------------

def rms(x: torch.Tensor, n: NormStep) -> torch.Tensor:
    xf = x.float()
    return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + n.eps)).to(x.dtype)
            * n.weight).to(x.dtype)


def dequantized(q: QuantWeightStep) -> torch.Tensor:
    """[out, in] W of a GPTQ / AWQ description (the layout's formula, written out)."""
    shifts = torch.arange(0, 32, q.bits, dtype=torch.int32)
    ints = ((q.qweight[:, None, :] >> shifts[None, :, None]) & ((1 << q.bits) - 1))
    ints = ints.reshape(-1, q.qweight.shape[-1]).float()
    g = q.g_idx.long()
    return ((ints - q.zeros.float()[g]) * q.scales.float()[g]).T.to(q.scales.dtype)


def linear(x: torch.Tensor, s: LinearStep) -> torch.Tensor:
    assert s.shard.size == 1 and s.weight_scale is None and s.lora is None
    return F.linear(x, dequantized(s.quant) if s.quant is not None else s.weight, s.bias)


def rotate(x: torch.Tensor, positions: torch.Tensor, r: RotaryStep) -> torch.Tensor:
    cos, sin = r.cos_sin_cache[positions].chunk(2, dim=-1)        # [T, D / 2] each
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attend(q, k, v, a: AttentionStep, slots, tables, context_lens) -> torch.Tensor:
    """One new token per sequence: store its k/v in its slot, attend over its blocks (the
    caches are [blocks, block_size, heads, D] views of any strides: index, never view)."""
    bs, group = a.block_size, a.num_heads // a.num_kv_heads
    a.k_cache[slots // bs, slots % bs] = k
    a.v_cache[slots // bs, slots % bs] = v
    out = []
    for b, n in enumerate(context_lens):
        where = torch.tensor([tables[b][p // bs] * bs + p % bs for p in range(n)])
        keys = a.k_cache[where // bs, where % bs].repeat_interleave(group, dim=1).float()
        values = a.v_cache[where // bs, where % bs].repeat_interleave(group, dim=1).float()
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), keys) * a.scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", probs, values).to(q.dtype))
    return torch.stack(out)


def attention_block(x, positions, s: AttentionBlockStep, kv) -> torch.Tensor:
    a = s.attn
    q, k, v = linear(x, s.qkv).split(s.qkv.parts, dim=-1)
    q = q.view(-1, a.num_heads, a.head_dim)
    k = k.view(-1, a.num_kv_heads, a.head_dim)
    v = v.view(-1, a.num_kv_heads, a.head_dim)
    if s.q_norm is not None:
        q, k = rms(q, s.q_norm), rms(k, s.k_norm)
    q, k = rotate(q, positions, s.rotary), rotate(k, positions, s.rotary)
    return linear(attend(q, k, v, a, *kv).reshape(x.shape[0], -1), s.o_proj)


def mlp(x: torch.Tensor, s: MLPStep | MoEStep) -> torch.Tensor:
    if isinstance(s, MLPStep):
        gate, up = linear(x, s.gate_up).split(s.gate_up.parts, dim=-1)
        return linear(F.silu(gate) * up, s.down)
    probs = torch.softmax(linear(x, s.router), dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(s.top_k, dim=-1)
    if s.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    q = s.experts.quant
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].to(x.dtype), ids[t].tolist()):
            gate_up, down = (s.experts.gate_up[e], s.experts.down[e]) if q is None else (
                dequantized(QuantWeightStep(*(getattr(p, f)[e] for f in
                                              ("qweight", "scales", "zeros", "g_idx")),
                                            p.bits, p.group_size)) for p in q)
            gate, up = (gate_up @ x[t]).chunk(2)
            out[t] += w * (down @ (F.silu(gate) * up))
    return out


def decode_from_description(step: ModelStep, ids, positions, kv) -> torch.Tensor:
    """Logits of one decode step (a token per sequence), from `step` alone."""
    hidden, residual = F.embedding(ids, step.embed.weight), None
    for layer in step.layers:
        assert isinstance(layer, DecoderLayerStep)
        residual = hidden if residual is None else hidden + residual
        hidden = attention_block(rms(residual, layer.input_norm), positions, layer.attn, kv)
        residual = hidden + residual
        hidden = mlp(rms(residual, layer.post_attention_norm), layer.mlp)
    hidden = rms(hidden + residual, step.norm)
    return F.linear(hidden, step.lm_head.weight)[:, :step.lm_head.num_embeddings]


def test_a_decode_step_from_the_description_alone_gives_the_models_logits(model_dir):
    model, config = load_model(str(model_dir))
    prompts = random_prompts(config.vocab_size, [6, 11, 3], seed=2)
    cache = PagedKV(model, [len(p) for p in prompts], block_size=4, seed=1)
    run_step(model, cache, prompts, [(i, 0, len(p) - 1) for i, p in enumerate(prompts)])
    kv_after_prefill = cache.kv.clone()
    chunks = [(i, len(p) - 1, len(p)) for i, p in enumerate(prompts)]
    positions, meta = cache.metadata(chunks, is_decode=True)
    ids = torch.stack([p[-1] for p in prompts])
    kv = (meta.slot_mapping.long(), cache.tables, [len(p) for p in prompts])
    with torch.inference_mode():
        ours = decode_from_description(model.decode_step(), ids, positions, kv)
    described_kv = cache.kv.clone()
    cache.kv.copy_(kv_after_prefill)
    ref = torch.cat(run_step(model, cache, prompts, chunks, is_decode=True))
    assert_close(ours, ref, "decode from the description")
    torch.testing.assert_close(described_kv, cache.kv, equal_nan=True, rtol=1e-5, atol=1e-5)


# --- kernel choice ---------------------------------------------------------------------

KNOBS = dict(fused_kernels=True, fused_on_cpu=False, gemv_max_tokens=1, gemv_on_cpu=False)


@pytest.mark.parametrize("on_cuda,rows,knobs,want", [
    (True, 1, {}, Paths(gemv=True, fused=True, gated_linear=True, triton=True)),
    (True, 2, {}, Paths(gemv=False, fused=True, gated_linear=False, triton=True)),
    (True, 1, dict(fused_kernels=False), Paths(gemv=True, fused=False, gated_linear=False,
                                              triton=True)),
    (True, 1, dict(gemv_max_tokens=0), Paths(gemv=False, fused=True, gated_linear=False,
                                             triton=True)),
    (True, 4, dict(gemv_max_tokens=4), Paths(gemv=True, fused=True, gated_linear=True,
                                             triton=True)),
    (False, 1, {}, Paths(gemv=False, fused=False, gated_linear=False, triton=False)),
    # the CPU tests' interpreter switches: the GEMV's SwiGLU epilogue needs FUSED, not CUDA
    (False, 1, dict(gemv_on_cpu=True), Paths(gemv=True, fused=False, gated_linear=True,
                                             triton=False)),
    (False, 3, dict(fused_on_cpu=True), Paths(gemv=False, fused=True, gated_linear=False,
                                              triton=False)),
    # the small-M kernel past the GEMV's rows up to small_m_max_rows, norms and SwiGLU in it
    (True, 8, dict(small_m_max_rows=8, norm_in_gemv=True),
     Paths(gemv=False, fused=True, gated_linear=True, triton=True, normed_linear=True,
           small_m=True)),
    (True, 9, dict(small_m_max_rows=8, norm_in_gemv=True),
     Paths(gemv=False, fused=True, gated_linear=False, triton=True)),
    (True, 1, dict(small_m_max_rows=8, norm_in_gemv=True),
     Paths(gemv=True, fused=True, gated_linear=True, triton=True, normed_linear=True)),
    (True, 4, dict(small_m_max_rows=8, fused_kernels=False),
     Paths(gemv=False, fused=False, gated_linear=False, triton=True)),
    (True, 4, dict(small_m_max_rows=8, deterministic=True),
     Paths(gemv=False, fused=True, gated_linear=False, triton=True, invariant=True)),
], ids=["cuda-1", "cuda-2", "cuda-unfused", "cuda-no-gemv", "cuda-gemv4", "cpu",
        "cpu-gemv-interp", "cpu-fused-interp", "cuda-small-m", "cuda-past-small-m",
        "cuda-1-not-small-m", "cuda-small-m-unfused", "cuda-small-m-deterministic"])
def test_decide(on_cuda, rows, knobs, want):
    assert decide(on_cuda, rows, **{**KNOBS, **knobs}) == want


def test_paths_reads_the_knobs_live(monkeypatch):
    assert kernel_choice.paths(torch.zeros(1, 8)) == Paths(False, False, False, False)
    monkeypatch.setattr(kernels.gemv, "ON_CPU", True)
    monkeypatch.setattr(kernels.gemv, "GEMV_MAX_TOKENS", 4)
    monkeypatch.setattr(kernel_choice, "FUSED_ON_CPU", True)
    assert kernel_choice.paths(torch.zeros(2, 2, 8)).gemv        # rows over leading dims
    assert kernel_choice.paths(torch.zeros(8)).gemv
    assert not kernel_choice.paths(torch.zeros(5, 8)).gemv
    assert kernel_choice.paths(torch.zeros(5, 8)).fused
    monkeypatch.setattr(kernel_choice, "FUSED", False)
    assert kernel_choice.paths(torch.zeros(1, 8)) == Paths(True, False, False, False)


def test_fp8_rows(monkeypatch):
    """Norms hand FP8 GEMMs quantized rows only for e4m3 weights of rows up to ONE_BLOCK_MAX,
    off the GEMV, with fused kernels on and _scaled_mm on the device."""
    w8 = torch.zeros(4, 64).to(FP8)
    x = torch.zeros(3, 64)
    assert not kernel_choice.fp8_rows(x, w8)                     # CPU: no fused kernels
    monkeypatch.setattr(kernel_choice, "FUSED_ON_CPU", True)
    assert not kernel_choice.fp8_rows(x, w8)                     # no _scaled_mm on CPU
    monkeypatch.setattr(kernel_choice, "scaled_mm_supported", lambda device: True)
    assert kernel_choice.fp8_rows(x, w8)
    assert not kernel_choice.fp8_rows(x, torch.zeros(4, 64))     # not e4m3
    assert not kernel_choice.fp8_rows(x, torch.zeros(1, ONE_BLOCK_MAX + 1).to(FP8))
    monkeypatch.setattr(kernels.gemv, "ON_CPU", True)
    assert kernel_choice.fp8_rows(x, w8) and not kernel_choice.fp8_rows(x[:1], w8)  # GEMV


def test_env_knobs():
    """NANOSERVE_FUSED_KERNELS=0 and NANOSERVE_GEMV_MAX_TOKENS, read once at import."""
    code = ("import torch; from models import kernel_choice as k; import kernels.gemv as g; "
            "print(k.FUSED, g.GEMV_MAX_TOKENS)")
    env = {**os.environ, "NANOSERVE_FUSED_KERNELS": "0", "NANOSERVE_GEMV_MAX_TOKENS": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], check=True).stdout
    assert out.split() == ["False", "3"]
