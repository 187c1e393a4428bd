"""Steps queued more than one ahead (scheduler_service/pipeline.py): the Engine's own loop
against the null worker's planning (its SeqTable checks every placeholder input), in one
process. Each step's answer is ready at once and its device time tiny, so the engine
goes as deep as it may; every stream must still be exactly the null worker's ids, cut
at its stop id or max_tokens, through preemption and aborts.
"""
from __future__ import annotations

import asyncio
import random
from collections import deque

import numpy as np
import pytest

from nanoserve.v1 import worker_pb2
from nanoserve.worker_group import GroupInfo, WorkerGroupError, steps_in
from scheduler_service.engine import Engine, StepOutputs
from scheduler_service.pipeline import PER_MESSAGE, PipelineDepth
from scheduler_service.scheduler import SchedulerConfig
from scheduler_service.sequence import SamplingOptions
from worker_service.null_worker import NullWorkerServicer, expected_tokens

VOCAB, EOS, BS, MAX_LEN = 1000, 999, 8, 512


class InlineNullGroup:
    """A worker group of one null worker in this process: each step crosses as bytes and
    is planned on arrival, as the Step stream does; answers come back in order."""

    def __init__(self, num_kv_blocks: int):
        self.worker = NullWorkerServicer(step_ms=0.0, vocab_size=VOCAB, max_model_len=MAX_LEN,
                                         eos_token_id=EOS, num_kv_blocks=num_kv_blocks)
        self.num_kv_blocks = num_kv_blocks
        self.queue: deque = deque()
        self.deepest = 0   # most steps in flight at once
        self.messages = 0  # Step messages sent (several steps may share one)

    async def start(self) -> None:
        await self.worker.Init(worker_pb2.InitRequest(num_kv_blocks=self.num_kv_blocks,
                                                      block_size=BS), None)

    async def send(self, request: worker_pb2.StepRequest) -> None:
        wire = worker_pb2.StepRequest.FromString(request.SerializeToString())
        self.messages += 1
        for step in steps_in(wire):
            self.queue.append(self.worker._launch(step))
        self.deepest = max(self.deepest, len(self.queue))

    async def receive(self, step_id: int) -> worker_pb2.StepResponse:
        await asyncio.sleep(0)
        item = self.queue.popleft()
        if isinstance(item, tuple):   # (status, message): the worker refused the step
            raise WorkerGroupError(item[1], lost=False)
        assert item.resp.step_id == step_id
        item.resp.step_ms = item.resp.gpu_ms = 0.001
        return item.resp


def _run(requests: dict[int, tuple[list[int], SamplingOptions]], num_kv_blocks: int = 512,
         abort_after: dict[int, int] | None = None, max_depth: int = 4,
         per_message: int = PER_MESSAGE
         ) -> tuple[dict[int, list[int]], dict[int, str], Engine, InlineNullGroup]:
    """Serve `requests` (seq_id -> (prompt, sampling)); abort_after: seq_id -> abort it once
    it has this many tokens; per_message: steps a message past the second in flight.
    Returns each seq's streamed ids and finish reason."""
    got: dict[int, list[int]] = {s: [] for s in requests}
    reasons: dict[int, str] = {}
    abort_after = abort_after or {}

    async def main():
        group = InlineNullGroup(num_kv_blocks)
        await group.start()
        info = GroupInfo(model="null", fingerprint="null", world_size=1,
                         num_kv_blocks=num_kv_blocks, block_size=BS, vocab_size=VOCAB,
                         max_model_len=MAX_LEN, eos_token_id=EOS)
        cfg = SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=BS, max_model_len=MAX_LEN,
                              eos_token_id=EOS)
        done = asyncio.Event()

        def on_output(out: StepOutputs) -> None:
            assert not out.errors, out.errors
            for seq_id, tok in zip(out.seq_ids, out.token_ids):
                assert seq_id not in reasons, "a token after the finish"
                got[seq_id].append(tok)
                if len(got[seq_id]) == abort_after.get(seq_id):
                    engine.abort(seq_id)
                    reasons[seq_id] = "abort"
            for seq_id, reason, *_ in out.finished:
                reasons[seq_id] = reason
            if len(reasons) == len(requests):
                done.set()

        engine = Engine(group, info, cfg, on_output, max_pipeline_depth=max_depth)
        engine.pipeline.per_message = per_message
        task = asyncio.ensure_future(engine.run())
        for seq_id, (prompt, sampling) in requests.items():
            engine.add_request(seq_id, list(prompt), sampling)
        await asyncio.wait_for(done.wait(), 60)
        engine.stop()
        await task
        return engine, group

    engine, group = asyncio.run(main())
    return got, reasons, engine, group


def _stop_request(rng: random.Random, n: int) -> tuple[list[int], SamplingOptions, list[int]]:
    """A prompt whose stream ends at a stop id (its k-th id, k random: the stream ends
    where that id first comes) or at max_tokens; returns the ids the client must see."""
    prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 40))]
    exp = expected_tokens(prompt, n, VOCAB, EOS)
    if rng.random() < 0.5:
        k = rng.randrange(n)
        stop = exp[k]
        k = exp.index(stop)
        return prompt, SamplingOptions(max_tokens=n, stop_token_ids=(stop,), ignore_eos=True), \
            exp[:k + 1]
    return prompt, SamplingOptions(max_tokens=n, ignore_eos=True), exp


@pytest.mark.parametrize("per_message", [1, 2, 3])
def test_deep_pipeline_streams_exactly_to_each_stop(per_message):
    """Depth 4, the steps past the second sent per_message to a message (StepRequest.then):
    the engine keeps per_message - 1 more in flight, and fewer messages than steps go out."""
    rng = random.Random(3)
    reqs, want = {}, {}
    for i in range(16):
        prompt, sampling, exp = _stop_request(rng, rng.randint(1, 150))
        reqs[i + 1], want[i + 1] = (prompt, sampling), exp
    got, reasons, engine, group = _run(reqs, per_message=per_message)
    assert engine.pipeline.depth == 4 and group.deepest == 4 + per_message - 1
    steps = engine._step_id
    assert group.messages == steps if per_message == 1 else group.messages < 0.7 * steps, \
        (group.messages, steps)
    for seq_id, exp in want.items():
        assert got[seq_id] == exp, seq_id
        assert reasons[seq_id] == ("length" if len(exp) == reqs[seq_id][1].max_tokens
                                   and exp[-1] not in reqs[seq_id][1].stop_token_ids else "stop")
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_deep_pipeline_through_preemption_and_aborts():
    """A KV cache too small for everyone (preemption by recompute while placeholders are
    in flight) and aborts mid-stream: streams stay exact prefixes, blocks all come back."""
    rng = random.Random(5)
    reqs, want, aborts = {}, {}, {}
    for i in range(12):
        prompt, sampling, exp = _stop_request(rng, rng.randint(20, 120))
        reqs[i + 1], want[i + 1] = (prompt, sampling), exp
        if i % 4 == 0 and len(exp) > 3:
            aborts[i + 1] = rng.randint(1, len(exp) - 1)
    got, reasons, engine, group = _run(reqs, num_kv_blocks=40, abort_after=aborts)
    assert engine.scheduler.num_preemptions > 0, "the KV cache was meant to run out"
    assert group.deepest >= 3
    for seq_id, exp in want.items():
        if seq_id in aborts:
            assert got[seq_id] == exp[:aborts[seq_id]]
        else:
            assert got[seq_id] == exp, seq_id
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_depth_two_keeps_two_steps_in_flight():
    rng = random.Random(7)
    prompt, sampling, exp = _stop_request(rng, 60)
    got, _, engine, group = _run({1: (prompt, sampling)}, max_depth=2)
    assert got[1] == exp and group.deepest == 2


@pytest.mark.parametrize("device_ms, round_trip_ms, depth", [
    (7.0, 0.5, 2), (1.0, 0.6, 3), (0.3, 0.6, 4), (0.3, 5.0, 4), (0.0, 1.0, 2)])
def test_depth_follows_measured_times(device_ms, round_trip_ms, depth):
    p = PipelineDepth(max_depth=4)
    for _ in range(50):
        p.observe(round_trip_ms, device_ms)
    assert p.depth == depth


@pytest.mark.slow
def test_step_latency_pairs_every_token_with_its_step():
    """client.step_latency through real processes: one latency per token after the
    first, each positive (a token cannot reach the client before its step ends)."""
    from client.step_latency import measure
    lat = measure(step_ms=0.5, requests=2, output_len=20, prompt_len=8)
    assert len(lat) == 2 * 19
    assert all(0 < x < 1000 for x in lat)


def test_the_null_worker_prices_prefill_tokens():
    """--prefill-us-per-token: a step's emulated device time is step_ms plus the price of
    each token past one a row (what makes a long prefill felt by what runs beside it)."""
    w = NullWorkerServicer(step_ms=2.0, vocab_size=VOCAB, max_model_len=MAX_LEN,
                           eos_token_id=EOS, num_kv_blocks=64, prefill_us_per_token=100.0)
    asyncio.run(w.Init(worker_pb2.InitRequest(num_kv_blocks=64, block_size=BS), None))
    req = worker_pb2.StepRequest(step_id=1)
    lens = (10, 20, 30)
    for i, n in enumerate(lens):
        req.seqs.add(seq_id=i, num_tokens=n, start_pos=0, sample=True, reset_block_table=True,
                     block_table_i32=np.arange(4 * i, 4 * i + 4, dtype="<i4").tobytes())
    req.token_ids_i32 = np.ones(sum(lens), "<i4").tobytes()
    prefill = w._launch(req)
    assert prefill.resp.gpu_ms == pytest.approx(2.0 + 0.1 * (sum(lens) - len(lens)))
    dec = worker_pb2.StepRequest(step_id=2)
    dec.decode.seq_ids_u64 = np.arange(3, dtype="<u8").tobytes()
    assert w._launch(dec).resp.gpu_ms == pytest.approx(2.0)


@pytest.mark.slow
def test_a_model_worker_answers_each_step_of_a_message(tmp_path_factory):
    """A model worker service (tiny Qwen3, real process) sent a prefill and three decode
    steps in one Step message (StepRequest.then) answers four times, in order, with the
    ids it samples when each step comes in its own message: greedy, the decode steps'
    inputs the placeholders (-1) the worker fills from its previous samples."""
    from scheduler_service.worker_client import WorkerGroup
    from services import start_worker
    from tiny_checkpoint import tiny_qwen3_dir
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=3)
    prompts = {1: [5, 17, 3, 250, 9], 2: [100, 7, 7, 300, 42, 1, 8, 64, 2, 11, 19]}

    def steps() -> list[worker_pb2.StepRequest]:
        prefill = worker_pb2.StepRequest(step_id=1)
        for seq_id, prompt in prompts.items():
            table = np.array([2 * seq_id - 2, 2 * seq_id - 1], "<i4")   # 16 tokens each
            prefill.seqs.add(seq_id=seq_id, num_tokens=len(prompt), start_pos=0, sample=True,
                             reset_block_table=True, block_table_i32=table.tobytes(),
                             sampling=worker_pb2.WorkerSampling(temperature=0.0))
        prefill.token_ids_i32 = np.array(sum(prompts.values(), []), "<i4").tobytes()
        out = [prefill]
        for step_id in (2, 3, 4):
            d = worker_pb2.StepRequest(step_id=step_id)
            d.decode.seq_ids_u64 = np.array(list(prompts), "<u8").tobytes()   # inputs: all -1
            out.append(d)
        return out

    async def serve(together: bool) -> list[list[int]]:
        group = WorkerGroup([f"127.0.0.1:{worker.port}"])
        await group.connect(block_size=BS, num_kv_blocks=8)   # Init: a fresh KV cache
        sent = steps()
        try:
            if together:
                sent[0].then.extend(sent[1:])
                await group.send(sent[0])
            else:
                for step in sent:
                    await group.send(step)
            answers = [await asyncio.wait_for(group.receive(step.step_id), 30) for step in sent]
        finally:
            await group.close()
        return [np.frombuffer(a.sampled_token_ids_i32, "<i4").tolist() for a in answers]

    worker = start_worker(model_dir)
    try:
        apart = asyncio.run(serve(False))
        together = asyncio.run(serve(True))
    finally:
        worker.stop()
    assert [len(ids) for ids in apart] == [2, 2, 2, 2]
    assert together == apart
    assert len({tuple(ids) for ids in apart}) > 1   # the steps sampled different ids
