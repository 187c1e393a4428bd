"""The prefix cache's host tier (--host-kv-cache-gb; block_manager.py, model_runner._transfer).

In-process: a prompt's KV blocks saved to host slots, the device cache wiped, the slots
copied back into other blocks: a sequence continuing from them gets the logits of the
original (a restore from swapped slots does not). BlockManager: evicted registered blocks
go to the host tier in order, a host hit comes back with a RESTORE, slots being read are
never reused in the same step. Through the services with a device cache far smaller than
the conversations: later turns find their history in the host tier, greedy tokens equal
Hugging Face's, and TP=2 (gloo) equals TP=1.
"""
from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch
import transformers

from nanoserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2
from scheduler_service.block_manager import OFFLOAD, RESTORE, BlockManager
from scheduler_service.sequence import Sequence
from services import ROOT, kill, start_scheduler, start_tp_workers, start_worker
from tiny_checkpoint import tiny_qwen3_dir

BS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=11)


# ---- worker: the copies ---------------------------------------------------------------------

def _step(runner, step_id, seq_id, tokens, start, table, transfers=()):
    req = worker_pb2.StepRequest(step_id=step_id)
    w = req.seqs.add(seq_id=seq_id, num_tokens=len(tokens), start_pos=start, sample=True,
                     reset_block_table=True,
                     block_table_i32=np.array(table, "<i4").tobytes())
    w.sampling.temperature = 0.0
    req.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    if transfers:
        req.kv_transfers_i32 = np.array(transfers, "<i4").ravel().tobytes()
    plan = runner.table.plan(req)
    if req.kv_transfers_i32:
        runner._transfer(np.frombuffer(req.kv_transfers_i32, "<i4").reshape(-1, 3))
    with torch.inference_mode():
        logits = runner._logits(plan)
    runner.table.commit(plan)
    return logits[0]


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_restored_blocks_give_the_original_logits(model_dir, kv):
    from worker_service.model_runner import ModelRunner, RunnerConfig
    runner = ModelRunner(RunnerConfig(str(model_dir), device="cpu", dtype="float32",
                                      kv_cache_gb=0.01, kv_cache_dtype=kv, host_kv_cache_gb=0.01))
    runner.init_kv(32, BS, num_host_blocks=6)
    prompt = list(range(30, 54))   # three full blocks
    _step(runner, 1, 1, prompt, 0, [0, 1, 2, 3])
    want = _step(runner, 2, 2, [99], 24, [0, 1, 2, 4])   # seq 2 reads seq 1's blocks 0-2
    saved = [(OFFLOAD, b, s) for b, s in ((0, 3), (1, 4), (2, 5))]
    _step(runner, 3, 3, [7], 0, [9], saved)   # any step carries the copies
    runner.kv_cache[:, :, :3].zero_()         # the device blocks are gone
    if runner.kv_scales is not None:
        runner.kv_scales[:, :, :3].fill_(1.0)
    back = [(RESTORE, s, b) for s, b in ((3, 10), (4, 11), (5, 12))]
    got = _step(runner, 4, 4, [99], 24, [10, 11, 12, 13], back)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # mutation: block 0's slot restored twice (swapping whole blocks would only permute
    # the keys, which attention cannot see: RoPE is already in them)
    twice = [(RESTORE, s, b) for s, b in ((3, 20), (3, 21), (5, 22))]
    wrong = _step(runner, 5, 5, [99], 24, [20, 21, 22, 23], twice)
    assert (wrong - want).abs().max() > 1e-3
    from worker_service.step_plan import StepError
    with pytest.raises(StepError, match="bad kv transfer"):
        runner._transfer(np.array([[OFFLOAD, 0, 6]]))


# ---- scheduler: the index ------------------------------------------------------------------

def _seq(i, tokens):
    return Sequence(i, list(tokens))


def _commit_all(bm, seq):
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_block_manager_offloads_then_restores():
    """a's three full blocks go to host slots when b takes them; a's prefix then comes
    back from those slots into fresh blocks, registered as cached; b's blocks, evicted by
    that, are saved to other slots than the ones being read."""
    bm = BlockManager(4, 4, num_host_blocks=3)
    a = _seq(1, range(100, 113))        # 3 full blocks + 1 token
    bm.allocate(a)
    _commit_all(bm, a)
    a_full = a.block_table[:3]
    bm.deallocate(a)
    b = _seq(2, range(200, 213))        # takes every block
    bm.allocate(b)
    moved = bm.take_transfers()
    assert sorted(k for k, _, _ in moved) == [OFFLOAD] * 3
    assert sorted(blk for _, blk, _ in moved) == sorted(a_full)
    slot_of = {blk: slot for _, blk, slot in moved}
    _commit_all(bm, b)
    bm.deallocate(b)
    again = _seq(3, list(range(100, 113)) + [7])   # a's prefix: host hits, not GPU hits
    bm.allocate(again)
    assert again.num_cached_tokens == 12 and bm.num_restored == 3
    ops = bm.take_transfers()
    restores = [(src, dst) for k, src, dst in ops if k == RESTORE]
    assert [src for src, _ in restores] == [slot_of[blk] for blk in a_full]
    assert [dst for _, dst in restores] == again.block_table[:3]
    written = {dst for k, _, dst in ops if k == OFFLOAD}
    assert not written & {src for src, _ in restores}   # no slot written and read in one step
    assert not bm.take_transfers()


@pytest.mark.parametrize("seed", range(6))
def test_block_manager_random_traffic_never_serves_wrong_kv(seed):
    """Random conversations over a tiny device cache and host tier, with a simulated KV
    store: each computed block holds its prefix's tokens (what real KV depends on), the
    transfers move those values in the order given, and every block a sequence is handed
    as cached (GPU or host hit) must hold exactly its prefix. Slots and blocks never leak."""
    import random
    rng = random.Random(seed)
    bs, nb, nh = 4, 10, 6
    bm = BlockManager(nb, bs, num_host_blocks=nh)
    gpu: dict[int, tuple] = {}
    host: dict[int, tuple] = {}
    histories: list[list[int]] = [[rng.randrange(5) for _ in range(rng.randint(1, 9))]
                                  for _ in range(4)]
    live: list[Sequence] = []
    for _ in range(300):
        if live and (len(live) > 2 or rng.random() < 0.4):
            seq = live.pop(rng.randrange(len(live)))
            bm.deallocate(seq)
            continue
        c = rng.randrange(len(histories))
        tokens = histories[c] + [rng.randrange(5) for _ in range(rng.randint(1, 6))]
        seq = _seq(rng.randrange(1 << 30), tokens)
        if not bm.can_allocate(seq):
            continue
        bm.allocate(seq)
        for kind, src, dst in bm.take_transfers():
            if kind == OFFLOAD:
                host[dst] = gpu.get(src)
            else:
                gpu[dst] = host.get(src)
        for i in range(seq.num_cached_tokens // bs):
            assert gpu.get(seq.block_table[i]) == tuple(tokens[:(i + 1) * bs]), \
                f"block {i} of a hit holds other KV"
        for i in range(seq.num_cached_tokens // bs, seq.num_blocks(bs)):   # the step computes
            gpu[seq.block_table[i]] = tuple(tokens[:min((i + 1) * bs, len(tokens))])
        _commit_all(bm, seq)
        histories[c] = tokens
        live.append(seq)
        assert len(bm.host) + len(bm.host_free) == nh
        assert len({b.slot for b in bm.host.values()}) == len(bm.host)
    for seq in live:
        bm.deallocate(seq)
    assert bm.num_free_blocks == nb
    assert bm.num_restored > 0 and bm.num_offloaded > 0


# ---- through the services ------------------------------------------------------------------

def _greedy(stub, prompt, n):
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out, usage = [], None
    for c in stub.Generate(req, timeout=120):
        out.extend(c.token_ids)
        if c.HasField("usage"):
            usage = c.usage
    return out, usage


@torch.no_grad()
def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def _conversations(stub, hf):
    """Four two-turn conversations of ~60-token histories over a 12-block (96-token) device
    cache: each second turn's history was evicted by the others' first turns."""
    gen = torch.Generator().manual_seed(1)
    firsts = [torch.randint(0, 389, (48,), generator=gen).tolist() for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: _greedy(stub, p, 8)[0], firsts))
    cached = 0
    for p, a in zip(firsts, answers):
        assert a == _hf_greedy(hf, p, 8)
        second = p + a + [5, 6, 7, 8, 9]
        got, usage = _greedy(stub, second, 8)
        assert got == _hf_greedy(hf, second, 8)
        cached += usage.cached_tokens if usage else 0
    stats = stub.GetStats(generate_pb2.StatsRequest())
    return stats, cached


def test_services_second_turns_hit_the_host_tier(model_dir, tmp_path):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worker = start_worker(model_dir, extra=["--host-kv-cache-gb", "0.01"])
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=BS,
                                extra=["--num-kv-blocks", "12", "--max-num-seqs", "2"])
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stats, cached = _conversations(generate_pb2_grpc.GenerationStub(ch), hf)
        assert stats.num_host_kv_blocks > 12
        assert stats.num_host_kv_offloaded_blocks > 0 and stats.num_host_kv_restored_blocks >= 4
        assert cached >= 4 * 48 // BS * BS * 3 // 4   # most of each history came back
        # client.bench --multi-turn against the same server: later turns hit the cache
        out = tmp_path / "mt.json"
        r = subprocess.run([sys.executable, "-m", "client.bench", "--target",
                            f"127.0.0.1:{sched.port}", "--multi-turn", "3", "--num-seqs", "3",
                            "--system-prompt-len", "16", "--min-input-len", "8",
                            "--max-input-len", "16", "--min-output-len", "4",
                            "--max-output-len", "8", "--json", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        report = json.loads(out.read_text())
        assert [t["requests"] for t in report["per_turn"]] == [3, 3, 3]
        assert report["per_turn"][2]["cached"] > 0.3 and "TTFT p90 ms" in r.stdout
    finally:
        if sched:
            sched.stop()
        worker.stop()


def test_services_tp2_host_tier(model_dir):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    workers = start_tp_workers(model_dir, 2, extra=["--host-kv-cache-gb", "0.01"])
    sched = None
    try:
        sched = start_scheduler(model_dir, [w.port for w in workers], block_size=BS,
                                extra=["--num-kv-blocks", "12", "--max-num-seqs", "2"])
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stats, _ = _conversations(generate_pb2_grpc.GenerationStub(ch), hf)
        assert stats.num_host_kv_restored_blocks >= 4
    finally:
        if sched:
            sched.stop()
        for w in workers:
            w.stop()


def test_worker_restart_empties_the_host_tier_safely(model_dir):
    """First turns fill the host tier; the worker is SIGKILLed and a new one (empty host
    memory) takes its port: the scheduler's index starts empty with it, so the second turns
    (recomputed, or restored only from what the new worker saved) still equal HF."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    extra = ["--host-kv-cache-gb", "0.01"]
    worker = start_worker(model_dir, extra=extra)
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=BS,
                                extra=["--num-kv-blocks", "12", "--max-num-seqs", "2"])
        gen = torch.Generator().manual_seed(2)
        firsts = [torch.randint(0, 389, (40,), generator=gen).tolist() for _ in range(4)]
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            answers = [_greedy(stub, p, 6)[0] for p in firsts]
            assert stub.GetStats(generate_pb2.StatsRequest()).num_host_kv_offloaded_blocks > 0
            port = worker.port
            worker.stop(sig=9)
            worker = start_worker(model_dir, port=port, extra=extra)
            for p, a in zip(firsts, answers):
                second = p + a + [3, 1, 4]
                assert _greedy(stub, second, 6)[0] == _hf_greedy(hf, second, 6)
    finally:
        if sched:
            sched.stop()
        worker.stop()
