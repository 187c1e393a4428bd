"""Our Qwen3 (paged KV cache, torch attention backend) against Hugging Face, fp32 on CPU.

Every test runs real checkpoints written by tiny_checkpoint and compares logits at every
position: ragged batched prefill, chunked prefill over a cached prefix, and batched
decode across block boundaries, with block tables shuffled so that any mix-up between
logical and physical blocks shows.
"""
from __future__ import annotations

import threading

import pytest
import torch
import transformers

from models.layernorm import RMSNorm
from models.loader import load_model
from models.parallel import TPGroup
from paged_kv import PagedKV
from tiny_checkpoint import tiny_qwen3_dir

SHAPES = {
    "gqa2-hd16-untied": dict(),
    "gqa1-hd32-tied-theta1e6": dict(num_heads=4, num_kv_heads=4, head_dim=32, vocab_size=401,
                                    tie_word_embeddings=True, rope_theta=1e6),
    "gqa4-hd64-sharded": dict(num_heads=8, num_kv_heads=2, head_dim=64, vocab_size=397,
                              shards=2, seed=1),
    "gqa4-bias-tied-3shards": dict(num_heads=8, num_kv_heads=2, head_dim=16, vocab_size=389,
                                   attention_bias=True, tie_word_embeddings=True, shards=3,
                                   num_layers=3, seed=2),
    "llama-gqa2-tied": dict(llama=True, num_heads=4, num_kv_heads=2, head_dim=16,
                            tie_word_embeddings=True, seed=4),
    "qwen2-gqa2-qkv-bias": dict(qwen2=True, num_heads=4, num_kv_heads=2, head_dim=16, seed=5),
    # Qwen3-MoE: odd expert counts, top-k 1..4, norm_topk_prob both ways, dense MLP layers
    # among sparse ones (mlp_only_layers, decoder_sparse_step)
    "moe-e5-top2-norm-dense1": dict(num_layers=3, seed=7, moe=dict(
        num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=32,
        mlp_only_layers=[1])),
    "moe-e3-top1": dict(seed=8, moe=dict(num_experts=3, num_experts_per_tok=1,
                                         norm_topk_prob=False, moe_intermediate_size=48)),
    "moe-e7-top4-step2": dict(num_layers=4, seed=9, tie_word_embeddings=True, moe=dict(
        num_experts=7, num_experts_per_tok=4, norm_topk_prob=False, moe_intermediate_size=16,
        decoder_sparse_step=2)),
}


def run_step(model, cache: PagedKV, prompts: list[torch.Tensor],
             chunks: list[tuple[int, int, int]], is_decode: bool = False) -> list[torch.Tensor]:
    """One model step over the given token ranges; logits for every token, per chunk."""
    positions, meta = cache.metadata(chunks, is_decode)
    input_ids = torch.cat([prompts[seq][s:e] for seq, s, e in chunks])
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, meta))
    return list(logits.split([e - s for _, s, e in chunks]))


def decode_to_end(model, cache: PagedKV, prompts: list[torch.Tensor], first: list[int]
                  ) -> list[torch.Tensor]:
    """Prefill each prompt's first tokens, then decode the rest one token a step, all
    unfinished prompts together; every position's logits, per prompt."""
    logits = [[o] for o in run_step(model, cache, prompts,
                                     [(i, 0, n) for i, n in enumerate(first)])]
    pos = list(first)
    while active := [i for i, p in enumerate(prompts) if pos[i] < len(p)]:
        outs = run_step(model, cache, prompts, [(i, pos[i], pos[i] + 1) for i in active],
                        is_decode=True)
        for i, ours in zip(active, outs):
            logits[i].append(ours)
            pos[i] += 1
    return [torch.cat(x) for x in logits]


def hf_logits(model_dir, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                       attn_implementation="eager")
    with torch.no_grad():
        return [hf(p[None]).logits[0] for p in prompts]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err < tol, f"{what}: max abs diff {err:.3g} >= {tol:.3g}"


def num_kv_heads_of(path) -> int:
    return transformers.AutoConfig.from_pretrained(path).num_key_value_heads


def random_prompts(vocab: int, lens: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lens]


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def checkpoint(request, tmp_path_factory):
    kw = SHAPES[request.param]
    path = tiny_qwen3_dir(tmp_path_factory, **kw)
    lens = [5, 13, 22]
    prompts = random_prompts(kw.get("vocab_size", 389), lens, seed=len(request.param))
    return path, prompts, hf_logits(path, prompts)


def test_batched_prefill_matches_hf(checkpoint):
    path, prompts, refs = checkpoint
    model, config = load_model(str(path))
    cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
    outs = run_step(model, cache, prompts, [(i, 0, len(p)) for i, p in enumerate(prompts)])
    for i, (ours, ref) in enumerate(zip(outs, refs)):
        assert ours.shape[-1] == config.vocab_size
        assert_close(ours, ref, f"prefill seq {i}")
    # logits are not flat: greedy picks are well separated for the engine's later tests
    top2 = refs[2].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 1e-2


def test_fused_kernels_match_unfused(checkpoint, monkeypatch):
    """The fused decode-path kernels (q/k norm + rotary, SiLU-and-mul; Triton interpreter
    here) give the logits of the unfused modules, prefill then decode."""
    import models.kernel_choice
    import models.qwen3
    calls = []
    kernel = models.qwen3.qk_norm_rotary
    monkeypatch.setattr(models.qwen3, "qk_norm_rotary",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    path, prompts, _ = checkpoint
    model, _ = load_model(str(path))
    steps = [[(i, 0, len(p) - 1) for i, p in enumerate(prompts)],
             [(i, len(p) - 1, len(p)) for i, p in enumerate(prompts)]]
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(models.kernel_choice, "FUSED_ON_CPU", fused)
        cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
        runs.append([run_step(model, cache, prompts, s, is_decode=k == 1)
                     for k, s in enumerate(steps)])
    for step_unfused, step_fused in zip(*runs):
        for i, (a, b) in enumerate(zip(step_unfused, step_fused)):
            assert_close(b, a, f"fused vs unfused, seq {i}")
    assert calls or not model.model.layers[0].self_attn.qk_norm    # llama has no q/k norm


@pytest.mark.parametrize("shape", ["gqa2-hd16-untied", "gqa4-hd64-sharded"])
def test_decode_attention_normalizes_rotates_and_stores_itself(shape, tmp_path_factory,
                                                               monkeypatch):
    """kernel_choice.NORM_ROTARY_IN_ATTENTION_ROWS (Triton backend, interpreter): decode
    steps of that many rows or more leave the q/k norm, rotary and K/V store to the decode
    attention kernel (no qk_norm_rotary launch) and give the logits the separate kernel
    gives, bit for bit, decoding each prompt to its end across page boundaries (3 rows,
    then 2, then 1: the threshold at 2 keeps the last steps apart); both are HF's."""
    import models.kernel_choice
    import models.qwen3
    from kernels.attention import select_backend
    kw = SHAPES[shape]
    path = tiny_qwen3_dir(tmp_path_factory, **kw)
    prompts = random_prompts(kw.get("vocab_size", 389), [5, 13, 22], seed=4)
    refs = hf_logits(path, prompts)
    model, _ = load_model(str(path), attn_backend=select_backend("triton", "cpu"))
    monkeypatch.setattr(models.kernel_choice, "FUSED_ON_CPU", True)
    calls = []
    kernel = models.qwen3.qk_norm_rotary
    monkeypatch.setattr(models.qwen3, "qk_norm_rotary",
                        lambda *a, **kw: calls.append(len(a[0])) or kernel(*a, **kw))
    first = [2, 3, 5]
    runs = []
    for on in (False, True):
        monkeypatch.setattr(models.kernel_choice, "NORM_ROTARY_IN_ATTENTION_ROWS", 2 if on else 0)
        calls.clear()
        cache = PagedKV(model, [len(p) for p in prompts], block_size=4, seed=1)
        runs.append(decode_to_end(model, cache, prompts, first))
        # the prefill's launches (one a layer) and the one-row decode steps', or every
        # decode step's
        steps = [sum(len(p) - n > s for p, n in zip(prompts, first)) for s in range(30)]
        launched = sum(1 for rows in steps if rows and (not on or rows < 2))
        assert len(calls) == model.config.num_hidden_layers * (1 + launched)
    for i, (plain, fused) in enumerate(zip(*runs)):
        assert torch.equal(fused, plain), i
        assert_close(fused, refs[i], f"seq {i}")


@pytest.mark.parametrize("block_size", [4, 8])
def test_chunked_prefill_then_decode_matches_hf(checkpoint, block_size):
    """Prefill in two chunks (the second over a cached prefix), then decode one token per
    step for all sequences at once until each reaches its end, crossing block boundaries."""
    path, prompts, refs = checkpoint
    model, _ = load_model(str(path))
    cache = PagedKV(model, [len(p) for p in prompts], block_size, seed=block_size)
    first, second = [2, 3, 5], [3, 7, 10]
    outs = run_step(model, cache, prompts, [(i, 0, n) for i, n in enumerate(first)])
    for i, ours in enumerate(outs):
        assert_close(ours, refs[i][:first[i]], f"chunk 1 seq {i}")
    outs = run_step(model, cache, prompts, [(i, first[i], n) for i, n in enumerate(second)])
    for i, ours in enumerate(outs):
        assert_close(ours, refs[i][first[i]:second[i]], f"chunk 2 seq {i}")
    pos = list(second)
    steps = 0
    while active := [i for i, p in enumerate(prompts) if pos[i] < len(p)]:
        outs = run_step(model, cache, prompts, [(i, pos[i], pos[i] + 1) for i in active],
                        is_decode=True)
        for i, ours in zip(active, outs):
            assert_close(ours, refs[i][pos[i]:pos[i] + 1], f"decode seq {i} pos {pos[i]}")
            pos[i] += 1
        steps += 1
    assert steps == max(len(p) - n for p, n in zip(prompts, second))


def test_rmsnorm_fused_residual():
    norm = RMSNorm(8)
    norm.weight.data.normal_()
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    y, s = norm(x, r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, norm(x + r))
    xb, rb = x.bfloat16(), r.bfloat16()
    norm.bfloat16()
    yb, sb = norm(xb, rb)
    assert yb.dtype == sb.dtype == torch.bfloat16


class ThreadTPGroup(TPGroup):
    """Collectives between threads of one process: exercises the TP forward math
    (masking, partial sums, gather order) with no process group."""

    def __init__(self, rank: int, size: int, hub: dict) -> None:
        super().__init__(rank, size)
        object.__setattr__(self, "hub", hub)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        hub = self.hub
        hub["slots"][self.rank] = x.clone()
        hub["barrier"].wait()
        parts = list(hub["slots"])
        hub["barrier"].wait()          # nobody overwrites a slot before all have read
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x.copy_(torch.stack(self._exchange(x)).sum(0))
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)


def thread_tp_logits(path, prompts, size: int, **load_kw) -> list[list[torch.Tensor]]:
    """Each rank's prefill logits of the prompts, `size` threads running the TP model over
    ThreadTPGroup collectives (load_kw: load_model's, e.g. quantization)."""
    hub = {"slots": [None] * size, "barrier": threading.Barrier(size)}
    results, errors = [None] * size, []

    def rank_main(rank: int) -> None:
        try:
            model, _ = load_model(str(path), tp=ThreadTPGroup(rank, size, hub), **load_kw)
            cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
            results[rank] = run_step(model, cache, prompts,
                                     [(i, 0, len(p)) for i, p in enumerate(prompts)])
        except BaseException as e:     # surface in the main thread; unblock the peer
            errors.append(e)
            hub["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def test_tp2_forward_matches_hf_with_thread_collectives(checkpoint):
    path, prompts, refs = checkpoint
    size = 2
    if num_kv_heads_of(path) % size:
        with pytest.raises(ValueError, match="num_key_value_heads"):
            load_model(str(path), tp=TPGroup(0, size))
        return
    results = thread_tp_logits(path, prompts, size)
    for rank in range(size):
        for i, (ours, ref) in enumerate(zip(results[rank], refs)):
            assert_close(ours, ref, f"tp rank {rank} seq {i}")


def _gloo_rank(rank: int, size: int, port: int, path: str, prompts, out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        model, _ = load_model(path, tp=TPGroup(rank, size))
        cache = PagedKV(model, [len(p) for p in prompts], block_size=4)
        logits = run_step(model, cache, prompts, [(i, 0, len(p)) for i, p in enumerate(prompts)])
        torch.save(logits, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_tp2_gloo_matches_hf(tmp_path_factory, tmp_path):
    """Real torch.distributed collectives: 2 processes over gloo, each holding half."""
    import torch.multiprocessing as mp
    from services import free_port
    path = tiny_qwen3_dir(tmp_path_factory)
    prompts = random_prompts(389, [6, 11], seed=7)
    refs = hf_logits(path, prompts)
    port = free_port()
    out = str(tmp_path / "logits")
    mp.start_processes(_gloo_rank, args=(2, port, str(path), prompts, out), nprocs=2,
                       start_method="spawn", join=True)
    for rank in range(2):
        for i, (ours, ref) in enumerate(zip(torch.load(f"{out}.{rank}"), refs)):
            assert_close(ours, ref, f"gloo rank {rank} seq {i}")



def hf_logits_fp8_kv(model_dir, prompts: list[torch.Tensor], monkeypatch) -> list[torch.Tensor]:
    """Hugging Face's logits with every key and value rounded as an fp8 KV cache stores
    them (kernels.kv_quant.quantize_ref: per-token scale over the kv heads) right before
    attention reads them: the independent reference of our fp8 path."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from kernels.kv_quant import dequantize_ref, quantize_ref

    def fake_quant(x):                      # [B, Hkv, T, D], one token's heads share a scale
        rows = x[0].transpose(0, 1)         # [T, Hkv, D]
        return dequantize_ref(*quantize_ref(rows), x.dtype).transpose(0, 1)[None]

    for mod in (modeling_qwen3, modeling_llama, modeling_qwen2, modeling_qwen3_moe):
        eager = mod.eager_attention_forward
        monkeypatch.setattr(mod, "eager_attention_forward",
                            lambda m, q, k, v, *a, f=eager, **kw: f(m, q, fake_quant(k),
                                                                     fake_quant(v), *a, **kw))
    return hf_logits(model_dir, prompts)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_fp8_kv_cache_matches_hf_with_fp8_rounded_kv(checkpoint, monkeypatch, fused):
    """Chunked prefill + decode over an fp8 KV cache (torch backend; fused: the q/k
    norm + rotary kernel quantizes and stores K/V) give Hugging Face's logits when HF's
    keys and values are rounded the same way; and those stay near the unquantized logits
    (what e4m3's 3 mantissa bits cost on this tiny random model)."""
    import models.kernel_choice
    monkeypatch.setattr(models.kernel_choice, "FUSED_ON_CPU", fused)
    path, prompts, refs = checkpoint
    fp8_refs = hf_logits_fp8_kv(path, prompts, monkeypatch)
    model, config = load_model(str(path))
    cache = PagedKV(model, [len(p) for p in prompts], 4, seed=3, fp8=True)
    assert cache.kv.dtype == torch.float8_e4m3fn
    ours = torch.cat(decode_to_end(model, cache, prompts, [2, 3, 5]))
    fp8_ref, ref = torch.cat(fp8_refs), torch.cat(refs)
    err = ((ours - fp8_ref).norm() / fp8_ref.norm()).item()
    rel = ((ours - ref).norm() / ref.norm()).item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"fp8 KV: vs HF fp8-rounded {err:.2e}; vs HF {rel:.4f}, greedy agreement {agree:.3f}")
    assert err < 1e-3
    if config.model_type != "qwen3_moe":   # fp8's rounding can flip a token's experts
        assert rel < 0.1 and agree >= 0.85
