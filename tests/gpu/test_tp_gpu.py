"""Tensor parallelism on 2 GPUs (NCCL): TP=2 vs TP=1 at Qwen3-0.6B and Qwen3-8B shapes.

For each shape (random bf16 weights, HF default init):
  * logits of a ragged prefill and greedy tokens of a batched paged decode, TP=2 against
    TP=1 (rel. L2 error of the logits; tokens agreeing before the first bf16 near-tie);
  * decode throughput of the real ModelRunner (CUDA graphs, Triton attention, on-GPU
    sampling) at batch 256, context 1024, each step launched before the previous one's
    answer is read (as the worker serves): TP=1 on GPU 0, then TP=2 over both GPUs, with
    NCCL alone and with the peer-memory all-reduce.

    python tests/gpu/test_tp_gpu.py          # on a 2-GPU host; prints the RESULTS table
"""
from __future__ import annotations

import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

COMMON = dict(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
              head_dim=128, eos_token_id=151645, bos_token_id=151643)
SHAPES = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    # for the launcher at TP=4 (run.sh big), not this file's TP=2 test
    "Qwen3-32B": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
}
BATCH, CONTEXT, BLOCK, TIMED_STEPS = 256, 1024, 256, 20


def make_checkpoint(name: str, path: pathlib.Path, residual_scale: float = 1.0,
                    head: str = "random") -> None:
    """residual_scale < 1 scales every layer's output projections (o_proj, down_proj).
    head="echo" makes the LM head the embedding, "count" the embedding shifted by one row:
    with residual_scale 0 the model then repeats its last token (echo) or answers t+1 after
    t (count) by a margin of tens of nats, where a random model's greedy choice flips with
    the kernels' bf16 rounding (graphs vs eager, batch shapes): speculation's benchmarks
    need one greedy answer whatever the step's shape, and "count" never repeats itself, so
    a corrupted prediction cannot re-align early. Speed does not depend on the values."""
    import transformers
    from tiny_checkpoint import make_tokenizer
    config = transformers.Qwen3Config(**COMMON, **SHAPES[name])
    config.architectures = ["Qwen3ForCausalLM"]
    if head in ("echo", "count"):   # a tied head would roll the embedding with it (echo)
        config.tie_word_embeddings = False
    torch.manual_seed(0)
    big = name == "Qwen3-32B"   # built in bf16: its fp32 weights (131 GB) fit no GPU
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if big else default)
    try:
        with torch.device("cuda:0"):
            model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for layer in model.model.layers if residual_scale != 1.0 else ():
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
        if head in ("echo", "count"):   # count: row t+1 of the head is token t's embedding
            shift = 1 if head == "count" else 0
            model.lm_head.weight.copy_(model.model.embed_tokens.weight.roll(shift, 0))
    model.save_pretrained(path)
    make_tokenizer(320).save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def logits_and_greedy(path, tp, device, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits [T, V] of three prompts, then 16 greedy decode steps' tokens [3, 16]."""
    from kernels.attention import select_backend
    from models.loader import load_model
    from paged_kv import PagedKV
    model, _ = load_model(str(path), tp=tp, dtype=dtype, device=device,
                          attn_backend=select_backend("triton", device))
    gen = torch.Generator().manual_seed(1)
    lens, steps = [300, 517, 64], 16
    prompts = [torch.randint(0, 10000, (n,), generator=gen) for n in lens]
    kv = PagedKV(model, [n + steps for n in lens], block_size=BLOCK)
    with torch.inference_mode():
        pos, meta = kv.metadata([(i, 0, n) for i, n in enumerate(lens)])
        logits = model.compute_logits(model(torch.cat(prompts).to(device), pos, meta)).float()
        ends = torch.tensor(lens).cumsum(0) - 1
        nxt = logits[ends.to(device)].argmax(-1)
        tokens = [nxt]
        for s in range(steps - 1):
            pos, meta = kv.metadata([(i, n + s, n + s + 1) for i, n in enumerate(lens)], is_decode=True)
            nxt = model.compute_logits(model(nxt, pos, meta)).float().argmax(-1)
            tokens.append(nxt)
    del model, kv
    torch.cuda.empty_cache()
    return logits.cpu(), torch.stack(tokens, 1).cpu()


def decode_throughput(path, tp, device) -> float:
    """Output tokens/s of ModelRunner decode steps: BATCH seqs at CONTEXT tokens each."""
    import numpy as np
    from nanoserve.v1 import worker_pb2
    from worker_service.model_runner import ModelRunner, RunnerConfig
    runner = ModelRunner(RunnerConfig(model_dir=str(path), device=str(device), dtype="bfloat16",
                                      attention_backend="triton", gpu_memory_utilization=0.85,
                                      max_model_len=4096, max_num_seqs=BATCH), tp)
    per_seq = CONTEXT // BLOCK + 1
    runner.init_kv(BATCH * per_seq, BLOCK)
    rng = np.random.default_rng(0)

    def request(step_id: int, first: bool) -> worker_pb2.StepRequest:
        """The first step sends every sequence in full at position CONTEXT; later ones are
        packed decode steps (the worker tracks positions and tables)."""
        req = worker_pb2.StepRequest(step_id=step_id)
        tokens = rng.integers(0, 10000, BATCH, dtype="<i4").tobytes()
        if first:
            for i in range(BATCH):
                w = req.seqs.add(seq_id=i, num_tokens=1, start_pos=CONTEXT, sample=True,
                                 reset_block_table=True)
                w.block_table_i32 = np.arange(i * per_seq, (i + 1) * per_seq, dtype="<i4").tobytes()
                w.sampling.temperature = 0.6
            req.token_ids_i32 = tokens
        else:
            req.decode.seq_ids_u64 = np.arange(BATCH, dtype="<u8").tobytes()
            req.decode.token_ids_i32 = tokens
        return req

    for s in range(3):
        runner.step(request(s + 1, s == 0))
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    pending = None
    for s in range(TIMED_STEPS):   # pipelined as the worker serves: step s+1 launched first
        launched = runner.launch(request(s + 4, False))
        if pending is not None:
            runner.finish(pending)
        pending = launched
    runner.finish(pending)
    elapsed = time.perf_counter() - t0
    del runner
    torch.cuda.empty_cache()
    return BATCH * TIMED_STEPS / elapsed


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from models import fast_all_reduce
    from models.parallel import TPGroup
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=device)
    fast = fast_all_reduce.create(device)
    rows = []
    for name in SHAPES:
        path = pathlib.Path(out_dir) / name
        if rank == 0 and not (path / "config.json").exists():
            make_checkpoint(name, path)
        dist.barrier()
        if rank == 0:
            fp32_logits, _ = logits_and_greedy(path, TPGroup(), device, torch.float32)
            ref_logits, ref_tokens = logits_and_greedy(path, TPGroup(), device)
            tp1_tps = decode_throughput(path, TPGroup(), device)
        dist.barrier()
        logits, tokens = logits_and_greedy(path, TPGroup(rank, 2, fast=fast), device)
        tp2_nccl = decode_throughput(path, TPGroup(rank, 2), device)
        tp2_tps = decode_throughput(path, TPGroup(rank, 2, fast=fast), device)
        if rank == 0:
            def err(a, b):
                return float((a - b).norm() / b.norm())
            agree = [next((j for j in range(tokens.shape[1]) if tokens[i, j] != ref_tokens[i, j]),
                          tokens.shape[1]) for i in range(tokens.shape[0])]
            rows.append((name, err(logits, ref_logits), err(ref_logits, fp32_logits),
                         err(logits, fp32_logits), agree, tp1_tps, tp2_nccl, tp2_tps))
        dist.barrier()
    if rank == 0:
        print(f"\n{torch.cuda.get_device_name(0)} x2, torch {torch.__version__}; TP=2 "
              f"all-reduce: {'peer memory up to 8 MiB, NCCL above' if fast else 'NCCL (no peer memory)'}")
        print("\nlogits: rel. L2 error of bf16 runs (TP=2 vs TP=1, and each vs our TP=1 in fp32); "
              f"decode: batch {BATCH}, context {CONTEXT}")
        print("\n| shape | TP=2 vs TP=1 | TP=1 vs fp32 | TP=2 vs fp32 | greedy tokens agreeing "
              "TP=2/TP=1 (of 16) | decode tok/s TP=1 | TP=2, NCCL only | TP=2 | TP=2 / TP=1 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, e21, e1, e2, agree, t1, t2n, t2 in rows:
            print(f"| {name} | {e21:.4f} | {e1:.4f} | {e2:.4f} | {agree} | {t1:,.0f} | {t2n:,.0f} "
                  f"| {t2:,.0f} | {t2 / t1:.2f}x |")
    dist.destroy_process_group()


def run() -> None:
    import tempfile
    import torch.multiprocessing as mp
    from client.ports import free_port
    port = free_port()
    out_dir = os.environ.get("NANOSERVE_TP_CKPTS") or tempfile.mkdtemp()
    mp.spawn(_rank_main, args=(port, out_dir), nprocs=2, join=True)


def test_tp2_matches_tp1_on_two_gpus():
    run()


if __name__ == "__main__":
    run()
