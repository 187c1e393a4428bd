"""The engine's side of n / penalties / top_logprobs, without processes: what it puts in
StepRequests (history only with penalties, only on a full send; siblings only once the
first completion's prompt is sent, then hitting its blocks) and how it slices top-k rows.
"""
from __future__ import annotations

from array import array

from nanoserve.v1 import worker_pb2
from nanoserve.worker_group import GroupInfo
from scheduler_service.engine import Engine
from scheduler_service.scheduler import SchedulerConfig
from scheduler_service.sequence import SamplingOptions

BS = 4


def _engine() -> tuple[Engine, list]:
    info = GroupInfo(model="m", fingerprint="f", world_size=1, num_kv_blocks=64, block_size=BS,
                     vocab_size=100, max_model_len=256, eos_token_id=99)
    outputs: list = []
    cfg = SchedulerConfig(num_kv_blocks=64, block_size=BS, max_model_len=256, eos_token_id=99)
    return Engine(None, info, cfg, outputs.append), outputs


def _step(engine: Engine) -> tuple[object, worker_pb2.StepRequest]:
    """Schedule and 'send' one step the way Engine.run does."""
    engine._apply_commands()
    batch = engine.scheduler.schedule()
    req = engine._build_step(batch)
    engine.scheduler.advance(batch)
    if engine._held and batch.is_prefill:
        engine._release_held()
    return batch, req


def _i32(b: bytes) -> list[int]:
    a = array("i")
    a.frombytes(b)
    return a.tolist()


def test_history_goes_with_full_sends_of_penalized_seqs_only():
    engine, _ = _engine()
    prompt = list(range(10, 21))
    engine.add_request(1 << 40 | 1, prompt, SamplingOptions(temperature=0.0, max_tokens=8,
                                                            repetition_penalty=1.2))
    # (a prompt of its own: one sharing the first's blocks would wait a step for them)
    engine.add_request(1 << 40 | 2, list(range(40, 45)), SamplingOptions(temperature=0.0,
                                                                        max_tokens=8))
    batch, req = _step(engine)
    pen, plain = req.seqs
    assert _i32(pen.prompt_ids_i32) == prompt and pen.output_ids_i32 == b""
    assert abs(pen.sampling.repetition_penalty - 1.2) < 1e-6   # float32 on the wire
    assert plain.prompt_ids_i32 == b"" and plain.sampling.repetition_penalty == 0
    engine.scheduler.resolve(batch, [30, 31])
    batch, req = _step(engine)   # decode: nothing but ids
    assert not batch.is_prefill and not req.seqs
    engine.scheduler.resolve(batch, [32, 33])
    # preempted (recompute) and sent again in full: the output so far comes too
    seq = engine.scheduler.running[0]
    engine.scheduler._preempt(engine.scheduler.running.popleft())
    engine._known.discard(seq.seq_id)
    batch, req = _step(engine)
    (again,) = [w for w in req.seqs if w.seq_id == seq.seq_id]
    assert again.reset_block_table and _i32(again.prompt_ids_i32) == prompt
    assert _i32(again.output_ids_i32) == [30, 32]


def test_siblings_wait_for_the_first_prefill_then_hit_its_blocks_with_their_own_seeds():
    engine, _ = _engine()
    prompt = list(range(1, 24))   # 5 full blocks + 3
    base = 1 << 40 | 5
    engine.add_request(base, prompt, SamplingOptions(temperature=1.0, seed=7, n=3, max_tokens=4))
    batch, req = _step(engine)
    assert [w.seq_id for w in req.seqs] == [base]
    assert not engine._held   # released once its prompt was sent
    engine.scheduler.resolve(batch, [50])
    batch, req = _step(engine)
    sibs = batch.seqs
    assert [s.seq_id for s in sibs] == [base + 1, base + 2]
    assert [s.sampling.seed for s in sibs] == [8, 9]
    assert all(s.usage_cached_tokens == 5 * BS for s in sibs)
    assert all(w.start_pos == 5 * BS and w.num_tokens == 3 for w in req.seqs)


def test_aborting_a_held_sibling_drops_it():
    engine, _ = _engine()
    base = 1 << 40 | 9
    engine.add_request(base, list(range(1, 10)), SamplingOptions(n=3))
    engine.abort(base + 2)
    engine._apply_commands()
    assert [s.seq_id for s in engine.held_siblings()] == [base + 1]
    assert engine.num_pending() == 2


def test_top_logprobs_are_sliced_per_seq():
    engine, _ = _engine()
    engine.add_request(1, [1, 2, 3], SamplingOptions(temperature=0.0, logprobs=True, top_logprobs=2))
    engine.add_request(2, [4, 5], SamplingOptions(temperature=0.0))
    engine.add_request(3, [6, 7], SamplingOptions(temperature=0.0, logprobs=True, top_logprobs=3))
    batch, _ = _step(engine)
    resp = worker_pb2.StepResponse(
        sampled_token_ids_i32=array("i", [10, 20, 30]).tobytes(),
        logprobs_f32=array("f", [-0.1, 0.0, -0.3]).tobytes(), top_logprobs_k=3,
        top_token_ids_i32=array("i", [10, 11, 12, 20, 21, 22, 30, 31, 32]).tobytes(),
        top_logprobs_f32=array("f", [-0.5, -1, -2, -0.5, -1, -2, -0.25, -1, -2]).tobytes())
    out = engine._finish_step(batch, resp)
    assert out.seq_ids == [1, 2, 3] and out.token_ids == [10, 20, 30]
    assert out.top_logprobs == [([10, 11], [-0.5, -1.0]), ([], []), ([30, 31, 32], [-0.25, -1.0, -2.0])]


def test_a_frontends_hello_aborts_its_adds_not_yet_taken_in():
    """A frontend's HELLO aborts everything it owns, adds the engine has not applied yet
    included: its streams resent after the INFO then run once. (Missing the pending adds, a
    frontend that said HELLO twice resent onto their first copies: 'already scheduled'.)"""
    from scheduler_service import ipc
    from scheduler_service.api_keys import KeyRing, Quotas
    from scheduler_service.engine_core import EngineCore
    engine, outputs = _engine()
    core = EngineCore.__new__(EngineCore)
    sent = []
    core.engine, core.info = engine, {}
    core.quotas = Quotas(KeyRing(None))   # (no keys: nothing to release)
    core.sock = type("Sock", (), {"send_multipart": lambda self, parts: sent.append(parts)})()
    mine, other = 3 << ipc.OWNER_SHIFT | 1, 4 << ipc.OWNER_SHIFT | 1
    opts = SamplingOptions(temperature=0.0, max_tokens=4)
    engine.add_request(mine, [1, 2, 3], opts, output=[4])     # a first resume, still pending
    engine.add_request(other, [5, 6], opts)
    core._abort_owned_by(ipc.identity(3), "restarted")
    assert sent and ipc.unpack(sent[0][1])[0] == ipc.INFO
    engine.add_request(mine, [1, 2, 3], opts, output=[4])     # the resend after that INFO
    batch, req = _step(engine)
    assert sorted(w.seq_id for w in req.seqs) == [mine, other]
    assert not any(o.errors for o in outputs)
