"""KV events (scheduler_service/kv_events.py): the BlockManager's record of its hash tables
in vLLM's terms, and the ZMQ publisher a router subscribes to, decoded with plain msgpack
as a non-Python router would."""
from __future__ import annotations

import json
import time

import msgpack
import pytest
import zmq

from scheduler_service.block_manager import BlockManager, compute_hash
from scheduler_service.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig, ZmqEventPublisher)
from scheduler_service.sequence import Sequence
from services import free_port, start_null_worker, start_scheduler

_ids = iter(range(10**9))


def run(bm: BlockManager, tokens) -> Sequence:
    """A sequence through prefill: allocated, every token computed, committed."""
    seq = Sequence(next(_ids), list(tokens))
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return seq


def test_prefill_stores_one_chained_event():
    bm = BlockManager(8, 4)
    bm.events = []
    run(bm, range(9))   # two full blocks, a partial third
    h0 = compute_hash((0, 1, 2, 3), None)
    h1 = compute_hash((4, 5, 6, 7), h0)
    assert bm.drain_events() == [BlockStored([h0, h1], None, list(range(8)), 4, None, "GPU")]
    run(bm, [0, 1, 2, 3, 4, 5, 6, 7, 50, 51, 52, 53, 54])   # a hit on both, one block more
    h2 = compute_hash((50, 51, 52, 53), h1)
    assert bm.drain_events() == [BlockStored([h2], h1, [50, 51, 52, 53], 4, None, "GPU")]


def test_eviction_removes_and_clear_clears():
    bm = BlockManager(3, 4)
    bm.events = []
    a = run(bm, range(9))           # blocks 0 and 1 registered, 2 holds the tail
    bm.deallocate(a)
    stored = bm.drain_events()[0].block_hashes
    run(bm, range(100, 109))        # needs all three: both registered blocks go
    events = bm.drain_events()
    assert events[0] == BlockRemoved(stored[::-1], "GPU")   # freed tail first
    assert isinstance(events[1], BlockStored) and events[1].medium == "GPU"
    bm.clear()
    assert bm.drain_events() == [AllBlocksCleared()]
    assert not bm.hash_to_block and bm.num_free_blocks == 3


def test_host_tier_events_carry_its_medium():
    bm = BlockManager(3, 4, num_host_blocks=2)
    bm.events = []
    a = run(bm, range(9))
    h0 = compute_hash((0, 1, 2, 3), None)
    h1 = compute_hash((4, 5, 6, 7), h0)
    bm.drain_events()
    bm.deallocate(a)                # saved to the host, last block first
    assert bm.drain_events() == [BlockStored([h1], h0, [4, 5, 6, 7], 4, None, "CPU"),
                                 BlockStored([h0], None, [0, 1, 2, 3], 4, None, "CPU")]
    bm.take_transfers()
    b = run(bm, range(100, 109))    # evicts a's GPU copies
    bm.deallocate(b)                # b's two blocks take both host slots: a's leave
    removed = {(h, e.medium) for e in bm.drain_events() if isinstance(e, BlockRemoved)
               for h in e.block_hashes}
    assert removed == {(h0, "GPU"), (h1, "GPU"), (h0, "CPU"), (h1, "CPU")}


def test_off_by_default_and_config_parsing():
    bm = BlockManager(4, 4)
    run(bm, range(9))
    assert bm.events is None
    cfg = KVEventsConfig.from_cli(json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558", "topic": "kv"}))
    assert cfg.active and cfg.topic == "kv"
    assert not KVEventsConfig.from_cli('{"publisher": "zmq"}').active
    for bad in ('{"publisher": "nats"}', '{"endpont": "x"}', "[]", '{"encoding": "json"}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_cli(bad)


def _subscribe(ctx: zmq.Context, port: int, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def _replay(ctx: zmq.Context, port: int, start: int) -> list[tuple[int, bytes]]:
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 10_000)
    req.connect(f"tcp://127.0.0.1:{port}")
    req.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        _, seq, payload = req.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            req.close(0)
            return got
        got.append((seq, payload))


def test_both_encodings_round_trip():
    from scheduler_service.kv_events import decode_batch, encode_batch
    events = [BlockStored([1, 2], 7, [5] * 8, 4, 3, "CPU"), BlockRemoved([1], "GPU"),
              AllBlocksCleared()]
    for encoding in ("map", "array"):
        assert decode_batch(encode_batch(events, 1.5, encoding)) == (1.5, events)
    ts, raw = msgpack.unpackb(encode_batch(events, 1.5))   # map: vLLM 0.28+, the default
    assert raw[0] == {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": 7,
                      "token_ids": [5] * 8, "block_size": 4, "lora_id": 3, "medium": "CPU",
                      "lora_name": None}
    assert raw[1:] == [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
                       {"type": "AllBlocksCleared"}]


def test_publisher_frames_and_replay():
    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(
        True, "zmq", f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", topic="kv",
        encoding="array"))
    ctx = zmq.Context()
    try:
        sub = _subscribe(ctx, pub_port, b"kv")
        time.sleep(0.3)   # PUB drops what it sends before the subscription arrives
        publisher.publish([BlockStored([1, 2], None, [5] * 8, 4, None, "GPU")])
        publisher.publish([BlockRemoved([1], "GPU"), AllBlocksCleared()])
        frames = [sub.recv_multipart() for _ in range(2)]
        assert [f[0] for f in frames] == [b"kv", b"kv"]
        assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1]
        ts, events = msgpack.unpackb(frames[0][2])
        assert abs(ts - time.time()) < 60
        assert events == [["BlockStored", [1, 2], None, [5] * 8, 4, None, "GPU"]]
        assert msgpack.unpackb(frames[1][2])[1] == [["BlockRemoved", [1], "GPU"],
                                                    ["AllBlocksCleared"]]
        assert _replay(ctx, replay_port, 1) == [(1, frames[1][2])]
    finally:
        ctx.destroy(0)
        publisher.close()


@pytest.mark.slow
def test_scheduler_publishes_what_its_cache_holds(tmp_path):
    """Through the real services: stored on prefill, removed on eviction, cleared when the
    worker restarts (its KV is gone)."""
    from client.client import Client, SamplingParams
    from client.null_model import write_null_model
    model = write_null_model(tmp_path / "m", vocab_size=1000)
    pub_port, replay_port = free_port(), free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{pub_port}",
                      "replay_endpoint": f"tcp://*:{replay_port}", "topic": ""})
    worker = start_null_worker(model)
    sched = start_scheduler(model, [worker.port], block_size=4,
                            extra=["--num-kv-blocks", "12", "--kv-events-config", cfg])
    ctx = zmq.Context()
    held: set[int] = set()
    seen: list[list] = []

    def follow(sub, until, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until():
            try:
                _, _, payload = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.02)
                continue
            for e in msgpack.unpackb(payload)[1]:
                seen.append(e)
                if e["type"] == "BlockStored" and e["medium"] == "GPU":
                    held.update(e["block_hashes"])
                elif e["type"] == "BlockRemoved" and e["medium"] == "GPU":
                    held.difference_update(e["block_hashes"])
                elif e["type"] == "AllBlocksCleared":
                    held.clear()
        return until()

    try:
        sub = _subscribe(ctx, pub_port)
        time.sleep(0.5)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        prompt = list(range(10, 27))   # 17 tokens: 4 full blocks before the last
        with Client(f"127.0.0.1:{sched.port}", timeout=60) as c:
            c.complete(prompt, params)
            hashes, h = [], None
            for i in range(4):
                h = compute_hash(tuple(prompt[4 * i:4 * i + 4]), h)
                hashes.append(h)
            assert follow(sub, lambda: set(hashes) <= held), seen
            stored = next(e for e in seen if e["type"] == "BlockStored")
            assert stored["block_hashes"][:4] == hashes and stored["parent_block_hash"] is None
            assert stored["token_ids"][:16] == prompt[:16] and stored["block_size"] == 4
            c.complete(list(range(500, 545)), params)   # 12 blocks: evicts the first prompt's
            assert follow(sub, lambda: not set(hashes) & held), seen
            assert any(e["type"] == "BlockRemoved" and set(e["block_hashes"]) & set(hashes)
                       for e in seen)
            port = worker.port
            worker.stop(sig=9)
            worker = start_null_worker(model, port=port)
            c.complete(prompt, params)   # the engine learns of the loss at its next step
            assert follow(sub, lambda: {"type": "AllBlocksCleared"} in seen[1:]), seen
        replayed = _replay(ctx, replay_port, 0)   # the replay socket serves the past batches
        assert replayed[0][0] == 0 and len(replayed) >= 3
        # a core starts (or restarts) empty: its first batch says so
        assert msgpack.unpackb(replayed[0][1])[1][0] == {"type": "AllBlocksCleared"}
    finally:
        ctx.destroy(0)
        sched.stop()
        worker.stop()
