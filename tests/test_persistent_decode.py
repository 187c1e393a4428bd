"""The persistent small-batch decode kernel (kernels/persistent_decode.py) through its
executor (worker_service/persistent_executor.py) in the Triton interpreter: a decode
step's logits and the K/V it stores equal the per-op path's (the eager executor, the
reference) for batches of 1-3 sequences of different lengths, several steps in a row; and
the executor declines what it does not run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.v1 import worker_pb2
from tiny_checkpoint import tiny_qwen3_dir
from worker_service.executors import Eager, StepInputs, run
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.persistent_executor import PersistentDecode, unsupported

BS = 16


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tiny_qwen3_dir(tmp_path_factory)
    r = ModelRunner(RunnerConfig(model_dir=str(path), device="cpu", dtype="float32",
                                 kv_cache_gb=0.01, max_model_len=128))
    r.init_kv(32, BS)
    return r


def _prefill(runner, seq_id: int, tokens: list[int], blocks: list[int]) -> None:
    req = worker_pb2.StepRequest(step_id=1)
    w = req.seqs.add(seq_id=seq_id, num_tokens=len(tokens), start_pos=0, sample=True,
                     reset_block_table=True, block_table_i32=np.array(blocks, "<i4").tobytes())
    w.sampling.temperature = 0.0
    req.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    runner.step(req)


def _decode_plan(runner, seq_ids: list[int], tokens: list[int], step_id: int):
    req = worker_pb2.StepRequest(step_id=step_id)
    req.decode.seq_ids_u64 = np.array(seq_ids, "<u8").tobytes()
    req.decode.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    return runner.table.plan(req)


def test_the_tiny_model_is_covered(runner):
    assert unsupported(runner.model.decode_step(), 1) is None
    assert unsupported(runner.model.decode_step(), 2) == "tensor parallelism"


@pytest.mark.parametrize("rows", [1, 3])
def test_logits_and_kv_equal_the_per_op_path(runner, rows):
    gen = torch.Generator().manual_seed(rows)
    seqs = list(range(100 * rows, 100 * rows + rows))
    for i, s in enumerate(seqs):   # contexts of 5, 17, 29 tokens (crossing blocks)
        n = 5 + 12 * i
        _prefill(runner, s, torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist(),
                 [3 * i, 3 * i + 1, 3 * i + 2][::-1])
    kernel = PersistentDecode(runner.model, runner.device, runner.max_model_len)
    eager = Eager(runner.model, runner.device)
    for step in range(3):
        tokens = torch.randint(0, runner.vocab_size, (rows,), generator=gen).tolist()
        plan = _decode_plan(runner, seqs, tokens, 10 + step)
        assert kernel.fits(StepInputs(plan))
        before = runner.kv_cache.clone()
        ref = run([eager], StepInputs(plan)).out
        ref_kv = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        got = run([kernel], StepInputs(plan)).out
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(runner.kv_cache, ref_kv, rtol=1e-5, atol=1e-5)
        runner.table.commit(plan)


def test_declines_what_it_does_not_run(runner):
    kernel = PersistentDecode(runner.model, runner.device, runner.max_model_len)
    _prefill(runner, 7, [1, 2, 3, 4], [20])
    _prefill(runner, 8, [5, 6, 7], [21])
    req = worker_pb2.StepRequest(step_id=30)   # fast-forward: two rows of sequence 7
    req.decode.seq_ids_u64 = np.array([7, 8], "<u8").tobytes()
    req.decode.token_ids_i32 = np.array([9, 10, 11], "<i4").tobytes()
    req.decode.num_tokens_i32 = np.array([2, 1], "<i4").tobytes()
    assert not kernel.fits(StepInputs(runner.table.plan(req)))
    plan = _decode_plan(runner, [7, 8], [9, 10], 31)
    assert kernel.fits(StepInputs(plan))
    assert not kernel.fits(StepInputs(plan, lora=np.array([0, -1])))   # an adapter row
    assert kernel.fits(StepInputs(plan, lora=np.array([-1, -1])))


def test_the_runner_serves_decode_steps_through_it(tmp_path_factory):
    """--small-batch-kernel persistent: decode steps go through the kernel (the first
    executor), prefills through the per-op path, and greedy tokens equal a plain runner's."""
    path = tiny_qwen3_dir(tmp_path_factory)
    out = {}
    for mode in ("off", "persistent"):
        r = ModelRunner(RunnerConfig(model_dir=str(path), device="cpu", dtype="float32",
                                     kv_cache_gb=0.01, max_model_len=128,
                                     small_batch_kernel=mode))
        r.init_kv(32, BS)
        assert isinstance(r.executors[0], PersistentDecode) == (mode == "persistent")
        _prefill(r, 1, [5, 9, 13, 5, 9, 40], [4, 2])
        tokens = []
        for step in range(6):
            req = worker_pb2.StepRequest(step_id=2 + step)
            req.decode.seq_ids_u64 = np.array([1], "<u8").tobytes()   # input: the last sample
            resp = r.step(req)
            tokens += np.frombuffer(resp.sampled_token_ids_i32, "<i4").tolist()
        out[mode] = tokens
    assert out["persistent"] == out["off"]
