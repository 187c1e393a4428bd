"""Fused RMSNorm(+residual) and rotary Triton kernels vs their torch references (interpreter)."""
from __future__ import annotations

import pytest
import torch

from kernels.rmsnorm import rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref

from triton_device import DEVICE, needs_triton

pytestmark = needs_triton


def cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], -1).to(DEVICE)


@pytest.mark.parametrize("hidden", [48, 64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_ref(hidden: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(DEVICE)
    w = torch.randn(hidden, generator=g).to(DEVICE)
    if not with_residual:
        torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
        return
    res = torch.randn(7, hidden, generator=g).to(DEVICE)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res.clone())
    out, new_res = rms_norm(x, w, 1e-6, res)
    assert new_res is res                                            # updated in place
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(res, ref_res)


@pytest.mark.parametrize("rows", [5, 130])        # 130: _scaled_mm's zero padding to 256 rows
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_rows(rows: int, with_residual: bool) -> None:
    """fp8=True: the same output and residual, plus the output's e4m3 copy bit for bit as
    quantize_rows makes it (what an FP8 GEMM would quantize), zero rows past the tokens."""
    from kernels.fp8_linear import QuantizedRows, fp8_rows, quantize_rows
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).bfloat16().to(DEVICE)
    w = torch.randn(64, generator=g).bfloat16().to(DEVICE)
    res = torch.randn(rows, 64, generator=g).bfloat16().to(DEVICE) if with_residual else None
    if with_residual:
        plain, plain_res = rms_norm(x, w, 1e-6, res.clone())
        got, got_res = rms_norm(x, w, 1e-6, res, fp8=True)
        assert torch.equal(got_res, plain_res)
    else:
        plain, got = rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6, fp8=True)
    assert isinstance(got, QuantizedRows) and torch.equal(got.x, plain)
    q, scale = quantize_rows(plain.cpu())   # CPU: IEEE divisions (CUDA's torch multiplies
    assert got.q.shape == (fp8_rows(rows), 64)   # by 1/448 for the scale: 1 ulp off)
    assert torch.equal(got.q[:rows].float().cpu(), q.float())
    assert torch.equal(got.scale[:rows].cpu(), scale)
    assert not got.q[rows:].float().any()


def test_rms_norm_fp16_and_per_head_strided_view() -> None:
    """Per-head q/k norm (Qwen3) on a strided slice of a fused qkv tensor, in fp16."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g).half().to(DEVICE)
    q = qkv[:, :64].view(5, 4, 16)                                   # non-contiguous [T, H, D]
    w = torch.rand(16, generator=g).half().to(DEVICE)
    assert not q.is_contiguous()
    torch.testing.assert_close(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6),
                               atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("head_dim,rot_dim", [(32, 32), (64, 64), (32, 16)])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rotary_matches_ref(head_dim: int, rot_dim: int, pos_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(head_dim + rot_dim)
    t, hq, hkv = 9, 4, 2
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g).to(DEVICE)
    q = qkv[:, :hq * head_dim].view(t, hq, head_dim)                 # strided views, as in
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t, hkv, head_dim)   # the model
    positions = torch.tensor([0, 1, 2, 7, 31, 100, 5, 3, 63], dtype=pos_dtype, device=DEVICE)
    cache = cos_sin_cache(128, rot_dim)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache)
    v_before = qkv[:, (hq + hkv) * head_dim:].clone()
    q_out, k_out = apply_rotary(q, k, positions, cache)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], v_before)     # v untouched


def test_rotary_ref_is_neox_rotate_half() -> None:
    """Pin the reference to the Hugging Face formula q*cos + rotate_half(q)*sin."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 16, generator=g)
    pos = torch.tensor([0, 4, 9])
    cache = cos_sin_cache(16, 16).cpu()
    cos, sin = cache[pos].chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    rotate_half = torch.cat([-q[..., 8:], q[..., :8]], -1)
    q_ref, _ = apply_rotary_ref(q, q[:, :1], pos, cache)
    torch.testing.assert_close(q_ref, q * cos + rotate_half * sin)


@pytest.fixture(params=["two programs a token", "one program a token"])
def programs(request, monkeypatch) -> None:
    """Both launch shapes of the fused kernel (it picks by token count)."""
    if request.param == "one program a token":
        monkeypatch.setattr("kernels.qk_norm_rotary.TWO_PROGRAMS_MAX_TOKENS", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qk_norm_rotary_matches_ref(dtype: torch.dtype, programs) -> None:
    """Strided q/k views of a fused qkv output, normalized + rotated in place."""
    from kernels.qk_norm_rotary import qk_norm_rotary, qk_norm_rotary_ref
    g = torch.Generator().manual_seed(3)
    t, hq, hk, d = 5, 4, 2, 32
    qkv = (2 * torch.randn(t, (hq + 2 * hk) * d, generator=g)).to(dtype).to(DEVICE)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    qw = torch.rand(d, generator=g).to(dtype).to(DEVICE)
    kw = torch.rand(d, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor([0, 7, 3, 60, 1], device=DEVICE)
    v_before = qkv[:, (hq + hk) * d:].clone()
    ref_q, ref_k = qk_norm_rotary_ref(q, k, qw, kw, 1e-6, pos, cos_sin_cache(64, d))
    out_q, out_k = qk_norm_rotary(q, k, qw, kw, 1e-6, pos, cos_sin_cache(64, d))
    assert out_q.data_ptr() == qkv.data_ptr()                         # in place
    # bf16: the fp32 sum of squares may round the normed value one ulp apart, and
    # x1 cos - x2 sin can cancel, so an absolute bound of ~2 ulps at |x| ~ 1
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_q, ref_q, **tol)
    torch.testing.assert_close(out_k, ref_k, **tol)
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)             # v untouched


@pytest.mark.parametrize("head_major_cache", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_qk_norm_rotary_stores_kv(fp8: bool, head_major_cache: bool, programs) -> None:
    """With the caches given, the kernel also stores K (normed + rotated, as it writes it
    back) and V at the slots, as store_kvcache_ref does with its outputs; slot -1 skipped.
    Token-major caches and head-major ones (the worker's) alike."""
    from kernels.attention import store_kvcache_ref
    from kernels.kv_quant import FP8_DTYPE
    from kernels.qk_norm_rotary import qk_norm_rotary
    from paged_kv import head_major
    g = torch.Generator().manual_seed(4)
    t, hq, hk, d, blocks, bs = 6, 4, 2, 32, 5, 4
    qkv = (3 * torch.randn(t, (hq + 2 * hk) * d, generator=g)).to(DEVICE)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    qw, kw = torch.rand(d, generator=g).to(DEVICE), torch.rand(d, generator=g).to(DEVICE)
    pos = torch.tensor([0, 7, 3, 60, 1, 2], device=DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 9, 12], dtype=torch.int32, device=DEVICE)
    shape = (blocks, bs, hk, d)
    caches = [torch.zeros(shape, device=DEVICE).to(FP8_DTYPE if fp8 else torch.float32)
              for _ in range(2)]
    caches = [head_major(c) for c in caches] if head_major_cache else caches
    scales = [torch.zeros(blocks, bs, device=DEVICE) for _ in range(2)] if fp8 else [None, None]
    ref = [c.clone() for c in caches], [s.clone() if fp8 else None for s in scales]
    qk_norm_rotary(q, k, qw, kw, 1e-6, pos, cos_sin_cache(64, d), v=v, k_cache=caches[0],
                   v_cache=caches[1], slot_mapping=slots, k_scale=scales[0], v_scale=scales[1])
    store_kvcache_ref(k, v, *ref[0], slots, *ref[1])      # k: the kernel's own output
    for ours, want in zip(caches, ref[0]):
        assert torch.equal(ours.float(), want.float())
    if fp8:
        for ours, want in zip(scales, ref[1]):
            assert torch.equal(ours, want)
    assert caches[0].float().abs().sum() > 0 and caches[1].float().abs().sum() > 0
