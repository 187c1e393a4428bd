"""FP8 weights (kernels/fp8_linear.py, models/loader.py): the quantization against float64
arithmetic written out here, the model against Hugging Face with the same quantization
applied by hooks, and block-scaled FP8 checkpoints (Qwen's format) loaded."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kernels.fp8_linear import FP8, dequantize_blocks, fp8_linear_ref, quantize_rows
from models.linear import LinearBase
from models.loader import load_model
from paged_kv import PagedKV
from test_qwen3_vs_hf import random_prompts, run_step, thread_tp_logits
from tiny_checkpoint import tiny_qwen3_dir

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quant(t: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 round trip, written independently of kernels/fp8_linear.py."""
    scale = t.double().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((t.double() / scale).float().to(torch.float8_e4m3fn).double() * scale).to(t.dtype)


def test_rows_quantize_to_e4m3_with_the_row_max_at_448():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 70, generator=g) * torch.logspace(-3, 1, 33)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (33, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((33,), 448.0))
    back = q.float() * scale
    torch.testing.assert_close(back, fake_quant(w), rtol=1e-6, atol=0)
    big = w.abs() > w.abs().amax(dim=1, keepdim=True) / 64   # normal e4m3 range: 3-bit mantissa
    assert ((back - w).abs() <= w.abs() * 2.0 ** -4 * 1.0001)[big].all()


def test_linear_reference_is_the_scaled_product():
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(7, 48, generator=g), torch.randn(24, 48, generator=g), torch.randn(24)
    q, scale = quantize_rows(w)
    y = fp8_linear_ref(x, q, scale, bias)
    expect = fake_quant(x).double() @ (q.double() * scale.double()).T + bias.double()
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-5)


def test_dequantize_blocks_with_partial_edge_blocks():
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(70, 90, generator=g) * 50).to(FP8)
    scale_inv = torch.rand(3, 3, generator=g) + 0.5      # blocks of 32 x 40: edges partial
    out = dequantize_blocks(q, scale_inv, (32, 40), torch.float32)
    for i in range(70):
        for j in range(0, 90, 7):
            assert out[i, j] == q[i, j].float() * scale_inv[i // 32, j // 40]


def hf_fake_quantized(model_dir) -> transformers.PreTrainedModel:
    """HF's model with what FP8 weights compute: each linear's weight per-channel
    round-tripped through e4m3, its input per token (a forward pre-hook)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager")
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            module.weight.data = fake_quant(module.weight.data)
            module.register_forward_pre_hook(lambda m, args: (fake_quant(args[0]),))
    return hf


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, seed=21)


def our_logits(path, prompts, **kw) -> list[torch.Tensor]:
    model, _ = load_model(str(path), **kw)
    cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
    return run_step(model, cache, prompts, [(i, 0, len(p)) for i, p in enumerate(prompts)])


def test_fp8_model_matches_hf_with_the_same_quantization(model_dir):
    prompts = random_prompts(389, [6, 17], seed=3)
    model, _ = load_model(str(model_dir), quantization="fp8")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == FP8 for m in linears)
    assert model.lm_head.weight.dtype == torch.float32   # embeddings and LM head stay
    ours = our_logits(model_dir, prompts, quantization="fp8")
    hf = hf_fake_quantized(model_dir)
    plain = our_logits(model_dir, prompts)
    with torch.no_grad():
        for p, logits, unquantized in zip(prompts, ours, plain):
            ref = hf(p[None]).logits[0]
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
            assert (logits - unquantized).abs().max() > 1e-3   # the quantization did something


def hf_experts_fake_quantized(hf) -> None:
    """HF's stacked experts (Qwen3MoeExperts: gate_up_proj [E, 2I, H], down_proj [E, H, I])
    round-tripped per output row; their inputs stay as they are (weight-only)."""
    for name, param in hf.named_parameters():
        if ".experts." in name:
            param.data = fake_quant(param.data)


def test_fp8_moe_experts_match_hf_with_the_same_quantization(tmp_path_factory):
    """--quantization fp8 on a Qwen3-MoE: experts e4m3 with a scale per output row (weight-
    only), linears as above; the router stays. CPU runs the experts dequantized."""
    from models.moe import MoEExperts
    path = tiny_qwen3_dir(tmp_path_factory, seed=23, num_layers=2,
                          moe=dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                                   moe_intermediate_size=32))
    prompts = random_prompts(389, [6, 17], seed=4)
    model, _ = load_model(str(path), quantization="fp8")
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert experts and all(m.gate_up_proj.dtype == m.down_proj.dtype == FP8 for m in experts)
    hidden = model.config.hidden_size
    assert experts[0].scales[0].shape == (5, 64) and experts[0].scales[1].shape == (5, hidden)
    ours = our_logits(path, prompts, quantization="fp8")
    hf = hf_fake_quantized(path)
    hf_experts_fake_quantized(hf)
    with torch.no_grad():
        for p, logits in zip(prompts, ours):
            ref = hf(p[None]).logits[0]
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def write_block_fp8(src, dst, block=(48, 40)):
    """A copy of a float32 checkpoint in Qwen's FP8 format: linear weights e4m3 in blocks,
    `weight_scale_inv` beside each, quantization_config in config.json."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        out = {}
        for name, t in tensors.items():
            if name.rsplit(".", 2)[-2] not in LINEARS:
                out[name] = t
                continue
            n, k = t.shape
            bn, bk = block
            scale_inv = torch.zeros(-(-n // bn), -(-k // bk))
            q = torch.empty(n, k, dtype=FP8)
            for i in range(0, n, bn):
                for j in range(0, k, bk):
                    tile = t[i:i + bn, j:j + bk]
                    s = tile.abs().max().clamp(min=1e-12) / 448
                    scale_inv[i // bn, j // bk] = s
                    q[i:i + bn, j:j + bk] = (tile / s).to(FP8)
            out[name], out[name + "_scale_inv"] = q, scale_inv
        save_file(out, str(f))
    return dst


def test_block_fp8_checkpoint_loads_dequantized_then_fp8(model_dir, tmp_path):
    """Qwen's format: each weight dequantized from its blocks, then served as FP8 (auto) or
    in the model's dtype (none): the same as a float checkpoint of the dequantized weights."""
    fp8_dir = write_block_fp8(model_dir, tmp_path / "fp8")
    model, _ = load_model(str(fp8_dir), quantization="none")
    tensors = load_file(next(fp8_dir.glob("*.safetensors")))
    q = tensors["model.layers.1.mlp.down_proj.weight"]
    expect = dequantize_blocks(q, tensors["model.layers.1.mlp.down_proj.weight_scale_inv"], (48, 40),
                               torch.float32)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, expect)
    dense_dir = tmp_path / "dequantized"   # the same weights as a float checkpoint
    shutil.copytree(model_dir, dense_dir)
    save_file({name: dequantize_blocks(t, tensors[name + "_scale_inv"], (48, 40), torch.float32)
               if t.dtype == FP8 else t for name, t in tensors.items()
               if not name.endswith("_scale_inv")}, str(next(dense_dir.glob("*.safetensors"))))
    prompts = random_prompts(389, [9], seed=4)
    auto = our_logits(fp8_dir, prompts)          # auto: FP8, as the checkpoint is
    again = our_logits(dense_dir, prompts, quantization="fp8")
    torch.testing.assert_close(auto[0], again[0], rtol=0, atol=0)


def test_fp8_tensor_without_its_scale_is_refused(model_dir, tmp_path):
    fp8_dir = write_block_fp8(model_dir, tmp_path / "fp8")
    f = next(fp8_dir.glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match="o_proj.weight is FP8 but has no weight_scale_inv"):
        load_model(str(fp8_dir))


@pytest.mark.slow
def test_worker_with_fp8_weights_streams_hf_fake_quantized_greedy_tokens(model_dir):
    """`--quantization fp8` through the real services: greedy tokens are those of HF with
    the same quantization (each step's logits are the test above's, so the argmax agrees)."""
    import grpc

    from nanoserve.v1 import generate_pb2, generate_pb2_grpc
    from services import start_scheduler, start_worker
    worker = start_worker(model_dir, extra=["--quantization", "fp8"])
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port])
        prompt = [5, 77, 130, 9, 250, 31]
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            got = stub.Complete(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt),
                sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
                timeout=120).token_ids
    finally:
        if sched:
            sched.stop()
        worker.stop()
    hf = hf_fake_quantized(model_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert list(got) == ids[len(prompt):]


@pytest.mark.parametrize("rows, k", [(1, 64), (5, 1500), (3, 4096), (2, 20000)])
def test_quantize_kernel_matches_reference(rows, k):
    """The one-launch kernel (the GPU path; Triton's interpreter here) against quantize_rows
    on CPU, bit for bit (on CUDA too: the kernel's divisions are IEEE ones, as CPU torch's
    are; CUDA torch divides by 448 as a multiply by its reciprocal, 1 ulp off at times)."""
    from kernels.fp8_linear import quantize_rows_
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, rows)[:, None]).bfloat16()
    x[0, :3] = 0.0
    if os.environ.get("NANOSERVE_GPU_TESTS") and torch.cuda.is_available():
        x = x.cuda()   # the GPU host runs the compiled kernel
    q, scale = quantize_rows_(x)
    q_ref, scale_ref = quantize_rows(x.cpu())
    assert torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.float().cpu(), q_ref.float())
    padded, padded_scale = quantize_rows_(x, pad_rows_to=4)   # _scaled_mm's row padding
    assert padded.shape == (-(-rows // 4) * 4, k) and padded_scale.shape == (padded.shape[0], 1)
    assert torch.equal(padded[:rows].float().cpu(), q_ref.float())
    assert not padded[rows:].float().any()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the model's kernels on CPU in Triton's interpreter; on a GPU "
                           "tests/gpu/bench_pdl.py --settings unfused-quant,pdl compares them")
def test_norms_and_activation_hand_fp8_gemms_their_quantized_input(model_dir, monkeypatch):
    """Where the FP8 GEMMs take several tokens on the small-M kernel (Triton interpreter
    here, as if on a GPU with _scaled_mm), the RMSNorms and SiLU-and-mul before them hand
    over QuantizedRows: three of each layer's four quantize launches go, logits unchanged."""
    import kernels.fp8_linear
    import models.kernel_choice
    import models.linear
    monkeypatch.setattr(kernels.fp8_linear, "scaled_mm_supported", lambda device: True)
    monkeypatch.setattr(models.kernel_choice, "scaled_mm_supported", lambda device: True)
    monkeypatch.setattr(models.kernel_choice, "FUSED_ON_CPU", True)
    launches = []
    quantize = kernels.fp8_linear.quantize_rows_
    monkeypatch.setattr(kernels.fp8_linear, "quantize_rows_",
                        lambda *a, **kw: launches.append(1) or quantize(*a, **kw))
    prompts = random_prompts(389, [6, 17], seed=3)
    model, config = load_model(str(model_dir), quantization="fp8")
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(models.linear.LinearBase, "takes_fp8_rows",
                            lambda self, x, f=fused: f and self.weight.dtype == FP8)
        launches.clear()
        cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
        runs.append(run_step(model, cache, prompts, [(i, 0, len(p)) for i, p in enumerate(prompts)]))
        assert len(launches) == (1 if fused else 4) * config.num_hidden_layers
    for unfused, fused in zip(*runs):
        assert torch.equal(fused, unfused)
    hf = hf_fake_quantized(model_dir)
    with torch.no_grad():
        for p, logits in zip(prompts, runs[1]):
            ref = hf(p[None]).logits[0]
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def hf_fake_quantized_tp(model_dir, size: int) -> transformers.PreTrainedModel:
    """hf_fake_quantized as `size` tensor-parallel ranks compute it: column-parallel
    layers (q/k/v, gate/up) quantize as one process does (weight rows and each token over
    all of K), but each rank of a row-parallel layer (o_proj, down_proj) holds a K/size
    slice and quantizes its weight rows and its tokens over that slice alone; the ranks'
    partial products are summed (the all-reduce)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager")
    for name, module in hf.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("o_proj", "down_proj"):
            k = module.weight.shape[1] // size
            parts = [fake_quant(module.weight.data[:, r * k:(r + 1) * k]) for r in range(size)]
            module.forward = (lambda x, parts=parts, k=k: sum(
                fake_quant(x[..., r * k:(r + 1) * k]) @ w.T for r, w in enumerate(parts)))
        elif leaf in LINEARS:
            module.weight.data = fake_quant(module.weight.data)
            module.register_forward_pre_hook(lambda m, args: (fake_quant(args[0]),))
    return hf


def test_fp8_tp2_quantizes_each_ranks_row_parallel_slice(model_dir):
    """FP8 weights at TP=2 (thread collectives): each rank quantizes its own slice of the
    row-parallel layers, so its logits are the per-slice reference's, not TP=1's (why a
    TP=2 FP8 deployment's greedy tokens part from TP=1's on a random model)."""
    prompts = random_prompts(389, [6, 17], seed=3)
    size = 2
    results = thread_tp_logits(model_dir, prompts, size, quantization="fp8")
    tp_ref, one_ref = hf_fake_quantized_tp(model_dir, size), hf_fake_quantized(model_dir)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref, one = tp_ref(p[None]).logits[0], one_ref(p[None]).logits[0]
            tol = 1e-4 * ref.abs().max().item()
            for rank in range(size):
                torch.testing.assert_close(results[rank][i], ref, rtol=1e-4, atol=tol)
            assert (one - ref).abs().max() > 10 * tol   # TP=1's arithmetic is another
