"""Penalties and top_logprobs on the GPU path: the device-side history under CUDA graphs
and overlapped steps (placeholder inputs: the worker counts its own samples).

  * the fused Gumbel-max sampling kernels on CUDA vs their torch reference, and compiled
    at startup;
  * the fused Triton penalties kernel on CUDA vs the torch reference on CPU (float32;
    bit-exact with only a repetition penalty, within 1e-5 with presence/frequency, where
    the GPU may fuse a multiply-add);
  * the decode graphs' own sampling (the usual step's ids drawn in the replay) against the
    sampler's from the same logits, greedy and seeded rows;
  * a ModelRunner on CUDA (CUDA graphs on, Triton attention, float32 tiny Qwen3) driven like
    the scheduler drives it: one prefill, then packed decode steps whose inputs are all
    placeholders, step N+1 launched before step N is finished. A penalized row must match
    HF `generate(repetition_penalty=...)`, an unpenalized row in the same batch plain
    greedy, a row with a logit_bias HF's greedy with the bias added, a row under min_tokens
    (ids < BANNED not sampled for the first MIN_TOKENS tokens) greedy with those ids at
    -inf until then, and the penalized row's top_logprobs HF's log_softmax top-k.

    NANOSERVE_GPU_TESTS=1 pytest -m gpu tests/gpu/test_sampling_gpu.py
    python tests/gpu/test_sampling_gpu.py [cpu]     # standalone (cpu: the same on CPU)
"""
from __future__ import annotations

import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "protos")]   # standalone runs

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="TRITON_INTERPRET=1: run with NANOSERVE_GPU_TESTS=1")]

BLOCK, STEPS, PENALTY, K = 16, 40, 1.5, 3
BIAS = {17: 2.0, 250: 1.5, 33: -1.0}   # logit_bias of the third row
BANNED, MIN_TOKENS = 200, STEPS // 2   # the fourth row's min_tokens: ids < 200 wait 20 tokens


def penalties_cuda_vs_cpu() -> tuple[float, float]:
    """max |kernel on CUDA - reference on CPU|: (repetition only, all three penalties)."""
    from kernels.penalties import apply_penalties_, apply_penalties_ref
    g = torch.Generator().manual_seed(0)
    n, s, v = 64, 80, 151936
    logits = torch.randn(n, v, generator=g) * 4
    mask = torch.rand(s, v, generator=g) < 0.01
    counts = ((torch.rand(s, v, generator=g) < 0.01).int()
              * torch.randint(1, 5, (s, v), generator=g, dtype=torch.int32))
    rows, slots = torch.randperm(n, generator=g)[:48], torch.randperm(s, generator=g)[:48]
    rep = torch.rand(48, generator=g) + 0.5
    errs = []
    for pres, freq in ((torch.zeros(48), torch.zeros(48)),
                       (torch.rand(48, generator=g) * 4 - 2, torch.rand(48, generator=g) * 4 - 2)):
        ref = apply_penalties_ref(logits[rows], mask[slots], counts[slots], rep, pres, freq)
        out = apply_penalties_(*(t.cuda() for t in (logits.clone(), rows, slots, mask, counts, rep,
                                                    pres, freq)))
        errs.append(float((out.cpu()[rows] - ref).abs().max()))
    return errs[0], errs[1]


def overlapped_runner(device: str) -> dict:
    """Drive a ModelRunner through overlapped placeholder decode steps; HF references."""
    import transformers
    from nanoserve.v1 import worker_pb2
    from tiny_checkpoint import make_tiny_qwen3
    from worker_service.model_runner import ModelRunner, RunnerConfig
    path = make_tiny_qwen3(tempfile.mkdtemp(prefix="ns-sampling-"), vocab_size=389, seed=11)
    runner = ModelRunner(RunnerConfig(model_dir=str(path), device=device, dtype="float32",
                                      attention_backend="auto", gpu_memory_utilization=0.5,
                                      max_num_seqs=8))
    per_seq = 4
    prompts = [[5, 9, 5, 9, 5, 9, 17, 30], [3, 4, 5, 6, 7], [8, 9, 10], [12, 13, 14, 15]]
    runner.init_kv(len(prompts) * per_seq, BLOCK)
    first = worker_pb2.StepRequest(step_id=1)
    for i, p in enumerate(prompts):
        w = first.seqs.add(seq_id=i, num_tokens=len(p), start_pos=0, sample=True,
                           reset_block_table=True,
                           block_table_i32=np.arange(i * per_seq, (i + 1) * per_seq, dtype="<i4").tobytes())
        w.sampling.temperature = 0.0
        if i == 0:
            w.sampling.repetition_penalty = PENALTY
            w.sampling.logprobs = True
            w.sampling.top_logprobs = K
            w.prompt_ids_i32 = np.array(p, "<i4").tobytes()
        if i == 2:
            w.sampling.logit_bias_ids_i32 = np.array(list(BIAS), "<i4").tobytes()
            w.sampling.logit_bias_f32 = np.array(list(BIAS.values()), "<f4").tobytes()
        if i == 3:
            w.sampling.banned_ids_i32 = np.arange(BANNED, dtype="<i4").tobytes()
            w.sampling.banned_until = len(p) + MIN_TOKENS
    first.token_ids_i32 = np.array(sum(prompts, []), "<i4").tobytes()
    pending = [runner.launch(first)]
    answers = []
    for step in range(2, STEPS + 1):   # inputs are all placeholders; launch before finishing
        req = worker_pb2.StepRequest(step_id=step)
        req.decode.seq_ids_u64 = np.arange(len(prompts), dtype="<u8").tobytes()
        pending.append(runner.launch(req))
        answers.append(runner.finish(pending.pop(0)))
    answers.append(runner.finish(pending.pop(0)))
    ids = np.array([np.frombuffer(a.sampled_token_ids_i32, "<i4") for a in answers])   # [steps, 4]
    rows = len(prompts)
    top_ids = np.array([np.frombuffer(a.top_token_ids_i32, "<i4").reshape(rows, -1)[0] for a in answers])
    top_lps = np.array([np.frombuffer(a.top_logprobs_f32, "<f4").reshape(rows, -1)[0] for a in answers])
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()

    def generate(prompt, **kw):
        out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=STEPS,
                          min_new_tokens=STEPS, do_sample=False, **kw,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device))
        return out[0, len(prompt):].tolist()

    ref0 = generate(prompts[0], repetition_penalty=PENALTY)
    with torch.no_grad():
        full = torch.tensor([prompts[0] + ids[:, 0].tolist()], device=device)
        raw = torch.log_softmax(hf(full).logits[0, len(prompts[0]) - 1:-1].float(), -1)
    ref_vals, ref_top = raw.topk(K, dim=-1)

    @torch.no_grad()
    def biased_greedy(prompt, bias=BIAS, banned=0):   # logit_bias and min_tokens written out
        seq = list(prompt)
        for step in range(STEPS):
            logits = hf(torch.tensor([seq], device=device)).logits[0, -1].float()
            for t, b in bias.items():
                logits[t] += b
            if step < MIN_TOKENS:
                logits[:banned] = float("-inf")
            seq.append(int(logits.argmax()))
        return seq[len(prompt):]

    return dict(penalized=ids[:, 0].tolist(), penalized_ref=ref0,
                plain=ids[:, 1].tolist(), plain_ref=generate(prompts[1]),
                biased=ids[:, 2].tolist(), biased_ref=biased_greedy(prompts[2]),
                unbiased_ref=generate(prompts[2]),
                min_tokens=ids[:, 3].tolist(), min_tokens_ref=biased_greedy(prompts[3], {}, BANNED),
                no_min_tokens_ref=generate(prompts[3]),
                unpenalized_ref=generate(prompts[0]),
                top_ids_equal=bool((top_ids == ref_top.cpu().numpy()).all()),
                top_err=float(np.abs(top_lps - ref_vals.cpu().numpy()).max()),
                graphs=len(runner.executors) > 1)


def test_penalties_kernel_cuda_vs_reference():
    rep_only, all_three = penalties_cuda_vs_cpu()
    assert rep_only == 0.0 and all_three < 1e-5


def test_penalties_kernel_compiled_before_the_first_penalized_request():
    """PenaltyState compiles the kernel when the worker starts (its blank-row call has a
    real step's specialization), so a penalized request never waits on the compiler."""
    from kernels.penalties import _penalties_kernel
    from worker_service.penalties import PenaltyState
    from worker_service.step_plan import SamplingParams
    dev = torch.device("cuda", torch.cuda.current_device())
    _penalties_kernel.device_caches.clear()   # forget what earlier tests compiled
    compiled = lambda: len(_penalties_kernel.device_caches[dev.index][0])   # noqa: E731
    state = PenaltyState(151936, dev)
    assert compiled() == 1
    state.add(5, np.array([1, 2, 3], dtype="<i4"), np.array([4], dtype="<i4"))
    params = [SamplingParams(repetition_penalty=1.5)]
    pr = state.rows([5], params)
    state.apply(torch.randn(3, 151936, device=dev), pr)
    torch.cuda.synchronize()
    assert compiled() == 1   # the real call found the startup compile


def fused_sampling_cuda_vs_reference(n: int = 131, v: int = 151936) -> dict:
    """The fused Gumbel-max kernels on CUDA at a decode step's shape (bf16 logits, Qwen3's
    vocab, temperature 0.6 with a few greedy rows) against the torch reference fed the
    kernel's own noise; the variants without logprobs or without noise."""
    from kernels.sampling import gumbel_sample, gumbel_sample_ref
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, v, device="cuda", generator=g) * 3).bfloat16()
    temps = torch.full((n,), 0.6, device="cuda")
    temps[:8] = 0.0
    seeds = torch.randint(0, 2**31 - 1, (n,), device="cuda", generator=g, dtype=torch.int32)
    tokens, lps, u = gumbel_sample(logits, temps, seeds, return_uniform=True)
    ref_tokens, ref_lps = gumbel_sample_ref(logits, temps, u)
    zero = torch.zeros_like(temps)
    return dict(tokens_equal=bool(torch.equal(tokens, ref_tokens)),
                lp_err=float((lps - ref_lps).abs().max()),
                no_logprobs_same=bool(torch.equal(gumbel_sample(logits, temps, seeds, logprobs=False)[0], tokens)),
                greedy_is_argmax=bool(torch.equal(gumbel_sample(logits, zero, seeds, greedy=True)[0],
                                                  logits.argmax(-1))),
                sampled_rows_differ_from_argmax=int((tokens[8:] != logits[8:].argmax(-1)).sum()))


def test_fused_sampling_cuda_vs_reference():
    r = fused_sampling_cuda_vs_reference()
    assert r["tokens_equal"] and r["lp_err"] < 1e-3
    assert r["no_logprobs_same"] and r["greedy_is_argmax"]
    assert r["sampled_rows_differ_from_argmax"] > 0   # temperature 0.6 does sample


def test_fused_sampling_compiled_before_the_first_request():
    """The worker compiles every variant of the sampling kernels at startup (bf16 logits
    and float32 penalized ones, logprobs or not, greedy or not, one row (PDL) or more):
    real steps of any batch size then find them compiled."""
    from kernels.sampling import _gumbel_chunk_kernel, _gumbel_merge_kernel, gumbel_sample
    from worker_service.sampler import compile_fused_sampling
    dev = torch.device("cuda", torch.cuda.current_device())
    kernels = (_gumbel_chunk_kernel, _gumbel_merge_kernel)
    for k in kernels:
        k.device_caches.clear()   # forget what earlier tests compiled
    compiled = lambda: [len(k.device_caches[dev.index][0]) for k in kernels]   # noqa: E731
    from kernels import pdl
    variants = [16, 8] if pdl.enabled(dev) else [8, 4]   # (PDL: one row's launches apart)
    compile_fused_sampling(151936, torch.bfloat16, dev)
    assert compiled() == variants
    for n in (1, 3, 4, 131, 256):
        for dtype in (torch.bfloat16, torch.float32):
            logits = torch.randn(n, 151936, device=dev).to(dtype)
            temps = torch.rand(n, device=dev)
            seeds = torch.randint(0, 2**31 - 1, (n,), device=dev, dtype=torch.int32)
            for logprobs in (False, True):
                gumbel_sample(logits, temps, seeds, logprobs=logprobs)
                gumbel_sample(logits, temps * 0, seeds, logprobs=logprobs, greedy=True)
    torch.cuda.synchronize()
    assert compiled() == variants


def graph_sampling_vs_sampler() -> dict:
    """Decode steps of three rows (greedy; seeded, temperature 0.8 and 1.2) through the
    runner's CUDA graphs, which sample the usual step in their replay (DecodeGraphs'
    sample): their ids against sample_plan's from the same logits, each step's inputs the
    placeholders of the one before."""
    from nanoserve.v1 import worker_pb2
    from tiny_checkpoint import make_tiny_qwen3
    from worker_service.executors import run
    from worker_service.logits_processors import graph_sampling, sample_plan
    from worker_service.model_runner import ModelRunner, RunnerConfig
    path = make_tiny_qwen3(tempfile.mkdtemp(prefix="ns-graph-sampling-"), vocab_size=389, seed=5)
    r = ModelRunner(RunnerConfig(model_dir=str(path), device="cuda", dtype="float32",
                                 gpu_memory_utilization=0.5, max_num_seqs=8))
    r.init_kv(12, BLOCK)
    first = worker_pb2.StepRequest(step_id=1)
    for i, (temp, seed) in enumerate(((0.0, 0), (0.8, 3), (1.2, 4))):
        w = first.seqs.add(seq_id=i, num_tokens=4, start_pos=0, sample=True, reset_block_table=True,
                           block_table_i32=np.arange(4 * i, 4 * i + 4, dtype="<i4").tobytes())
        w.sampling.temperature = temp
        w.sampling.seed, w.sampling.has_seed = seed, temp > 0
    first.token_ids_i32 = np.arange(3, 15, dtype="<i4").tobytes()
    r.finish(r.launch(first))
    graph, sampler, argmax = [], [], []
    for step_id in range(2, STEPS):
        req = worker_pb2.StepRequest(step_id=step_id)
        req.decode.seq_ids_u64 = np.arange(3, dtype="<u8").tobytes()
        plan = r.table.plan(req)
        step = r.inputs(plan)
        step.sampling = graph_sampling(plan, r.vocab_size, r.penalties, r.grammar, None)
        fwd = run(r.executors, step)
        assert fwd.tokens is not None, "the decode graph was meant to sample"
        graph.append(fwd.tokens.tolist())
        sampler.append(sample_plan(fwd.out, plan, r.vocab_size, None, None).tokens.tolist())
        argmax.append(fwd.out.argmax(-1).tolist())
        r.table.commit(plan)
        r.last_sampled = fwd.tokens.clone()
    return dict(equal=graph == sampler, greedy_row=[g[0] for g in graph] == [a[0] for a in argmax],
                sampled_not_argmax=sum(g[i] != a[i] for g, a in zip(graph, argmax) for i in (1, 2)))


def test_decode_graphs_sample_as_the_sampler_does():
    r = graph_sampling_vs_sampler()
    assert r["equal"] and r["greedy_row"]
    assert r["sampled_not_argmax"] > 0   # the seeded rows do sample


def test_overlapped_cuda_graph_steps_match_hf():
    r = overlapped_runner("cuda")
    assert r["graphs"], "CUDA graphs were meant to be on"
    assert r["penalized"] == r["penalized_ref"] != r["unpenalized_ref"]
    assert r["plain"] == r["plain_ref"]
    assert r["biased"] == r["biased_ref"] != r["unbiased_ref"]
    assert r["min_tokens"] == r["min_tokens_ref"] != r["no_min_tokens_ref"]
    assert r["top_ids_equal"] and r["top_err"] < 1e-4


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    if dev == "cuda":
        rep_only, all_three = penalties_cuda_vs_cpu()
        print(f"penalties kernel max |cuda - cpu ref|: repetition only {rep_only:g}, "
              f"all three {all_three:g}")
        print(f"fused sampling vs reference, 131 x 151936 bf16: {fused_sampling_cuda_vs_reference()}")
        print(f"decode graphs' own sampling vs the sampler: {graph_sampling_vs_sampler()}")
    r = overlapped_runner(dev)
    print(f"device {dev}, CUDA graphs {r['graphs']}: penalized row == HF generate(repetition_penalty"
          f"={PENALTY}): {r['penalized'] == r['penalized_ref']} (differs from plain greedy: "
          f"{r['penalized'] != r['unpenalized_ref']}); plain row == HF greedy: "
          f"{r['plain'] == r['plain_ref']}; logit_bias row == HF greedy with the bias added: "
          f"{r['biased'] == r['biased_ref']} (differs from plain greedy: "
          f"{r['biased'] != r['unbiased_ref']}); min_tokens row == HF greedy with ids < {BANNED} "
          f"at -inf for {MIN_TOKENS} tokens: {r['min_tokens'] == r['min_tokens_ref']} (differs "
          f"from plain greedy: {r['min_tokens'] != r['no_min_tokens_ref']}); "
          f"top-{K} ids equal: {r['top_ids_equal']}, "
          f"max |logprob err| {r['top_err']:.2e}")
