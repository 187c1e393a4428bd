"""Grammar token-bitmask kernel vs its torch reference (TRITON_INTERPRET=1 on CPU), the
reference vs llguidance's own numpy apply_token_bitmask_inplace and a per-token loop, and
the kernel on a mask that a real llguidance matcher fills."""
import os

import pytest

if os.environ.get("NANOSERVE_GPU_TESTS"):   # CPU tensors through the interpreter only
    pytest.skip("CPU interpreter tests; the GPU suite runs the kernels on CUDA",
                allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

from kernels.grammar_mask import apply_token_bitmask_, apply_token_bitmask_ref

NEG_INF = float("-inf")


def random_bitmask(m: int, w: int, g: torch.Generator, p_allowed: float = 0.5) -> torch.Tensor:
    """[m, w] int32 whose bits are set with probability p_allowed (bit 31 included)."""
    bits = (torch.rand(m, w, 32, generator=g) < p_allowed).to(torch.int64)
    words = (bits << torch.arange(32)).sum(-1)           # 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def allowed_loop(bitmask: torch.Tensor, i: int, v: int) -> list[bool]:
    """Token j of mask row i allowed, one token at a time with Python's unsigned view."""
    words = [int(x) & 0xFFFFFFFF for x in bitmask[i].tolist()]
    return [j // 32 < len(words) and bool((words[j // 32] >> (j % 32)) & 1) for j in range(v)]


def run_both(logits, rows, bitmask):
    ref = apply_token_bitmask_ref(logits, rows, bitmask)
    out = logits.clone()
    assert apply_token_bitmask_(out, rows, bitmask) is out
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference_on_the_listed_rows_only(dtype):
    g = torch.Generator().manual_seed(0)
    n, v = 6, 2500   # vocab a multiple of neither 32 nor the block
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    rows = torch.tensor([4, 0, 2])
    bitmask = random_bitmask(3, (v + 31) // 32, g)
    out, ref = run_both(logits, rows, bitmask)
    assert torch.equal(out, ref)
    assert torch.equal(out[[1, 3, 5]], logits[[1, 3, 5]])
    for i, r in enumerate(rows.tolist()):
        allowed = torch.tensor(allowed_loop(bitmask, i, v))
        assert torch.equal(out[r][allowed], logits[r][allowed])
        assert bool((out[r][~allowed] == NEG_INF).all())
        assert 0 < int(allowed.sum()) < v


def test_large_odd_vocab():
    g = torch.Generator().manual_seed(1)
    v = 151_939   # Qwen-like size, made odd: the last word and the last block are partial
    logits = torch.randn(3, v, generator=g)
    rows = torch.tensor([2, 0])
    bitmask = random_bitmask(2, (v + 31) // 32, g, p_allowed=0.01)
    out, ref = run_both(logits, rows, bitmask)
    assert torch.equal(out, ref)
    assert torch.equal(out[1], logits[1])
    for i, r in enumerate(rows.tolist()):
        assert torch.equal(torch.isfinite(out[r]), torch.tensor(allowed_loop(bitmask, i, v)))


def test_bit_31_words():
    v = 160   # five words
    words = torch.tensor([[-2**31, 2**31 - 1, -1, 0, 1]], dtype=torch.int32)
    logits = torch.randn(1, v)
    out, ref = run_both(logits, torch.tensor([0]), words)
    assert torch.equal(out, ref)
    expect = torch.zeros(v, dtype=torch.bool)
    expect[31] = True           # -2**31: bit 31 only
    expect[32:63] = True        # 2**31 - 1: bits 0..30, not 31
    expect[64:96] = True        # -1: every bit
    expect[128] = True          # 1: bit 0 only
    assert torch.equal(torch.isfinite(out[0]), expect)
    assert expect.tolist() == allowed_loop(words, 0, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_zero_and_all_ones_masks(dtype):
    v = 1100
    w = (v + 31) // 32
    logits = torch.randn(3, v).to(dtype)
    bitmask = torch.stack([torch.zeros(w, dtype=torch.int32),
                           torch.full((w,), -1, dtype=torch.int32)])
    out, ref = run_both(logits, torch.tensor([1, 2]), bitmask)
    assert torch.equal(out, ref)
    assert bool((out[1] == NEG_INF).all())
    assert torch.equal(out[[0, 2]], logits[[0, 2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows(dtype):
    g = torch.Generator().manual_seed(2)
    v = 1500
    base = torch.randn(8, v + 77, generator=g).to(dtype)
    logits = base[::2, :v]   # row stride 2 * (v + 77), columns contiguous
    assert logits.stride(0) > v and logits.stride(1) == 1
    before = base.clone()
    rows = torch.tensor([3, 1])
    bitmask = random_bitmask(2, (v + 31) // 32, g)
    ref = apply_token_bitmask_ref(logits, rows, bitmask)
    apply_token_bitmask_(logits, rows, bitmask)
    assert torch.equal(logits, ref)
    touched = torch.zeros_like(base, dtype=torch.bool)
    touched[[6, 2], :v] = True   # base rows behind logits rows 3 and 1
    assert torch.equal(base[~touched], before[~touched])


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, 300)
    out, ref = run_both(logits, torch.zeros(0, dtype=torch.int64),
                        torch.zeros(0, 10, dtype=torch.int32))
    assert torch.equal(out, logits) and torch.equal(ref, logits)


def test_duplicate_rows_intersect():
    v = 200
    w = (v + 31) // 32
    logits = torch.randn(2, v)
    a = torch.zeros(w, dtype=torch.int32)
    b = torch.zeros(w, dtype=torch.int32)
    a[0], a[1] = 0b1111, -1
    b[0], b[2] = 0b0110, -1
    out, ref = run_both(logits, torch.tensor([1, 1]), torch.stack([a, b]))
    assert torch.equal(out, ref)
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [1, 2]
    assert torch.equal(out[0], logits[0])


@pytest.mark.parametrize("w_delta", [-3, 2])
def test_mask_narrower_or_wider_than_vocab(w_delta):
    """Narrower: tokens past 32 * W are disallowed. Wider: the extra words are ignored."""
    g = torch.Generator().manual_seed(3)
    v = 1030
    w = (v + 31) // 32 + w_delta
    logits = torch.randn(2, v, generator=g)
    bitmask = random_bitmask(2, w, g, p_allowed=0.7)
    out, ref = run_both(logits, torch.tensor([0, 1]), bitmask)
    assert torch.equal(out, ref)
    for i in range(2):
        assert torch.isfinite(out[i]).tolist() == allowed_loop(bitmask, i, v)
    if w_delta < 0:
        assert bool((out[:, 32 * w:] == NEG_INF).all())


@pytest.mark.parametrize("v,w_delta", [(2500, 0), (97, 0), (1030, -3), (1030, 2)])
def test_reference_matches_llguidance_numpy_and_a_loop(v, w_delta):
    llnp = pytest.importorskip("llguidance.numpy")
    g = torch.Generator().manual_seed(4)
    n = 4
    w = (v + 31) // 32 + w_delta
    logits = torch.randn(n, v, generator=g)
    rows = torch.tensor([3, 0, 1])
    bitmask = random_bitmask(len(rows), w, g)
    ref = apply_token_bitmask_ref(logits, rows, bitmask)
    theirs = logits.numpy()[rows.numpy()].copy()
    llnp.apply_token_bitmask_inplace(theirs, bitmask.numpy())
    assert np.array_equal(ref[rows].numpy(), theirs)
    assert torch.equal(ref[2], logits[2])
    for i, r in enumerate(rows.tolist()):
        for j, ok in enumerate(allowed_loop(bitmask, i, v)):
            assert ref[r, j].item() == (logits[r, j].item() if ok else NEG_INF)


def test_a_real_llguidance_mask():
    llguidance = pytest.importorskip("llguidance")
    import llguidance.numpy as llnp
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    class ByteTokenizer:   # 256 byte tokens, three merges and an EOS: vocab 260
        def __init__(self):
            self.tokens = [bytes([i]) for i in range(256)] + [b"12", b"ab", b"1a", b"<eos>"]
            self.eos_token_id = len(self.tokens) - 1
            self.bos_token_id = None
            self.special_token_ids = [self.eos_token_id]

        def __call__(self, s: bytes) -> list[int]:
            return list(s)

    tok = LLTokenizer(TokenizerWrapper(ByteTokenizer()))
    v = tok.vocab_size
    matchers = [LLMatcher(tok, LLMatcher.grammar_from_regex(r"[0-9]+"), log_level=0)
                for _ in range(2)]
    assert not any(m.is_error() for m in matchers)
    assert matchers[1].consume_token(ord("7"))
    bitmask = llnp.allocate_token_bitmask(2, v)
    for i, m in enumerate(matchers):
        llnp.fill_next_token_bitmask(m, bitmask, i)
    bitmask = torch.from_numpy(bitmask)
    logits = torch.randn(3, v).to(torch.bfloat16)
    rows = torch.tensor([2, 0])
    out, ref = run_both(logits, rows, bitmask)
    assert torch.equal(out, ref)
    digits = list(range(ord("0"), ord("9") + 1))
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == digits + [256]    # + "12"
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == digits + [256, 259]  # + EOS
    assert torch.equal(out[1], logits[1])
