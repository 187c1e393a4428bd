"""--deterministic (issue 68) on CPU, in the Triton interpreter: one sequence's logits are
bit-identical (torch.equal) alone, beside random neighbours (batches of 2, 3, 5, 8, some
prefilling while it decodes), after a preemption (its decoded tokens re-prefilled), across
prefill chunk sizes, after a prefix-cache hit, and as a run of rows in one step (the shape
of speculation's verify rows and fast-forward); float32, bf16 with an fp8 KV cache, and FP8
weights. The
same scenarios without the mode must differ somewhere (the mutant checks: else these tests
could not fail).

What the CPU proves: the rules (kernel_choice's GEMM, the attention backend's one kernel
for every row) and the kernels' reduction order as the interpreter runs them (numpy's dot
per tile). On a GPU host, NANOSERVE_GPU_TESTS=1 runs the same tests on CUDA with compiled
kernels and CUDA graphs (tests/gpu/RESULTS.md: all pass on an H200).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels.batch_invariant import invariant_linear, invariant_linear_ref
from kernels.moe_route import route_topk
from models import kernel_choice
from models.parallel import TPGroup
from nanoserve.v1 import worker_pb2
from tiny_checkpoint import tiny_qwen3_dir
from triton_device import DEVICE, needs_triton
from worker_service import loading
from worker_service.model_runner import ModelRunner, RunnerConfig

pytestmark = needs_triton

BS = 16
T = 1                                 # the watched sequence's id
PROMPT_LEN = 80                       # > 64: its keys span two of paged_prefill's tiles
SPLIT_LEN = 64                        # attention's fixed split length here: 80 keys, two splits
# On a GPU host (NANOSERVE_GPU_TESTS=1) the runners run compiled kernels and CUDA graphs (the
# buckets, padding rows included); few graphs, so they capture quickly.
GPU_LIMITS = dict(max_num_seqs=16, max_prefill_graph_tokens=128)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tiny_qwen3_dir(tmp_path_factory)
    r = ModelRunner(RunnerConfig(model_dir=str(path), device=DEVICE, dtype="float32",
                                 attention_backend="auto", kv_cache_gb=0.01,
                                 max_model_len=256, deterministic=True, **GPU_LIMITS))
    r.backend.split_len = SPLIT_LEN   # before init_kv: CUDA graphs freeze it at capture
    r.init_kv(96, BS)
    yield r
    loading.set_deterministic(False, TPGroup())   # the process-wide switch: leave it off


def deterministic(r: ModelRunner, on: bool) -> None:
    """Flip the mode of a loaded runner (both of its switches), for the mutant check."""
    loading.set_deterministic(on, TPGroup())
    r.backend.invariant = on


class Blocks:
    """Block ids handed out in a shuffled order: where a sequence's KV lives must not matter."""

    def __init__(self, seed: int, n: int = 96):
        self.free = list(range(n))
        random.Random(seed).shuffle(self.free)

    def take(self, tokens: int) -> list[int]:
        n = -(-tokens // BS)
        taken, self.free = self.free[:n], self.free[n:]
        return taken


class Stepper:
    """Drives runner.table.plan / runner.forward / commit with explicit token ids (no
    sampling): one StepRequest per call, the sampling rows' logits by sequence id."""

    def __init__(self, runner: ModelRunner):
        self.r, self.step_id, self.live = runner, 0, set()

    def __call__(self, prefills=(), decodes=(), drop=()) -> dict[int, torch.Tensor]:
        """prefills: [(seq_id, tokens, start_pos, block table or None)];
        decodes: [(seq_id, token)]; drop: seq ids forgotten first."""
        self.step_id += 1
        req = worker_pb2.StepRequest(step_id=self.step_id)
        req.drop_seq_ids.extend(drop)
        self.live -= set(drop)
        for seq_id, tokens, start, table in prefills:
            w = req.seqs.add(seq_id=seq_id, num_tokens=len(tokens), start_pos=start,
                             sample=True, reset_block_table=table is not None)
            if table is not None:
                w.block_table_i32 = np.array(table, "<i4").tobytes()
                w.sampling.temperature = 0.0
            self.live.add(seq_id)
        req.token_ids_i32 = np.array([t for p in prefills for t in p[1]], "<i4").tobytes()
        if decodes:
            req.decode.seq_ids_u64 = np.array([d[0] for d in decodes], "<u8").tobytes()
            req.decode.token_ids_i32 = np.array([d[1] for d in decodes], "<i4").tobytes()
        plan = self.r.table.plan(req)
        out = self.r.forward(plan).out
        self.r.table.commit(plan)
        ids = [p[0] for p in prefills] + [d[0] for d in decodes]
        return {s: out[i].clone() for i, s in enumerate(ids)}

    def forget_all(self) -> None:
        for seq_id in self.live:
            self.r.table.drop(seq_id)
        self.live.clear()


def tokens(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def watched(vocab: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(68)
    return tokens(gen, PROMPT_LEN, vocab), tokens(gen, 3, vocab)


def alone(r: ModelRunner) -> list[torch.Tensor]:
    """The watched sequence by itself: its prompt in one prefill, then three decode steps.
    Its trace: the logits after the prompt and after each decoded token."""
    prompt, dec = watched(r.vocab_size)
    s, blocks = Stepper(r), Blocks(0)
    trace = [s(prefills=[(T, prompt, 0, blocks.take(PROMPT_LEN + 3))])[T]]
    trace += [s(decodes=[(T, d)])[T] for d in dec]
    s.forget_all()
    return trace


def beside(r: ModelRunner, batch: int, seed: int) -> list[torch.Tensor]:
    """The same, in steps of `batch` rows: random neighbours (prompts of 1-140 tokens)
    prefill with it and decode with it, the watched row at a random place; one neighbour
    arrives late, prefilling while the watched one decodes."""
    prompt, dec = watched(r.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    s, blocks = Stepper(r), Blocks(seed)
    lens = {100 + i: rnd.randint(1, 140) for i in range(batch - 1)}
    first = [(n, tokens(gen, k, r.vocab_size), 0, blocks.take(k + 4)) for n, k in lens.items()]
    late = first.pop(rnd.randrange(len(first))) if first else None
    first.insert(rnd.randrange(len(first) + 1), (T, prompt, 0, blocks.take(PROMPT_LEN + 3)))
    trace = [s(prefills=first)[T]]
    others = [p[0] for p in first if p[0] != T]
    for i, d in enumerate(dec):
        rows = [(n, rnd.randrange(r.vocab_size)) for n in others]
        rows.insert(rnd.randrange(len(rows) + 1), (T, d))
        prefills = [late] if late is not None and i == 0 else []
        trace.append(s(prefills=prefills, decodes=rows)[T])
        if prefills:
            others.append(late[0])
    s.forget_all()
    return trace


def chunked(r: ModelRunner, sizes: list[int]) -> list[torch.Tensor]:
    """The prompt prefilled in chunks of `sizes` (the last chunk's logits count)."""
    prompt, dec = watched(r.vocab_size)
    assert sum(sizes) == PROMPT_LEN
    s, blocks = Stepper(r), Blocks(sum(sizes[:2]))
    table, start = blocks.take(PROMPT_LEN + 3), 0
    for n in sizes:
        out = s(prefills=[(T, prompt[start:start + n], start, table if start == 0 else None)])
        start += n
    trace = [out[T]] + [s(decodes=[(T, d)])[T] for d in dec]
    s.forget_all()
    return trace


def preempted(r: ModelRunner) -> list[torch.Tensor]:
    """Decoded once, preempted (dropped, its blocks gone), resumed by a prefill of prompt +
    the decoded token into other blocks, then decoded on. The resumed prefill's last
    logits are the decode step's it recomputes."""
    prompt, dec = watched(r.vocab_size)
    s, blocks = Stepper(r), Blocks(5)
    first = s(prefills=[(T, prompt, 0, blocks.take(PROMPT_LEN + 3))])[T]
    decoded = s(decodes=[(T, dec[0])])[T]
    again = s(drop=[T], prefills=[(T, prompt + dec[:1], 0, blocks.take(PROMPT_LEN + 3))])[T]
    assert torch.equal(again, decoded), "a re-prefilled position differs from its decode step"
    trace = [first, again] + [s(decodes=[(T, d)])[T] for d in dec[1:]]
    s.forget_all()
    return trace


def prefix_hit(r: ModelRunner) -> list[torch.Tensor]:
    """Another sequence computed the prompt's first 48 tokens (three whole blocks); the
    watched one takes those blocks and prefills only its suffix."""
    prompt, dec = watched(r.vocab_size)
    s, blocks = Stepper(r), Blocks(7)
    donor = blocks.take(48 + 10)
    s(prefills=[(50, prompt[:48] + tokens(torch.Generator().manual_seed(1), 10, r.vocab_size),
                 0, donor)])
    table = donor[:3] + blocks.take(PROMPT_LEN + 3 - 48)
    trace = [s(prefills=[(T, prompt[48:], 48, table)], drop=[50])[T]]
    trace += [s(decodes=[(T, d)])[T] for d in dec]
    s.forget_all()
    return trace


def verify_rows(r: ModelRunner) -> list[torch.Tensor]:
    """Two decoded tokens as one step's run of two rows that both sample: the shape of
    speculation's verify rows and of fast-forward (DecodeBatch.num_tokens / num_samples)."""
    prompt, dec = watched(r.vocab_size)
    s, blocks = Stepper(r), Blocks(11)
    trace = [s(prefills=[(T, prompt, 0, blocks.take(PROMPT_LEN + 3))])[T]]
    req = worker_pb2.StepRequest(step_id=99)
    req.decode.seq_ids_u64 = np.array([T], "<u8").tobytes()
    req.decode.token_ids_i32 = np.array(dec[:2], "<i4").tobytes()
    req.decode.num_tokens_i32 = np.array([2], "<i4").tobytes()
    req.decode.num_samples_i32 = np.array([2], "<i4").tobytes()
    plan = r.table.plan(req)
    out = r.forward(plan).out
    r.table.commit(plan)
    trace += [out[0].clone(), out[1].clone(), s(decodes=[(T, dec[2])])[T]]
    s.forget_all()
    return trace


SCENARIOS = {
    **{f"batch{n}": (lambda r, n=n: beside(r, n, seed=n)) for n in (2, 3, 5, 8)},
    "chunks_16_64": lambda r: chunked(r, [16, 64]),
    "chunks_33_7_40": lambda r: chunked(r, [33, 7, 40]),
    "preempted": preempted,
    "prefix_hit": prefix_hit,
    "verify_rows": verify_rows,
}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_logits_are_bit_identical(runner, name):
    deterministic(runner, True)
    ref = alone(runner)
    got = SCENARIOS[name](runner)
    diff = [i for i, (x, y) in enumerate(zip(ref, got)) if not torch.equal(x, y)]
    assert not diff, f"{name}: steps {diff} differ from the sequence alone " \
                     f"(max |d| {max((ref[i] - got[i]).abs().max().item() for i in diff):.3g})"


def bf16_runner(tmp_path_factory, quantization: str) -> ModelRunner:
    """bf16 activations, an fp8 KV cache (e4m3 + a scale per slot); quantization="fp8":
    FP8 weights too (e4m3, a scale per output channel)."""
    path = tiny_qwen3_dir(tmp_path_factory)
    r = ModelRunner(RunnerConfig(model_dir=str(path), device=DEVICE, dtype="bfloat16",
                                 kv_cache_dtype="fp8", quantization=quantization,
                                 attention_backend="auto", kv_cache_gb=0.01, max_model_len=256,
                                 deterministic=True, **GPU_LIMITS))
    r.backend.split_len = SPLIT_LEN   # before init_kv: CUDA graphs freeze it at capture
    r.init_kv(96, BS)
    return r


@pytest.fixture(scope="module")
def bf16_fp8kv(tmp_path_factory):
    yield bf16_runner(tmp_path_factory, "none")
    loading.set_deterministic(False, TPGroup())


@pytest.mark.parametrize("name", ["batch5", "chunks_33_7_40", "preempted", "prefix_hit"])
def test_bf16_with_an_fp8_kv_cache(bf16_fp8kv, name):
    deterministic(bf16_fp8kv, True)
    assert same(alone(bf16_fp8kv), SCENARIOS[name](bf16_fp8kv))


def test_bf16_without_the_mode_differs(bf16_fp8kv):
    """The mutant of the above: a batch of five changes the watched row's bits."""
    deterministic(bf16_fp8kv, False)
    try:
        assert not same(alone(bf16_fp8kv), SCENARIOS["batch5"](bf16_fp8kv))
    finally:
        deterministic(bf16_fp8kv, True)


def test_fp8_weights(tmp_path_factory):
    """FP8 weights take the invariant GEMM weight-only. No mutant here: without the mode
    these scenarios agree on CPU too (each GEMM quantizes its input rows to e4m3 per token,
    which absorbs the attention's last-bit differences), so this guards the mode's path for
    e4m3 weights; the GEMM's own row check is test_gemm_rows_do_not_see_each_other."""
    r = bf16_runner(tmp_path_factory, "fp8")
    try:
        ref = alone(r)
        for name in ("batch5", "preempted"):
            assert same(ref, SCENARIOS[name](r)), name
    finally:
        loading.set_deterministic(False, TPGroup())


def test_without_the_mode_something_differs(runner):
    """The mutant: with the switches off (F.linear on CPU, whose blocking follows the row
    count; the decode kernel's tiles for decode rows), some scenario's logits differ from
    the sequence alone, so the tests above can fail."""
    deterministic(runner, False)
    try:
        ref = alone(runner)
        differ = [n for n in ("batch3", "preempted", "chunks_33_7_40")
                  if not same(ref, SCENARIOS[n](runner))]
    except AssertionError as e:   # preempted's own check
        differ = [str(e)]
    finally:
        deterministic(runner, True)
    assert differ


def test_runner_reports_and_refuses(runner, tmp_path_factory):
    assert runner.config.deterministic and runner.backend.invariant
    path = tiny_qwen3_dir(tmp_path_factory)
    with pytest.raises(ValueError, match="triton attention backend"):
        ModelRunner(RunnerConfig(model_dir=str(path), attention_backend="torch",
                                 deterministic=True))
    with pytest.raises(ValueError, match="small-batch-kernel"):
        loading.set_deterministic(True, TPGroup(), "persistent")
    with pytest.raises(ValueError, match="TP=1"):
        loading.set_deterministic(True, TPGroup(rank=0, size=2))
    deterministic(runner, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_do_not_see_each_other(dtype):
    """Alone, in a few rows and beside many: on a GPU 600 rows, 65 and 8 take three tile
    configs (batch_invariant.tiles), so the rows' bits must not depend on the config either."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 130, generator=gen).to(dtype)
    b = torch.randn(200, generator=gen).to(dtype)
    x = torch.randn(600, 130, generator=gen).to(dtype)
    w, b, x = w.to(DEVICE), b.to(DEVICE), x.to(DEVICE)
    full = invariant_linear(x, w, None, b)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(full, invariant_linear_ref(x, w, None, b), **tol)
    for rows in (1, 2, 3, 5, 8, 65, 300):
        assert torch.equal(invariant_linear(x[3:3 + rows], w, None, b), full[3:3 + rows])
    wq, sc = w.float().to(torch.float8_e4m3fn), torch.rand(200, 1, generator=gen).to(DEVICE)
    fp8 = invariant_linear(x, wq, sc)
    torch.testing.assert_close(fp8, invariant_linear_ref(x, wq, sc), **tol)
    assert all(torch.equal(invariant_linear(x[:n], wq, sc), fp8[:n]) for n in (1, 5))


def test_kernel_choice_rule():
    for rows in (1, 2, 64):
        p = kernel_choice.decide(True, rows, True, False, 1, False, True)
        assert p.invariant and not p.gemv and not p.gated_linear
    assert kernel_choice.decide(True, 1, True, False, 1, False).gemv


def test_moe_routing_ties_go_to_the_lower_expert_in_any_batch():
    """Tied logits pick the lower expert id, and a row's choice and weights do not depend
    on the rows routed with it (one program per 16 rows, each row alone in registers)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 16, generator=gen)
    logits[5] = 0.25                                   # all 16 experts tied
    logits[9, [2, 7, 11]] = 9.0                        # a three-way tie at the top
    logits = logits.to(DEVICE)
    w, ids = route_topk(logits, 4, True)
    assert ids[5].tolist() == [0, 1, 2, 3]
    assert ids[9, :3].tolist() == [2, 7, 11]
    for lo, n in ((5, 1), (9, 1), (3, 20)):
        w2, ids2 = route_topk(logits[lo:lo + n].contiguous(), 4, True)
        assert torch.equal(ids2, ids[lo:lo + n]) and torch.equal(w2, w[lo:lo + n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_attention_one_row_two_ways(dtype):
    """paged_prefill with a fixed split length: a decode step's splits as parallel programs
    (more than its longest context needs: empty splits are no-ops) give the bits of the
    same rows walking their splits in turn, and both the reference's values. (fp16, not
    bf16: the interpreter's tl.dot has no bf16, kernels/interpret.py.)"""
    from kernels.attention import paged_attention_ref
    from kernels.backend_choice import AttentionShapes, make_step
    from kernels.paged_attention import paged_prefill
    shapes = AttentionShapes(num_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=16)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for seqs in ([(200, 1), (70, 1), (1, 1), (64, 1)], [(200, 130), (70, 70), (65, 1)]):
        st = make_step(shapes, seqs, torch.device(DEVICE))
        m = st["meta"]
        args = (st["q"], st["k_cache"], st["v_cache"], m.block_tables, m.context_lens,
                m.cu_seqlens_q, m.max_seqlen_q, st["scale"])
        walked = paged_prefill(*args, split_len=64)
        ref = paged_attention_ref(st["q"], st["k_cache"], st["v_cache"], m, st["scale"])
        torch.testing.assert_close(walked, ref, **tol)
        if m.is_decode:
            assert torch.equal(paged_prefill(*args, split_len=64, parallel_splits=5), walked)
