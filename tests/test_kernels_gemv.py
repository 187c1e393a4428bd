"""Decode GEMV (kernels/gemv.py) vs its torch reference, on CPU via the interpreter.

Ragged sizes (N and K not multiples of the tiles, so both masked paths run, and even
ones for the unmasked path), 1-4 tokens (the padded token rows must not leak into the
output), bf16 and fp32 weights, e4m3 weights with per-channel scales spanning two
decades (a scale on the wrong channel shows), with and without bias.
"""
from __future__ import annotations

import pytest
import torch

from kernels.fp8_linear import quantize_rows
from kernels.gemv import gemv, gemv_ref

from triton_device import DEVICE, INTERPRET, needs_triton

pytestmark = needs_triton


def case(t: int, n: int, k: int, x_dtype: torch.dtype, w_kind: str, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(x_dtype)
    w = torch.randn(n, k, generator=g) / k ** 0.5 * torch.logspace(-1, 1, n)[:, None]
    scale = None
    if w_kind == "fp8":
        w, scale = quantize_rows(w)
    else:
        w = w.to(x_dtype)
    b = torch.randn(n, generator=g).to(x_dtype) if bias else None
    on = lambda v: None if v is None else v.to(DEVICE)  # noqa: E731
    return on(x), on(w), on(scale), on(b)


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-4 if ref.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


@pytest.mark.parametrize("w_kind", ["fp8", "same"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, n, k", [(1, 40, 200), (3, 64, 256), (4, 24, 130), (2, 16, 512)])
def test_gemv_matches_ref(t, n, k, x_dtype, w_kind):
    for bias in (False, True):
        x, w, scale, b = case(t, n, k, x_dtype, w_kind, bias, seed=t * n + k)
        check(gemv(x, w, scale, b, block_n=8, block_k=64), gemv_ref(x, w, scale, b))


def test_gemv_default_tiles_and_leading_dims():
    """The routed call (default tiles) on [batch, seq, K] input keeps the leading dims."""
    x, w, scale, _ = case(2, 48, 1024, torch.bfloat16, "fp8", False, seed=7)
    x3 = x.reshape(2, 1, 1024)
    out = gemv(x3, w, scale)
    assert out.shape == (2, 1, 48)
    check(out, gemv_ref(x3, w, scale))


def test_gemv_scale_applied_per_channel():
    """Mutation guard: swapping two channels' scales changes exactly those outputs."""
    x, w, scale, _ = case(1, 16, 128, torch.float32, "fp8", False, seed=3)
    swapped = scale.clone()
    swapped[[0, 15]] = scale[[15, 0]]
    good, bad = gemv(x, w, scale, block_n=8, block_k=64), gemv(x, w, swapped, block_n=8, block_k=64)
    differs = (good - bad).abs().squeeze(0) > 1e-6
    assert differs[0] and differs[15] and not differs[1:15].any()


@pytest.mark.skipif(not INTERPRET, reason="routes the CPU model through the interpreter")
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_model_decode_through_gemv_equals_without(tmp_path_factory, monkeypatch, quantization):
    """Qwen3's decode step (3 tokens: every linear layer takes the GEMV; the LM head stays
    on torch's GEMM, models/embedding.ParallelLMHead) gives the logits of the same model on torch's GEMMs (FP8: the weight-only reference,
    what CUDA ran for a few tokens before), its SwiGLUs from the gate_up GEMV's epilogue;
    the prefill step (16 tokens) does not take it."""
    import kernels.gemv
    import models.linear
    from kernels.fp8_linear import fp8_weight_only_ref
    monkeypatch.setattr(models.linear, "fp8_linear",
                        lambda x, w, s, b=None, quantized=None: fp8_weight_only_ref(x, w, s, b))
    from models.loader import load_model
    from paged_kv import PagedKV
    from test_qwen3_vs_hf import random_prompts, run_step
    from tiny_checkpoint import tiny_qwen3_dir
    path = tiny_qwen3_dir(tmp_path_factory, seed=5)
    model, _ = load_model(str(path), quantization=quantization)
    prompts = random_prompts(389, [6, 9, 4], seed=1)
    calls = []
    real = kernels.gemv._gemv_kernel
    monkeypatch.setattr(kernels.gemv, "GEMV_MAX_TOKENS", 4)

    def logits(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(kernels.gemv, "ON_CPU", on)
        cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
        run_step(model, cache, prompts, [(i, 0, len(p) - 1) for i, p in enumerate(prompts)])
        return run_step(model, cache, prompts, [(i, len(p) - 1, len(p)) for i, p in
                                                enumerate(prompts)], is_decode=True)

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]
    monkeypatch.setattr(kernels.gemv, "_gemv_kernel", Counting())
    import models.activation
    acts, act = [], models.activation.swiglu
    monkeypatch.setattr(models.activation, "swiglu", lambda x, **kw: acts.append(x) or act(x, **kw))
    plain = logits(False)
    plain_acts = len(acts)
    routed = logits(True)
    layers = sum(1 for m in model.modules() if hasattr(m, "matmul"))
    assert len(calls) == layers   # the decode step only: the prefill has 16 tokens
    # the routed decode step's SwiGLUs come from the gate_up GEMVs' epilogue
    assert plain_acts - (len(acts) - plain_acts) == model.config.num_hidden_layers
    for a, b in zip(routed, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


@pytest.mark.parametrize("parts", [(40,), (24, 8, 8), (20, 20)])
@pytest.mark.parametrize("w_kind", ["fp8", "same"])
def test_gemv_adds_the_tokens_lora_delta(parts, w_kind):
    """GemvLora: the one token's adapter delta (its slot's B, each column's part of h, the
    slot's scale) added before rounding equals the base product plus lora_expand_ref's
    delta; slot -1 adds nothing; another slot's B (the mutation) differs."""
    from kernels.gemv import GemvLora
    from kernels.lora import lora_expand_ref, lora_rows
    n, k, S, R = sum(parts), 96, 3, 8
    x, w, scale, b = case(1, n, k, torch.bfloat16, w_kind, True, seed=n)
    g = torch.Generator().manual_seed(1)
    lb = (torch.randn(S, n, R, generator=g) * 0.5).to(torch.bfloat16).to(DEVICE)
    ls = torch.tensor([0.5, 2.0, 1.0]).to(DEVICE)
    h = torch.randn(1, len(parts) * R, generator=g).to(DEVICE)
    for s in (0, 2, -1):
        slot = torch.tensor([s], dtype=torch.int32, device=DEVICE)
        out = gemv(x, w, scale, b, block_n=8, block_k=64,
                   lora=GemvLora(h, lb, ls, slot, parts))
        y = gemv_ref(x.float(), w, scale, b)
        lora_expand_ref(h, lb, ls, lora_rows(slot, S), y, 0, parts)
        check(out, y.to(torch.bfloat16))
        if s >= 0:
            other = torch.tensor([1], dtype=torch.int32, device=DEVICE)
            wrong = gemv(x, w, scale, b, block_n=8, block_k=64,
                         lora=GemvLora(h, lb, ls, other, parts))
            assert (wrong.float() - out.float()).abs().max() > 0.1


def test_pdl_launches_only_small_batch_kernels_on_hopper(monkeypatch):
    """kernels/pdl.py: the PDL constexpr and the launch flag always agree (a flagged launch
    of a kernel that never waits would race), and only kernels of <= MAX_ROWS rows on an
    sm_90+ CUDA device get them (past 8 rows cuBLAS GEMMs sit between the chain's kernels)."""
    from kernels import pdl
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_supported", lambda index: index == 0)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert pdl.launch(cuda0, 1) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch(cuda0, pdl.MAX_ROWS) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch(cuda0, pdl.MAX_ROWS + 1) == {"PDL": False}
    assert pdl.launch(cuda1, 1) == {"PDL": False}          # (an older GPU)
    assert pdl.launch(torch.device("cpu"), 1) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)              # NANOSERVE_PDL=0
    assert pdl.launch(cuda0, 1) == {"PDL": False}


@pytest.mark.parametrize("w_kind", ["fp8", "same"])
@pytest.mark.parametrize("t, half, k", [(1, 20, 200), (3, 18, 128), (2, 8, 512)])
def test_gated_gemv_is_the_unfused_gemv_then_silu_and_mul(t, half, k, w_kind):
    """gated=True (w = [gate; up]): silu(gate) * up from the GEMV's epilogue, equal bit for
    bit to the GEMV's rounded output through kernels/activation.py's kernel (the model's
    two launches; in the interpreter its torch reference), and within tolerance of the float32 references; an 18-channel half
    leaves the last program's channels masked. A program pairing channel c's gate with
    another channel's up (the mutation) fails the exact comparison."""
    from kernels.activation import silu_and_mul, silu_and_mul_ref
    x, w, scale, _ = case(t, 2 * half, k, torch.bfloat16, w_kind, False, seed=half + k)
    out = gemv(x, w, scale, block_n=8, block_k=64, gated=True)
    assert out.shape == (t, half)
    # the interpreter's casts truncate where the activation kernel does not fix them up
    # (the GEMV does): there the torch reference of the same ops is the exact one
    act = silu_and_mul_ref if INTERPRET else silu_and_mul
    unfused = gemv(x, w, scale, block_n=8, block_k=64)
    torch.testing.assert_close(out, act(unfused), rtol=0, atol=0)
    check(out, silu_and_mul_ref(gemv_ref(x.float(), w, scale)).to(torch.bfloat16))
    shifted = torch.cat([unfused[:, :half], unfused[:, half:].roll(1, dims=1)], dim=1)
    assert not torch.equal(out, act(shifted))


@pytest.mark.parametrize("w_kind", ["fp8", "same"])
@pytest.mark.parametrize("n, k, block_k", [(40, 256, 64), (24, 200, 64), (16, 512, 512)])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_with_the_norm_in_its_prologue_is_the_norm_then_the_gemv(n, k, block_k, w_kind,
                                                                      gated):
    """GemvNorm (one token): the GEMV of rms_norm(x + residual) with the norm in the GEMV's
    prologue equals the norm kernel (kernels/rmsnorm.py) then the GEMV bit for bit, even and
    ragged K, bf16 and e4m3 weights, gated or not; the sum x + residual lands in residual_out
    and the residual is left as it was; without a residual, x itself is normalized. A norm
    that skipped the residual (the mutation) fails the exact comparison."""
    from kernels.gemv import GemvNorm
    from kernels.rmsnorm import rms_norm
    x, w, scale, _ = case(1, n, k, torch.bfloat16, w_kind, False, seed=n + k)
    g = torch.Generator().manual_seed(k)
    residual = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEVICE)
    weight = (1 + torch.randn(k, generator=g) / 4).to(torch.bfloat16).to(DEVICE)
    kw = dict(block_n=8, block_k=block_k, gated=gated)
    res_in, res_out = residual.clone(), torch.empty_like(residual)
    fused = gemv(x, w, scale, **kw, norm=GemvNorm(weight, 1e-6, res_in, res_out))
    normed, summed = rms_norm(x, weight, 1e-6, residual.clone())
    torch.testing.assert_close(fused, gemv(normed, w, scale, **kw), rtol=0, atol=0)
    torch.testing.assert_close(res_out, summed, rtol=0, atol=0)
    assert torch.equal(res_in, residual)
    plain = gemv(x, w, scale, **kw, norm=GemvNorm(weight, 1e-6))
    torch.testing.assert_close(plain, gemv(rms_norm(x, weight, 1e-6), w, scale, **kw),
                               rtol=0, atol=0)
    assert not torch.equal(plain, fused)


@pytest.mark.skipif(not INTERPRET, reason="routes the CPU model through the interpreter")
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_model_decode_with_the_norms_in_the_gemvs_equals_without(tmp_path_factory, monkeypatch,
                                                                  quantization):
    """kernel_choice.NORM_IN_GEMV: a one-token decode step of Qwen3 leaves each layer's two
    norms to the qkv and gate_up GEMVs' prologues (only the final norm runs as a norm) and
    gives the logits of the same step with the norms on their own; the prefill does not."""
    import kernels.gemv
    import models.layernorm
    from models import kernel_choice
    from models.loader import load_model
    from paged_kv import PagedKV
    from test_qwen3_vs_hf import random_prompts, run_step
    from tiny_checkpoint import tiny_qwen3_dir
    path = tiny_qwen3_dir(tmp_path_factory, seed=6)
    model, _ = load_model(str(path), quantization=quantization)
    prompts = random_prompts(389, [7], seed=2)
    monkeypatch.setattr(kernels.gemv, "ON_CPU", True)
    norms = []
    forward = models.layernorm.RMSNorm.forward
    monkeypatch.setattr(models.layernorm.RMSNorm, "forward",
                        lambda self, *a, **k: norms.append(self) or forward(self, *a, **k))

    def logits(on: bool) -> torch.Tensor:
        monkeypatch.setattr(kernel_choice, "NORM_IN_GEMV", on)
        cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
        run_step(model, cache, prompts, [(0, 0, len(prompts[0]) - 1)])
        norms.clear()
        return run_step(model, cache, prompts, [(0, len(prompts[0]) - 1, len(prompts[0]))],
                        is_decode=True)[0]

    hidden = lambda: [n for n in norms if n.weight.shape[0] == model.config.hidden_size]  # noqa: E731
    plain = logits(False)
    assert len(hidden()) == 2 * model.config.num_hidden_layers + 1   # (not the q/k norms)
    fused = logits(True)
    assert len(hidden()) == 1   # the final norm
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
