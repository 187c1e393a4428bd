"""Linear layers for a few token rows (kernels/small_m.py: small_m_linear, bf16 / fp16, the
weight as the dot's left operand), with the norm in the prologue and the SwiGLU in the
epilogue, vs torch and vs the same kernel after the norm / before the activation, on CPU
via the interpreter. (The scaled e4m3 form: tests/test_kernels_fp8_small_m.py.)

Sizes are ragged (partial token, channel and reduction tiles) and token counts 2-37 (past one
16-token tile).
"""
from __future__ import annotations

import pytest
import torch

from kernels.gemv import GemvNorm
from kernels.small_m import small_m_linear

from test_kernels_fp8_small_m import assert_matches
from triton_device import DEVICE, INTERPRET, needs_triton

pytestmark = needs_triton


def bf16(*shape, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("t, n, k", [(1, 64, 128), (5, 200, 300), (37, 64, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_m_unscaled_bf16_is_the_linear(t: int, n: int, k: int, bias: bool) -> None:
    """small_m_linear: no scales, F.linear's values (float32 sums of the bf16 operands,
    rounded once) for partial token, channel and reduction tiles; the fp8 path's scales are
    not applied (a weight scaled by 10 shows)."""
    g = torch.Generator().manual_seed(t + n + k)
    x, w = bf16(t, k, g=g), bf16(n, k, g=g, scale=k ** -0.5)
    b = bf16(n, g=g) if bias else None
    out = small_m_linear(x, w, b, block_n=32, block_k=64)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert_matches(out, ref.to(torch.bfloat16))
    assert not torch.allclose(small_m_linear(x, w * 10, b, block_n=32, block_k=64).float(),
                              out.float(), rtol=0.5)


@pytest.mark.parametrize("t, half, k", [(2, 40, 128), (8, 18, 200), (19, 32, 64)])
def test_gated_small_m_is_the_linear_then_silu_and_mul(t: int, half: int, k: int) -> None:
    """gated=True (w = [gate; up]): silu(gate) * up from the epilogue, equal bit for bit to
    the kernel's rounded output through the activation (kernels/activation.py's kernel; in
    the interpreter its torch reference of the same ops), within tolerance of the float32
    reference; an 18-channel half leaves a channel tile masked. Pairing a channel's gate with
    another channel's up (the mutation) fails the exact comparison."""
    from kernels.activation import silu_and_mul, silu_and_mul_ref
    g = torch.Generator().manual_seed(t + half + k)
    x, w = bf16(t, k, g=g), bf16(2 * half, k, g=g, scale=k ** -0.5)
    out = small_m_linear(x, w, gated=True, block_n=16, block_k=64)
    assert out.shape == (t, half)
    act = silu_and_mul_ref if INTERPRET else silu_and_mul
    unfused = small_m_linear(x, w, block_n=16, block_k=64)
    torch.testing.assert_close(out, act(unfused), rtol=0, atol=0)
    ref = silu_and_mul_ref(torch.nn.functional.linear(x.float(), w.float()))
    assert_matches(out, ref.to(torch.bfloat16))
    shifted = torch.cat([unfused[:, :half], unfused[:, half:].roll(1, dims=1)], dim=1)
    assert not torch.equal(out, act(shifted))


@pytest.mark.parametrize("t, n, k, block_k", [(2, 40, 256, 64), (8, 24, 200, 64),
                                              (19, 16, 512, 128)])
@pytest.mark.parametrize("gated", [False, True])
def test_small_m_with_the_norm_in_its_prologue_is_the_norm_then_the_linear(t, n, k, block_k,
                                                                         gated):
    """GemvNorm for every row: the linear of rms_norm(x + residual) with the norm in the
    prologue equals the norm kernel (kernels/rmsnorm.py) then the kernel bit for bit, even
    and ragged K, gated or not, token tiles partial and past 16; the sums x + residual land
    in residual_out (written once: by the first channel tile's programs) and the residual is
    left as it was; without a residual x itself is normalized. A norm that skipped the
    residual (the mutation) fails the exact comparison."""
    from kernels.rmsnorm import rms_norm
    g = torch.Generator().manual_seed(t + n + k)
    x, w = bf16(t, k, g=g), bf16(2 * n if gated else n, k, g=g, scale=k ** -0.5)
    residual = bf16(t, k, g=g)
    weight = (1 + torch.randn(k, generator=g) / 4).to(torch.bfloat16).to(DEVICE)
    kw = dict(block_n=16, block_k=block_k, gated=gated)
    res_in, res_out = residual.clone(), torch.full_like(residual, float("nan"))
    fused = small_m_linear(x, w, **kw, norm=GemvNorm(weight, 1e-6, res_in, res_out))
    normed, summed = rms_norm(x, weight, 1e-6, residual.clone())
    torch.testing.assert_close(fused, small_m_linear(normed, w, **kw), rtol=0, atol=0)
    torch.testing.assert_close(res_out, summed, rtol=0, atol=0)
    assert torch.equal(res_in, residual)
    plain = small_m_linear(x, w, **kw, norm=GemvNorm(weight, 1e-6))
    torch.testing.assert_close(plain, small_m_linear(rms_norm(x, weight, 1e-6), w, **kw),
                               rtol=0, atol=0)
    assert not torch.equal(plain, fused)


@pytest.mark.skipif(not INTERPRET, reason="routes the CPU model through the interpreter")
@pytest.mark.parametrize("family", [dict(seed=8), dict(qwen2=True, seed=9), dict(llama=True,
                                                                              seed=10)],
                         ids=["qwen3", "qwen2-qkv-bias", "llama"])
def test_model_decode_on_the_small_m_kernel_matches_cublas_path_and_hf(tmp_path_factory,
                                                                         monkeypatch, family):
    """kernel_choice.SMALL_M_MAX_ROWS: a bf16 Qwen3 prefilling three prompts' first tokens
    (6 rows) and decoding them to their ends together (3 rows a step, then 2, then 1) takes
    the small-M kernel at 2-6 rows with each layer's two norms in its prologues and the SwiGLU
    in gate_up's epilogue (only the final norm runs as a norm), and gives the logits of the
    plain GEMM path within bf16 rounding; both are as far from Hugging Face's float32 logits.
    Qwen2 (q/k/v biases: the bias beside the norm prologue) and Llama too."""
    import kernels.gemv
    import models.layernorm
    from models import kernel_choice
    from models.loader import load_model
    from paged_kv import PagedKV
    from test_qwen3_vs_hf import decode_to_end, hf_logits, random_prompts
    from tiny_checkpoint import tiny_qwen3_dir
    path = tiny_qwen3_dir(tmp_path_factory, **family)
    prompts = random_prompts(389, [5, 9, 12], seed=3)
    refs = hf_logits(path, prompts)
    model, _ = load_model(str(path), dtype=torch.bfloat16)
    monkeypatch.setattr(kernels.gemv, "ON_CPU", True)
    layers = model.config.num_hidden_layers
    norms = []
    forward = models.layernorm.RMSNorm.forward
    monkeypatch.setattr(models.layernorm.RMSNorm, "forward",
                        lambda self, *a, **k: norms.append((self, a[0].shape[0]))
                        or forward(self, *a, **k))
    first = [1, 2, 3]
    steps = [sum(len(p) - n > s for p, n in zip(prompts, first)) for s in range(12)]
    runs = []
    for on in (False, True):
        monkeypatch.setattr(kernel_choice, "SMALL_M_MAX_ROWS", 8 if on else 0)
        norms.clear()
        cache = PagedKV(model, [len(p) for p in prompts], block_size=4, seed=1)
        runs.append(decode_to_end(model, cache, prompts, first))
        hidden = [rows for n, rows in norms if n.weight.shape[0] == model.config.hidden_size]
        multi = 1 + sum(1 for rows in steps if rows >= 2)   # the prefill, multi-row decodes
        # those run 2 norms a layer + the final one, or only the final one; one-row steps
        # leave theirs to the GEMV either way
        assert sum(r >= 2 for r in hidden) == multi * (1 if on else 2 * layers + 1)
    for i, (plain, small) in enumerate(zip(*runs)):
        assert not torch.equal(small, plain)
        apart = ((small.float() - plain.float()).norm() / plain.float().norm()).item()
        err = [((x.float() - refs[i]).norm() / refs[i].norm()).item() for x in (plain, small)]
        assert apart < 4e-2 and err[1] < 3e-2 and err[1] < 1.5 * err[0] + 1e-3, (i, apart, err)


def test_default_tiles_at_the_model_shapes() -> None:
    """The tiles the model runs (small_m_linear's defaults: gated and normed ones differ so
    that their stages fit in shared memory) give the composition of norm, linear and SwiGLU
    bit for bit at the 0.6B's hidden size, 8 rows."""
    from kernels.activation import silu_and_mul, silu_and_mul_ref
    from kernels.rmsnorm import rms_norm
    g = torch.Generator().manual_seed(11)
    x, w, residual = bf16(8, 1024, g=g), bf16(256, 1024, g=g, scale=1 / 32), bf16(8, 1024, g=g)
    weight = (1 + torch.randn(1024, generator=g) / 4).to(torch.bfloat16).to(DEVICE)
    out = small_m_linear(x, w, gated=True,
                         norm=GemvNorm(weight, 1e-6, residual.clone(), torch.empty_like(x)))
    normed, _ = rms_norm(x, weight, 1e-6, residual.clone())
    act = silu_and_mul_ref if INTERPRET else silu_and_mul
    torch.testing.assert_close(out, act(small_m_linear(normed, w, block_n=32)), rtol=0, atol=0)
