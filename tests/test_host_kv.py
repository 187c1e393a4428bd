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
from services import ROOT, free_port, start_scheduler, start_tp_workers, start_worker
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
        logits = runner.forward(plan).out
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


def test_block_manager_saves_on_free_and_restores_a_step_ahead():
    """a's full blocks are saved to host slots as a frees them and stay out of the free
    list until that step is built; once another prompt evicted them from the device, a's
    prefix comes back from those slots into fresh blocks, registered as cached, and waits
    a step (`restoring`)."""
    bm = BlockManager(4, 4, num_host_blocks=5)   # a's two blocks and c's three
    a = _seq(1, range(100, 109))        # 2 full blocks + 1 token
    bm.allocate(a)
    assert a.num_host_cached_tokens == 0
    _commit_all(bm, a)
    a_full = a.block_table[:2]
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and len(bm.free_block_ids) == 2   # two being saved
    saved, sync = bm.take_transfers()
    assert not sync and sorted((k, blk) for k, blk, _ in saved) == [(OFFLOAD, b) for b in sorted(a_full)]
    slot_of = {blk: slot for _, blk, slot in saved}
    assert len(bm.free_block_ids) == 4
    c = _seq(4, range(300, 313))        # takes every block: a's leave the device
    bm.allocate(c)
    assert bm.take_transfers() == ([], False)
    _commit_all(bm, c)
    bm.deallocate(c)
    bm.take_transfers()
    again = _seq(3, list(range(100, 109)) + [7])
    bm.allocate(again)
    assert again.num_cached_tokens == 8 and again.seq_id in bm.restoring
    assert again.num_host_cached_tokens == 8   # what its usage reports as host_cached_tokens
    ops, sync = bm.take_transfers()
    restores = [(src, dst) for k, src, dst in ops if k == RESTORE]
    assert [src for src, _ in restores] == [slot_of[b] for b in a_full]
    assert [dst for _, dst in restores] == again.block_table[:2]
    assert not sync and not bm.restoring      # it may run from the next step on


def test_block_manager_cornered_step_waits_for_its_copies():
    """Every free block is being saved and a new prompt needs them now: it gets them, and
    its step is marked synchronous (the forward overwrites them after the copies)."""
    bm = BlockManager(4, 4, num_host_blocks=4)
    d = _seq(5, range(400, 413))        # 3 full blocks + 1
    bm.allocate(d)
    _commit_all(bm, d)
    bm.deallocate(d)                    # 3 being saved, 1 free
    e = _seq(6, range(500, 510))        # needs 3 blocks now
    assert bm.can_allocate(e)
    bm.allocate(e)
    ops, sync = bm.take_transfers()
    assert sync and sorted(k for k, _, _ in ops) == [OFFLOAD] * 3


def test_block_manager_random_traffic_never_serves_wrong_kv():
    restored = sum(_random_traffic(seed) for seed in range(8))
    assert restored > 10   # the host tier was exercised, not only the device


def _random_traffic(seed: int) -> int:
    """Random conversations over a tiny device cache and host tier, step by step, with a
    simulated KV store: each computed block holds its prefix's tokens, and a step's copies
    run beside its forward, so they are applied before or after it at random (both must
    give the same answers) unless the step is synchronous. Sequences restored in a step run
    in the next. Every block a sequence reads as cached holds exactly its prefix; no block
    or slot leaks."""
    import random
    rng = random.Random(seed)
    bs, nb, nh = 4, 10, 8
    bm = BlockManager(nb, bs, num_host_blocks=nh)
    gpu: dict[int, tuple] = {}
    host: dict[int, tuple] = {}
    histories: list[list[int]] = [[rng.randrange(5) for _ in range(rng.randint(1, 9))]
                                  for _ in range(8)]
    live: list[Sequence] = []
    deferred: list[tuple[Sequence, int]] = []

    def copy(ops):
        for kind, src, dst in ops:
            if kind == OFFLOAD:
                host[dst] = gpu.get(src)
            else:
                gpu[dst] = host.get(src)

    def compute(seq):
        tokens = seq.token_ids
        for i in range(seq.num_cached_tokens // bs):
            assert gpu.get(seq.block_table[i]) == tuple(tokens[:(i + 1) * bs]), \
                f"block {i} of a hit holds other KV"
        for i in range(seq.num_cached_tokens // bs, seq.num_blocks(bs)):
            gpu[seq.block_table[i]] = tuple(tokens[:min((i + 1) * bs, len(tokens))])
        _commit_all(bm, seq)

    for _ in range(400):
        for _ in range(rng.randint(0, 2)):    # some finish
            if live:
                bm.deallocate(live.pop(rng.randrange(len(live))))
        now, deferred = deferred, []
        for _ in range(rng.randint(0, 2)):    # some arrive
            c = rng.randrange(len(histories))
            seq = _seq(rng.randrange(1 << 30), histories[c] + [rng.randrange(5)
                                                               for _ in range(rng.randint(1, 6))])
            if len(live) + len(now) > 3 or not bm.can_allocate(seq):
                continue
            bm.allocate(seq)
            (deferred if seq.seq_id in bm.restoring else now).append((seq, c))
        ops, sync = bm.take_transfers()
        if sync or rng.random() < 0.5:
            copy(ops)
            for seq, _ in now:
                compute(seq)
        else:
            for seq, _ in now:
                compute(seq)
            copy(ops)
        for seq, c in now:
            histories[c] = seq.token_ids
            live.append(seq)
        assert len(bm.host) + len(bm.host_free) == nh
        assert len({b.slot for b in bm.host.values()}) == len(bm.host)
    for seq in live + [s for s, _ in deferred]:
        bm.deallocate(seq)
    bm.take_transfers()
    assert bm.num_free_blocks == nb == len(bm.free_block_ids)
    assert bm.num_offloaded > 0
    return bm.num_restored


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
    cache: each second turn's history was evicted by the others' first turns. Returns the
    stats, the second turns' cached and host-cached prompt tokens (usage)."""
    gen = torch.Generator().manual_seed(1)
    firsts = [torch.randint(0, 389, (48,), generator=gen).tolist() for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: _greedy(stub, p, 8)[0], firsts))
    cached = host_cached = 0
    for p, a in zip(firsts, answers):
        assert a == _hf_greedy(hf, p, 8)
        second = p + a + [5, 6, 7, 8, 9]
        got, usage = _greedy(stub, second, 8)
        assert got == _hf_greedy(hf, second, 8)
        assert usage.host_cached_tokens <= usage.cached_tokens and usage.queue_ms >= 0
        cached += usage.cached_tokens
        host_cached += usage.host_cached_tokens
    stats = stub.GetStats(generate_pb2.StatsRequest())
    return stats, cached, host_cached


def test_services_second_turns_hit_the_host_tier(model_dir, tmp_path):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    metrics = free_port()
    worker = start_worker(model_dir, extra=["--host-kv-cache-gb", "0.01",
                                            "--metrics-port", str(metrics)])
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=BS,
                                extra=["--num-kv-blocks", "12", "--max-num-seqs", "2"])
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stats, cached, host_cached = _conversations(generate_pb2_grpc.GenerationStub(ch), hf)
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        moved = {d: float(next(l.split()[-1] for l in text.splitlines() if l.startswith(
            f'nanoserve_worker_host_kv_bytes_total{{direction="{d}",rank="0"}}')))
            for d in ("to_host", "to_device")}
        assert moved["to_device"] > 0 and moved["to_host"] > 0
        copy_s = float(next(l.split()[-1] for l in text.splitlines() if l.startswith(
            'nanoserve_worker_host_kv_copy_seconds_total{rank="0"}')))
        assert copy_s > 0
        assert stats.num_host_kv_blocks > 12
        assert stats.num_host_kv_offloaded_blocks > 0 and stats.num_host_kv_restored_blocks >= 4
        assert cached >= 4 * 48 // BS * BS * 3 // 4   # most of each history came back
        # ... from the host tier (usage.host_cached_tokens), block for block as restored
        assert host_cached > 0 and host_cached % BS == 0
        assert host_cached <= stats.num_host_kv_restored_blocks * BS
        # client.bench --multi-turn against the same server: later turns hit the cache
        out = tmp_path / "mt.json"
        r = subprocess.run([sys.executable, "-m", "client.bench", "--target",
                            f"127.0.0.1:{sched.port}", "--multi-turn", "3", "--num-seqs", "3",
                            "--concurrency", "2",
                            "--system-prompt-len", "16", "--min-input-len", "8",
                            "--max-input-len", "16", "--min-output-len", "4",
                            "--max-output-len", "8", "--json", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        report = json.loads(out.read_text())
        assert [t["requests"] for t in report["per_turn"]] == [3, 3, 3]
        assert report["per_turn"][2]["cached"] > 0.3 and "TTFT p90 ms" in r.stdout
        assert all(0 <= t["host_cached"] <= t["cached"] and t["queue_p50_ms"] >= 0
                   for t in report["per_turn"]) and "queued p50 ms" in r.stdout
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
            stats, _, _ = _conversations(generate_pb2_grpc.GenerationStub(ch), hf)
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


def test_scheduler_runs_a_restored_prompt_a_step_later_or_synchronously():
    """A prompt whose prefix comes back from the host tier is left out of the step that
    carries its copies while others run (it goes in the next one); alone, it runs at once
    in a step marked synchronous."""
    from scheduler_service.scheduler import Scheduler, SchedulerConfig
    from scheduler_service.sequence import SamplingOptions

    def run(sched, batch, token=3):
        sched.block_manager.take_transfers()   # what the engine does building the step
        sched.postprocess(batch, [token] * sum(batch.sample))

    s = Scheduler(SchedulerConfig(num_kv_blocks=6, block_size=4, num_host_kv_blocks=8,
                                  max_model_len=64))
    opts = dict(max_tokens=1, ignore_eos=True)
    s.add(Sequence(1, list(range(100, 109)), SamplingOptions(**opts)))   # 2 full blocks
    run(s, s.schedule())                                                   # prefill, done
    s.add(Sequence(2, list(range(200, 221)), SamplingOptions(**opts)))   # evicts 1's blocks
    run(s, s.schedule())
    # a long-running sequence keeps a step going every time
    s.add(Sequence(3, [9, 9], SamplingOptions(max_tokens=50, ignore_eos=True)))
    run(s, s.schedule())
    s.add(Sequence(4, list(range(100, 109)) + [5], SamplingOptions(**opts)))
    batch = s.schedule()
    assert [q.seq_id for q in batch.seqs] == [3] and not batch.sync_transfers
    ops, sync = s.block_manager.take_transfers()
    assert any(k == RESTORE for k, _, _ in ops) and not sync
    s.postprocess(batch, [3] * sum(batch.sample))
    nxt = s.schedule()
    four = next(q for q in nxt.seqs if q.seq_id == 4)
    assert four.num_cached_tokens == 8 and four.num_scheduled_tokens == 2
    # alone: runs at once, synchronously
    s2 = Scheduler(SchedulerConfig(num_kv_blocks=6, block_size=4, num_host_kv_blocks=8,
                                   max_model_len=64))
    s2.add(Sequence(1, list(range(100, 109)), SamplingOptions(**opts)))
    run(s2, s2.schedule())
    s2.add(Sequence(2, list(range(200, 221)), SamplingOptions(**opts)))
    run(s2, s2.schedule())
    s2.add(Sequence(4, list(range(100, 109)) + [5], SamplingOptions(**opts)))
    batch = s2.schedule()
    assert [q.seq_id for q in batch.seqs] == [4] and batch.sync_transfers
    assert batch.seqs[0].num_cached_tokens == 8


@pytest.mark.parametrize("fp8", [False, True])
def test_staged_copies_equal_direct_ones(fp8):
    """HostTier's CUDA path (each block gathered into a staging buffer, then one contiguous
    copy; the reverse on the way back), run on CPU tensors: saves and restores land exactly
    where the direct copies put them, scales included; a staging buffer reused across a
    step's copies never leaks one block into another."""
    from worker_service.host_tier import HostTier
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 3, 6, 4, 2, 8, generator=g)
    scales = torch.rand(2, 3, 6, 4, generator=g) if fp8 else None
    tiers = [HostTier.allocate(kv, scales, 5) for _ in range(2)]
    staged = tiers[1]
    staged.stage_kv = torch.empty(2, 3, 4, 2, 8)
    staged.stage_scales = torch.empty(2, 3, 4) if fp8 else None
    caches = [(kv.clone(), None if scales is None else scales.clone()) for _ in tiers]
    save = [(0, 1, 3), (0, 4, 0), (0, 2, 4)]
    restore = [(1, 5, 3), (1, 0, 0), (1, 3, 4)]
    for tier, (c, s) in zip(tiers, caches):
        tier.copy(save, c, s)
        c[:, :, [0, 3, 5]] = 0.0
        tier.copy(restore, c, s)
    (direct, direct_s), (via, via_s) = caches
    assert torch.equal(via, direct) and torch.equal(staged.kv, tiers[0].kv)
    for (_, block, slot), (_, back, _) in zip(save, restore):
        assert torch.equal(via[:, :, back], kv[:, :, block])
        if fp8:
            assert torch.equal(via_s[:, :, back], scales[:, :, block])
            assert torch.equal(staged.scales[slot], scales[:, :, block])
    assert staged.take_seconds() > 0 and staged.take_seconds() == 0.0


def test_services_host_tier_with_a_draft_model(model_dir):
    """Blocks restored from the host tier carry the target's KV only (the draft's reads
    stale there: worse drafts, never other output), and blocks reserved for drafts sit
    beside evictions: greedy turns still equal Hugging Face's."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worker = start_worker(model_dir, extra=["--host-kv-cache-gb", "0.01",
                                            "--draft-model", str(model_dir)])
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=BS, extra=[
            "--num-kv-blocks", "12", "--max-num-seqs", "2", "--speculative", "draft",
            "--num-speculative-tokens", "3", "--no-speculative-adaptive"])
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stats, _, _ = _conversations(generate_pb2_grpc.GenerationStub(ch), hf)
        assert stats.num_host_kv_restored_blocks >= 4 and stats.num_spec_proposed_tokens > 0
    finally:
        if sched:
            sched.stop()
        worker.stop()
