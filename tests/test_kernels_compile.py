"""Every Triton kernel launch of a few CPU scenarios compiles for an H100/H200 (sm_90), on
this CPU machine: the compile errors the interpreter hides fail here.

Why: the CPU tests run the kernels in Triton's interpreter, which executes their Python
source with Python's semantics, so code the real compiler rejects passes there (found on a
GPU: a `tl.constexpr` branch that `return`ed and a later statement using a name that only
the other branches define: fine in the interpreter, a NameError when compiled, and a
--deterministic worker could not start). triton.compile needs no GPU for a GPUTarget: it
runs the frontend, the MLIR passes and ptxas (bundled with Triton).

How: the scenarios below run under TRITON_INTERPRET=1 with every interpreted launch
recorded (InterpretedFunction.run wrapped: the kernel, its bound arguments with defaults
applied, its launch options such as num_warps). The records go, as plain data, to a
subprocess without TRITON_INTERPRET (there @triton.jit makes real JITFunctions, and
kernels/interpret.py's INTERPRET is False, as on a GPU), which types and specializes each
launch's arguments with Triton's own launch binder for the sm_90 backend (tensors ->
"*bf16"..., ints -> i32/i64 or constexpr 1, 16-byte alignment / divisibility as a GPU
launch would see them), dedupes, and compiles each unique kernel configuration.

What GPU-shaped means here: the model path is steered to the kernels the CUDA path takes
(models/kernel_choice.paths answers as for a CUDA tensor; the Triton attention backend),
the interpreter-only constexpr RNE_BF16 is compiled as a GPU launch passes it (False), and
a launch that would use PDL on a GPU (kernels/pdl.launch's rows <= MAX_ROWS) is compiled
with PDL=True and launch_pdl, as there.

Skipped where Triton is not interpreting (NANOSERVE_GPU_TESTS=1: the GPU tests compile
every kernel for real anyway)."""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TARGET = ("cuda", 90, 32)           # GPUTarget: H100 / H200
SHARED_MEMORY = 232448              # bytes of shared memory a program may take on sm_90
# constexprs the interpreter gets a value for that a GPU launch never passes
GPU_CONSTEXPRS = {"RNE_BF16": False}
ROOT = Path(__file__).resolve().parent.parent
BS = 16                             # KV block size of the runners
# kernels the scenarios must reach (a scenario that silently stopped launching one, e.g.
# after a kernel_choice change, would otherwise shrink what this test checks)
EXPECTED = {
    "kernels.paged_attention._prefill_kernel", "kernels.paged_attention._decode_kernel",
    "kernels.paged_attention._split_merge_kernel", "kernels.rmsnorm._rms_norm_kernel",
    "kernels.paged_attention._decode_merge_kernel",
    "kernels.qk_norm_rotary._qk_norm_rotary_kernel", "kernels.activation._silu_and_mul_kernel",
    "kernels.gemv._gemv_kernel", "kernels.batch_invariant._matmul_kernel",
    "kernels.persistent_decode._decode_kernel", "kernels.sampling._gumbel_chunk_kernel",
    "kernels.sampling._gumbel_merge_kernel", "kernels.quant_linear._quant_gemv_kernel",
    "kernels.quant_linear._quant_gemm_kernel", "kernels.moe_route._route_kernel",
    "kernels.fused_moe._align_kernel", "kernels.fused_moe._gate_up_silu_kernel",
    "kernels.fused_moe._down_weighted_kernel", "kernels.rotary._rotary_kernel",
    "kernels.store_kvcache._store_kvcache_kernel", "kernels.penalties._penalties_kernel",
    "kernels.grammar_mask._token_bitmask_kernel", "kernels.lora._shrink_kernel",
    "kernels.lora._expand_kernel", "kernels.fp8_linear._quantize_rows_kernel",
    "kernels.small_m._small_m_kernel",
}


# --- recording (the test process, interpreter) --------------------------------------------

def _encode(value, where: str):
    """A kernel argument as JSON: tensors by dtype and alignment (all a launch's typing
    reads of them), Python scalars as themselves, Triton dtypes and JIT functions by name."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, torch.Tensor):
        return {"ptr": str(value.dtype).removeprefix("torch."), "offset": value.data_ptr() % 16}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tl.dtype):
        return {"tl": value.name}
    if isinstance(value, InterpretedFunction):
        return {"jit": f"{value.fn.__module__}:{value.fn.__qualname__}"}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, where) for v in value]}
    raise TypeError(f"{where}: cannot record an argument of type {type(value).__name__}")


@contextlib.contextmanager
def recording(records: list):
    """Record each interpreted kernel launch as {kernel, args, options} (appended)."""
    import kernels.pdl
    from triton.runtime.interpreter import InterpretedFunction
    run, launch = InterpretedFunction.run, kernels.pdl.launch

    def pdl_launch(device, rows):   # as on a Hopper GPU: PDL where rows allow it
        return {"PDL": False, "_gpu_pdl": rows <= kernels.pdl.MAX_ROWS}

    def recorded(self, *args, grid, warmup, **kwargs):
        gpu_pdl = kwargs.pop("_gpu_pdl", False)
        fn = self.fn
        name = f"{fn.__module__}.{fn.__qualname__}"
        params = inspect.signature(fn).parameters
        options = {k: v for k, v in kwargs.items() if k not in params}
        bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items()
                                                   if k in params})
        bound.apply_defaults()
        values = dict(bound.arguments)
        for k, v in GPU_CONSTEXPRS.items():
            if k in values:
                values[k] = v
        if gpu_pdl and "PDL" in values:
            values["PDL"], options["launch_pdl"] = True, True
        records.append({"kernel": name, "module": fn.__module__, "qualname": fn.__qualname__,
                        "args": {k: _encode(v, f"{name}({k})") for k, v in values.items()},
                        "options": {k: _encode(v, name) for k, v in options.items()}})
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run, kernels.pdl.launch = recorded, pdl_launch
    try:
        yield records
    finally:
        InterpretedFunction.run, kernels.pdl.launch = run, launch


@contextlib.contextmanager
def gpu_paths():
    """models/kernel_choice answers as for CUDA tensors (the Triton norms, rotary, fused
    kernels, GEMV, MoE kernels), and the sampler takes its fused kernels."""
    import kernels.gemv
    from models import kernel_choice
    paths, fused_on_cpu = kernel_choice.paths, kernel_choice.FUSED_ON_CPU

    def cuda_paths(x):
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        return kernel_choice.decide(True, rows, kernel_choice.FUSED, True,
                                    kernels.gemv.GEMV_MAX_TOKENS, True,
                                    kernel_choice.DETERMINISTIC, kernel_choice.NORM_IN_GEMV,
                                    kernel_choice.SMALL_M_MAX_ROWS)

    kernel_choice.paths, kernel_choice.FUSED_ON_CPU = cuda_paths, True
    try:
        yield
    finally:
        kernel_choice.paths, kernel_choice.FUSED_ON_CPU = paths, fused_on_cpu


def _prefill(runner, step: int, prompts: dict[int, int]) -> None:
    """One step prefilling each sequence's prompt of prompts[seq] tokens (the first one
    greedy, the others sampled: the fused sampling kernels), blocks from 31 down."""
    from nanoserve.v1 import worker_pb2
    req = worker_pb2.StepRequest(step_id=step)
    tokens, block = [], 31
    for i, (seq_id, n) in enumerate(prompts.items()):
        blocks = list(range(block, block - (n // BS + 1), -1))
        block -= len(blocks) + 1
        w = req.seqs.add(seq_id=seq_id, num_tokens=n, start_pos=0, sample=True,
                         reset_block_table=True, block_table_i32=np.array(blocks, "<i4").tobytes())
        w.sampling.temperature = 0.0 if i == 0 else 0.8
        w.sampling.has_seed, w.sampling.seed = True, 7
        tokens += [5 + (seq_id * 7 + j) % 300 for j in range(n)]
    req.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    runner.step(req)


def _decode(runner, step: int, seq_ids: list[int]) -> None:
    from nanoserve.v1 import worker_pb2
    req = worker_pb2.StepRequest(step_id=step)
    req.decode.seq_ids_u64 = np.array(seq_ids, "<u8").tobytes()
    req.decode.token_ids_i32 = np.array([3 + s for s in seq_ids], "<i4").tobytes()
    runner.step(req)


def serve(path: Path, prompt: int = 20, split_len: int | None = None, **config) -> None:
    """A bf16 runner on the Triton attention backend: one step prefilling two sequences
    (`prompt` tokens, 3 tokens), a decode step of both, one of one sequence (batch 1: PDL)."""
    from worker_service.model_runner import ModelRunner, RunnerConfig
    r = ModelRunner(RunnerConfig(model_dir=str(path), device="cpu", dtype="bfloat16",
                                 attention_backend="triton", kv_cache_gb=0.01,
                                 max_model_len=128, **config))
    if split_len:
        r.backend.split_len = split_len   # before init_kv: CUDA graphs freeze it at capture
    r.init_kv(32, BS)
    _prefill(r, 1, {1: prompt, 2: 3})
    _decode(r, 2, [1, 2])
    _decode(r, 3, [1])


def direct_calls() -> None:
    """Kernels the runners above do not reach, through their wrappers, shaped as the
    model's layers call them on a GPU (bf16)."""
    from kernels import lora
    from kernels.fp8_linear import FP8, fp8_small_m_linear
    from kernels.grammar_mask import apply_token_bitmask_
    from kernels.penalties import apply_penalties_
    from kernels.quant_linear import quant_linear
    from kernels.rotary import apply_rotary
    from kernels.store_kvcache import store_kvcache
    from test_kernels_quant_linear import random_layout
    bf16, gen = torch.bfloat16, torch.Generator().manual_seed(0)
    rand = lambda *shape, dtype=bf16: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    # W4A16 / W8A16 (GPTQ/AWQ checkpoints): the GEMV (1 row) and the GEMM (21 rows); g128
    # as the checkpoints come: the GEMV's one-group-a-chunk path, K split in two (the last
    # split's sums), at 1 and 4 rows
    for bits, act_order, group, k in ((4, True, 32, 128), (8, False, 32, 128),
                                      (4, False, 128, 512), (8, False, 128, 512)):
        _, qweight, scales, zeros, g_idx = random_layout(k, 64, bits, group, act_order, bf16)
        for rows in (1, 21) if group == 32 else (1, 4):
            quant_linear(rand(rows, k), qweight, scales, zeros, g_idx, bits, rand(64))
    # rotary + KV store (models without q/k norm: Llama, Qwen2), bf16 and fp8 caches
    q, k, v = rand(3, 4, 16), rand(3, 2, 16), rand(3, 2, 16)
    positions = torch.arange(3, dtype=torch.int64)
    apply_rotary(q, k, positions, rand(64, 16, dtype=torch.float32))
    slots = torch.tensor([17, 18, 19], dtype=torch.int64)
    store_kvcache(k, v, torch.zeros(4, 16, 2, 16, dtype=bf16),
                  torch.zeros(4, 16, 2, 16, dtype=bf16), slots)
    store_kvcache(k, v, torch.zeros(4, 16, 2, 16, dtype=FP8), torch.zeros(4, 16, 2, 16, dtype=FP8),
                  slots, torch.zeros(4, 16), torch.zeros(4, 16))
    # split decode attention (the graphs' small buckets on a GPU): merged by the last split
    # program (bf16 and fp8 caches), or by the merge kernel where a program takes a run
    from kernels.attention import decode_runs
    from kernels.paged_attention import paged_decode
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    ctx = torch.tensor([20, 31], dtype=torch.int32)
    for cache in (bf16, FP8):
        scales = {} if cache == bf16 else dict(k_scale=torch.ones(4, 16), v_scale=torch.ones(4, 16))
        paged_decode(rand(2, 4, 128), rand(4, 16, 2, 128).to(cache),
                     rand(4, 16, 2, 128).to(cache), tables, ctx, 0.1, num_splits=3, **scales)
    paged_decode(rand(2, 4, 128), rand(4, 16, 2, 128), rand(4, 16, 2, 128), tables[[0, 0]],
                 torch.tensor([19, 20], dtype=torch.int32), 0.1, num_splits=3,
                 runs=torch.from_numpy(decode_runs(np.array([0, 0]))))
    # with the q/k norm, rotary and K/V store in its prologue (NormRotary: the served
    # graphs' decode steps of 8+ rows), one program a row (split, merged in the kernel) and
    # a run a program
    from kernels.qk_norm_rotary import NormRotary
    qkv = rand(2, 8 * 128)
    nr = NormRotary(qkv[:, 512:768].view(2, 2, 128), qkv[:, 768:].view(2, 2, 128), rand(128),
                    rand(128), 1e-6, rand(64, 128, dtype=torch.float32),
                    torch.tensor([20, 31], dtype=torch.int32))
    for runs in (None, torch.from_numpy(decode_runs(np.array([0, 0])))):
        paged_decode(qkv[:, :512].view(2, 4, 128), rand(4, 16, 2, 128), rand(4, 16, 2, 128),
                     tables if runs is None else tables[[0, 0]], ctx if runs is None else
                     torch.tensor([19, 20], dtype=torch.int32), 0.1, num_splits=3, runs=runs,
                     norm_rotary=nr)
    # the one-token GEMV with the RMSNorm (+ residual add) in its prologue (kernels/gemv.py's
    # GemvNorm), bf16 and e4m3 weights, gated (gate_up) or not (qkv), at the 0.6B's hidden size
    from kernels.gemv import GemvNorm, gemv
    for w, scale, gated in ((rand(64, 1024), None, False), (rand(64, 1024).to(FP8),
                                                           torch.ones(64, 1), True)):
        gemv(rand(1, 1024), w, scale, gated=gated,
             norm=GemvNorm(rand(1024), 1e-6, rand(1, 1024), rand(1, 1024)))
    # FP8 weights, a few rows (x quantized per token, then the small-M GEMM)
    w = rand(64, 128).to(FP8)
    fp8_small_m_linear(rand(2, 128), w, torch.ones(64, 1), rand(64))
    # the same kernel unscaled on bf16 (small_m_linear: benchmarked against cuBLAS)
    from kernels.small_m import small_m_linear
    small_m_linear(rand(8, 256), rand(64, 256))
    # ... with the norm (+ residual) in its prologue and the SwiGLU in its epilogue, at the
    # 0.6B's hidden size (whole K tiles, the model's: the tiles' shared memory must fit)
    for gated in (False, True):
        small_m_linear(rand(8, 1024), rand(128, 1024), gated=gated,
                       norm=GemvNorm(rand(1024), 1e-6, rand(8, 1024), rand(8, 1024)))
    small_m_linear(rand(8, 3072), rand(64, 3072))
    # sampling: penalties, grammar masks (logits float32 / bf16)
    logits = rand(2, 389, dtype=torch.float32)
    rows = torch.tensor([0, 1], dtype=torch.int64)
    apply_penalties_(logits, rows, rows, torch.zeros(2, 389, dtype=torch.bool),
                     torch.zeros(2, 389, dtype=torch.int32), torch.ones(2), torch.zeros(2),
                     torch.zeros(2))
    bitmask = torch.full((2, 13), -1, dtype=torch.int32)
    apply_token_bitmask_(logits, rows, bitmask)
    apply_token_bitmask_(rand(2, 389), rows, bitmask)
    # LoRA: shrink + expand (the q/k/v parts of one projection), two adapters and a base row
    lrows = lora.lora_rows(torch.tensor([0, -1, 1]), 2)
    x = rand(3, 64)
    h = lora.lora_shrink(x, rand(2, 8, 64), lrows)
    lora.lora_expand(h.repeat(1, 3), rand(2, 96, 8), torch.ones(2), lrows, rand(3, 96),
                     part_sizes=(32, 32, 32))
    lora.lora_expand(h, rand(2, 64, 8), torch.ones(2), lrows, rand(3, 64))


def record_scenarios(tmp: Path) -> list[dict]:
    from models.parallel import TPGroup
    from tiny_checkpoint import make_tiny_qwen3
    from worker_service import loading
    from worker_service.sampler import compile_fused_sampling
    # head_dim 128 as in the served models (a 16-wide fp8 tile is below tl.dot's K >= 16)
    dense = make_tiny_qwen3(tmp / "dense", head_dim=128)
    moe = make_tiny_qwen3(tmp / "moe", head_dim=128, moe=dict(num_experts=4, num_experts_per_tok=2,
                                                norm_topk_prob=True, moe_intermediate_size=32))
    records: list[dict] = []
    with recording(records), gpu_paths():
        serve(dense)
        serve(dense, kv_cache_dtype="fp8")
        serve(dense, small_batch_kernel="persistent")
        try:   # prompts past the split length: the split (PARTIAL) prefill and its merge
            serve(dense, prompt=80, split_len=64, deterministic=True)
        finally:
            loading.set_deterministic(False, TPGroup())
        serve(moe)
        compile_fused_sampling(389, torch.bfloat16, torch.device("cpu"))
        direct_calls()
    return records


# --- compiling (a subprocess, no interpreter) ---------------------------------------------

class _Pointer:
    """What Triton's launch binder reads of a tensor: its dtype and its address."""

    def __init__(self, dtype: torch.dtype, offset: int):
        self.dtype, self.offset = dtype, offset

    def data_ptr(self) -> int:
        return 1 << 20 | self.offset


def _decode_arg(value):
    import importlib

    import triton.language as tl
    if isinstance(value, dict):
        if "ptr" in value:
            return _Pointer(getattr(torch, value["ptr"]), value["offset"])
        if "tl" in value:
            return tl.dtype(value["tl"])
        if "jit" in value:
            module, name = value["jit"].split(":")
            return getattr(importlib.import_module(module), name)
        if "tuple" in value:
            return tuple(_decode_arg(v) for v in value["tuple"])
    return value


_JOBS: list = []   # the compile subprocess's unique configurations (its forked workers read it)


def _compile_job(i: int) -> tuple[str, float, str | None]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    config, fn, signature, constexprs, attrs, options = _JOBS[i]
    start = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                target=GPUTarget(*TARGET), options=options.__dict__)
        shared = kernel.metadata.shared
        error = (None if shared <= SHARED_MEMORY else   # (checked at launch: a GPU refuses it)
                 f"OutOfResources: {shared} bytes of shared memory, sm_90 has {SHARED_MEMORY}")
    except Exception as e:   # the compiler's errors, outermost first: where, then why
        chain = []
        while e is not None and len(chain) < 8:
            chain.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        error = "\n".join(chain)
    return config, round(time.perf_counter() - start, 2), error


def compile_records(records: list[dict], processes: int = 2) -> dict:
    """Compile each unique configuration for TARGET; {'configs', 'failures', 'seconds'}."""
    import importlib
    import multiprocessing

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    backend = make_backend(GPUTarget(*TARGET))
    binders, seen = {}, set()
    for rec in records:
        fn = getattr(importlib.import_module(rec["module"]), rec["qualname"])
        while not isinstance(fn, JITFunction):   # an autotuner / heuristics wrapper
            fn = fn.fn
        if rec["kernel"] not in binders:   # JITFunction.run's binder, for the sm_90 backend
            binders[rec["kernel"]] = create_function_from_signature(fn.signature, fn.params,
                                                                    backend)
        kwargs = {k: _decode_arg(v) for k, v in rec["options"].items()}
        bound, specialization, opts = binders[rec["kernel"]](
            **{k: _decode_arg(v) for k, v in rec["args"].items()}, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                              specialization, opts)
        key = (rec["kernel"], repr(signature), repr(sorted(constexprs.items(), key=str)),
               repr(sorted(attrs.items())), repr(options))
        if key in seen:
            continue
        seen.add(key)
        names = list(signature)
        shown = ", ".join(f"{names[p[0]]}={v!r}" if len(p) == 1 else f"{p}={v!r}"
                          for p, v in constexprs.items())
        extra = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages", "launch_pdl")}
        _JOBS.append((f"{rec['kernel']}[{shown}] {extra}", fn, signature, constexprs, attrs,
                      options))
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        results = pool.map(_compile_job, range(len(_JOBS)), chunksize=1)
    return {"configs": [(c, t) for c, t, _ in results], "seconds": time.perf_counter() - start,
            "failures": [f"{c}:\n{e}" for c, _, e in results if e]}


def compile_in_subprocess(records: list[dict], tmp: Path) -> dict:
    (tmp / "records.json").write_text(json.dumps(records))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "triton_cache")   # compile, never load a cached one
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(tmp / "records.json"),
                           str(tmp / "result.json")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the compile subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads((tmp / "result.json").read_text())


@pytest.mark.skipif(not INTERPRET, reason="records the interpreter's launches "
                                          "(TRITON_INTERPRET=1, the CPU tests)")
def test_every_recorded_launch_compiles_for_sm90(tmp_path):
    start = time.perf_counter()
    records = record_scenarios(tmp_path)
    recorded = time.perf_counter() - start
    launched = {r["kernel"] for r in records}
    assert EXPECTED <= launched, f"not launched by the scenarios: {sorted(EXPECTED - launched)}"
    result = compile_in_subprocess(records, tmp_path)
    kernels = {c.split("[")[0] for c, _ in result["configs"]}
    print(f"\n{len(records)} launches recorded: {len(kernels)} kernels, "
          f"{len(result['configs'])} configurations compiled in {result['seconds']:.1f} s "
          f"(recording {recorded:.1f} s)")
    assert not result["failures"], ("compiling for sm_90 failed (the interpreter ran them):\n\n"
                                    + "\n\n".join(result["failures"]))


if __name__ == "__main__":   # the compile subprocess: records.json result.json
    assert os.environ.get("TRITON_INTERPRET") != "1"
    result = compile_records(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result))
