"""GPTQ (int4 / int8, sym / asym, act-order) and AutoAWQ GEMM int4 checkpoints
(models/quantized.py, kernels/quant_linear.py) against Hugging Face running the same model
with the dequantized weights, fp32 on CPU: one process, TP=2 over thread collectives
(packed tensors sharded along both axes), the Triton kernels in the interpreter, and a
worker + scheduler through gRPC. Broken checkpoints are refused at load with the reason."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kernels.quant_linear
from models.loader import load_model
from paged_kv import PagedKV
from test_qwen3_vs_hf import assert_close, hf_logits, random_prompts, run_step, thread_tp_logits
from tiny_quantized import make_quantized

# head_dim 16 x 8 heads: o_proj's 128 input rows split over 2 ranks mid-group for AWQ's
# group of 128 (the row-parallel slice indexes every rank's groups through g_idx)
MODEL = dict(hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=256)
FORMATS = {
    "gptq4-sym": dict(fmt="gptq", bits=4, group=32, sym=True),
    "gptq4-asym-actorder": dict(fmt="gptq", bits=4, group=32, sym=False, act_order=True),
    "gptq8-sym-actorder": dict(fmt="gptq", bits=8, group=64, sym=True, act_order=True),
    "gptq8-asym": dict(fmt="gptq", bits=8, group=-1, sym=False),
    "gptq4-v2-asym": dict(fmt="gptq", bits=4, group=16, sym=False, gptq_v2=True),
    "awq4-g128": dict(fmt="awq", group=128, sym=False),
}
MOE = dict(num_experts=3, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=64,
           mlp_only_layers=[1])
FAMILIES = {"qwen3": dict(), "llama": dict(llama=True), "qwen2": dict(qwen2=True),
            "moe": dict(moe=MOE)}
_dirs: dict = {}


def checkpoint(tmp_path_factory, name: str, family: str = "qwen3"):
    """(quantized dir, dequantized float dir), made once per session."""
    if (name, family) not in _dirs:
        _dirs[name, family] = make_quantized(tmp_path_factory.mktemp(f"{name}-{family}"),
                                             **FORMATS[name], **MODEL, **FAMILIES[family],
                                             seed=3)
    return _dirs[name, family]


def edit_config(path, fn) -> None:
    config = json.loads((path / "config.json").read_text())
    fn(config)
    (path / "config.json").write_text(json.dumps(config))


PROMPTS = random_prompts(389, [5, 17], seed=11)


@pytest.mark.parametrize("name", list(FORMATS))
def test_model_matches_hf_on_dequantized_weights(tmp_path_factory, name):
    quant, deq = checkpoint(tmp_path_factory, name)
    refs = hf_logits(deq, PROMPTS)
    model, _ = load_model(str(quant))
    cache = PagedKV(model, [len(p) for p in PROMPTS], block_size=4)
    outs = run_step(model, cache, PROMPTS, [(i, 0, len(p)) for i, p in enumerate(PROMPTS)])
    for i, (ours, ref) in enumerate(zip(outs, refs)):
        assert_close(ours, ref, f"{name} seq {i}")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("name", ["gptq4-asym-actorder", "awq4-g128"])
def test_llama_and_qwen2_families(tmp_path_factory, name, family):
    quant, deq = checkpoint(tmp_path_factory, name, family)
    refs = hf_logits(deq, PROMPTS[:1])
    model, _ = load_model(str(quant))
    cache = PagedKV(model, [len(PROMPTS[0])], block_size=4)
    assert_close(run_step(model, cache, PROMPTS[:1], [(0, 0, len(PROMPTS[0]))])[0], refs[0],
                 f"{name} {family}")


@pytest.mark.parametrize("name", ["gptq4-asym-actorder", "gptq8-asym", "awq4-g128"])
def test_tp2_shards_packed_tensors(tmp_path_factory, name):
    """Column-parallel layers cut packed columns, row-parallel ones packed rows (and keep
    every group's scales): each rank's logits are HF's."""
    quant, deq = checkpoint(tmp_path_factory, name)
    refs = hf_logits(deq, PROMPTS)
    for rank, outs in enumerate(thread_tp_logits(quant, PROMPTS, 2)):
        for i, (ours, ref) in enumerate(zip(outs, refs)):
            assert_close(ours, ref, f"{name} tp rank {rank} seq {i}")


@pytest.mark.parametrize("name", ["gptq4-asym-actorder", "awq4-g128", "gptq8-sym-actorder"])
def test_triton_kernels_in_the_model(tmp_path_factory, monkeypatch, name):
    """The model's quantized layers on the Triton GEMM (prefill) and GEMV (decode), in the
    interpreter, give the reference path's logits."""
    quant, _ = checkpoint(tmp_path_factory, name)
    model, _ = load_model(str(quant))
    prompt = PROMPTS[1]
    runs = []
    for on in (False, True):
        monkeypatch.setattr(kernels.quant_linear, "ON_CPU", on)
        cache = PagedKV(model, [len(prompt)], block_size=4)
        logits = run_step(model, cache, [prompt], [(0, 0, len(prompt) - 2)])
        for t in range(len(prompt) - 2, len(prompt)):
            logits += run_step(model, cache, [prompt], [(0, t, t + 1)], is_decode=True)
        runs.append(torch.cat(logits))
    assert_close(runs[1], runs[0], f"{name} triton vs reference")


def test_decode_step_describes_the_packed_weight(tmp_path_factory):
    quant, _ = checkpoint(tmp_path_factory, "gptq4-asym-actorder")
    model, _ = load_model(str(quant))
    cache = PagedKV(model, [8], block_size=4)   # binds the KV views decode_step reads
    del cache
    step = model.decode_step().layers[0].attn.qkv
    assert step.weight is None and step.quant is not None
    q = step.quant
    assert (q.bits, q.group_size) == (4, 32)
    assert q.qweight.dtype == torch.int32 and q.qweight.shape == (128 // 8, 128 + 2 * 32)
    assert q.scales.shape == q.zeros.shape == (128 // 32, 192) and q.g_idx.shape == (128,)
    assert (step.in_features, step.out_features) == (128, 192)
    assert q.qweight.data_ptr() == model.model.layers[0].self_attn.qkv_proj.qweight.data_ptr()


def _rewrite(src, dst, fn) -> None:
    import shutil
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    fn(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_missing_scale_is_refused(tmp_path_factory, tmp_path):
    quant, _ = checkpoint(tmp_path_factory, "gptq4-sym")
    _rewrite(quant, tmp_path / "m", lambda s: s.pop("model.layers.1.mlp.down_proj.scales"))
    with pytest.raises(ValueError, match=r"never loaded: \['model.layers.1.mlp.down_proj.scales'\]"):
        load_model(str(tmp_path / "m"))


def test_missing_act_order_g_idx_is_refused(tmp_path_factory, tmp_path):
    quant, _ = checkpoint(tmp_path_factory, "gptq4-asym-actorder")
    _rewrite(quant, tmp_path / "m", lambda s: s.pop("model.layers.0.self_attn.k_proj.g_idx"))
    with pytest.raises(ValueError, match=r"qkv_proj.g_idx\[k\]"):
        load_model(str(tmp_path / "m"))


@pytest.mark.parametrize("break_it,message", [
    (lambda s: s.update({"model.layers.0.mlp.up_proj.qweight":
                         s["model.layers.0.mlp.up_proj.qweight"].T.contiguous()}),
     "MergedColumnParallelLinear gptq qweight part 1"),
    (lambda s: s.update({"model.layers.0.self_attn.o_proj.qweight":
                         s["model.layers.0.self_attn.o_proj.qweight"].float()}),
     "gptq qweight is torch.float32, expected packed int32"),
], ids=["transposed", "float"])
def test_wrong_layout_is_refused(tmp_path_factory, tmp_path, break_it, message):
    quant, _ = checkpoint(tmp_path_factory, "gptq4-sym")
    _rewrite(quant, tmp_path / "m", break_it)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "m"))


@pytest.mark.parametrize("change,message", [
    ({"bits": 3}, "GPTQ 3-bit is not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"quant_method": "awq", "bits": 8}, "AWQ 8-bit is not supported"),
    ({"lm_head": True}, "quantized lm_head"),
])
def test_uncovered_configs_are_refused(tmp_path_factory, tmp_path, change, message):
    import shutil
    quant, _ = checkpoint(tmp_path_factory, "gptq4-sym")
    shutil.copytree(quant, tmp_path / "m")
    edit_config(tmp_path / "m", lambda c: c["quantization_config"].update(change))
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "m"))


def test_fp8_requantization_is_refused(tmp_path_factory):
    quant, _ = checkpoint(tmp_path_factory, "gptq4-sym")
    with pytest.raises(ValueError, match="gptq int4 checkpoint: it runs as such"):
        load_model(str(quant), quantization="fp8")



@pytest.mark.parametrize("name", ["gptq4-asym-actorder", "awq4-g128", "gptq8-sym-actorder"])
def test_moe_experts_stay_packed(tmp_path_factory, name):
    """Qwen3-MoE with per-expert quantized tensors (Qwen's GPTQ-Int4 MoE layout): attention,
    dense MLP and experts stay packed; logits are HF's on the dequantized weights, one
    process (reference experts, then the fused MoE kernel in the interpreter) and TP=2."""
    kw = dict(FORMATS[name])
    if kw["fmt"] == "awq":
        kw["group"] = 64        # the experts' 64 input rows of down_proj: one group
    quant, deq = make_quantized(tmp_path_factory.mktemp(f"moe-{name}"), **kw, **MODEL,
                                moe=MOE, seed=5)
    refs = hf_logits(deq, PROMPTS)
    model, _ = load_model(str(quant))
    assert model.model.layers[0].self_attn.qkv_proj.quant is not None
    assert model.model.layers[1].mlp.down_proj.quant is not None      # a dense MLP layer
    cache = PagedKV(model, [len(p) for p in PROMPTS], block_size=4)
    outs = run_step(model, cache, PROMPTS, [(i, 0, len(p)) for i, p in enumerate(PROMPTS)])
    for i, (ours, ref) in enumerate(zip(outs, refs)):
        assert_close(ours, ref, f"moe {name} seq {i}")
    assert model.model.layers[0].mlp.experts.packed is not None
    for layer in model.model.layers:
        if hasattr(layer.mlp, "fused"):
            layer.mlp.fused = True          # the fused MoE kernel with packed experts
    cache = PagedKV(model, [len(p) for p in PROMPTS], block_size=4)
    outs = run_step(model, cache, PROMPTS, [(i, 0, len(p)) for i, p in enumerate(PROMPTS)])
    for i, (ours, ref) in enumerate(zip(outs, refs)):
        assert_close(ours, ref, f"moe {name} fused seq {i}")
    for rank, outs in enumerate(thread_tp_logits(quant, PROMPTS, 2)):
        for i, (ours, ref) in enumerate(zip(outs, refs)):
            assert_close(ours, ref, f"moe {name} tp rank {rank} seq {i}")


def test_moe_expert_missing_its_scales_is_refused(tmp_path_factory, tmp_path):
    quant, _ = make_quantized(tmp_path_factory.mktemp("moe-missing"), fmt="gptq", bits=4,
                              group=32, **MODEL, moe=MOE, seed=5)
    _rewrite(quant, tmp_path / "m", lambda s: s.pop("model.layers.0.mlp.experts.2.up_proj.scales"))
    with pytest.raises(ValueError, match=r"experts.gate_up_scales\[\(2, 'up'\)\]"):
        load_model(str(tmp_path / "m"))


@pytest.mark.slow
@pytest.mark.parametrize("name,family", [("gptq4-asym-actorder", "qwen3"),
                                         ("gptq8-sym-actorder", "qwen3"), ("awq4-g128", "qwen3"),
                                         ("gptq4-asym-actorder", "moe")])
def test_worker_streams_hf_greedy_tokens(tmp_path_factory, name, family):
    """A worker serving the quantized checkpoint through the scheduler's gRPC API: greedy
    tokens are HF's on the dequantized weights."""
    import transformers

    from nanoserve.v1 import generate_pb2
    from services import generation_stub
    quant, deq = checkpoint(tmp_path_factory, name, family)
    prompt = [5, 77, 130, 9, 250, 31]
    with generation_stub(quant) as stub:
        got = stub.Complete(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
            timeout=120).token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert list(got) == ids[len(prompt):]


def test_lora_on_quantized_layers_is_refused(tmp_path_factory):
    from models.lora import attach
    quant, _ = checkpoint(tmp_path_factory, "awq4-g128")
    model, _ = load_model(str(quant))
    with pytest.raises(ValueError, match="LoRA adapters on awq"):
        attach(model, num_slots=2, max_rank=4)


def test_persistent_decode_kernel_declines_packed_weights(tmp_path_factory):
    """The persistent small-batch kernel reads bf16 weights: it says why it does not run."""
    from worker_service.persistent_executor import unsupported
    quant, _ = checkpoint(tmp_path_factory, "gptq4-sym")
    model, _ = load_model(str(quant))
    PagedKV(model, [8], block_size=4)      # binds the KV views decode_step reads
    assert unsupported(model.decode_step(), 1) == "GPTQ / AWQ weights"
