"""KV cache events in vLLM's wire format, so routers that index replicas' prefix caches
(llm-d's kv-cache indexer, vllm-router's `kv_aware`, Dynamo) can follow nanoserve's.

The BlockManager records what enters and leaves its hash tables (GPU tier: `GPU`, host
tier: `CPU`); the engine core drains them once per step into one EventBatch and hands it
to a publisher thread, so the engine loop never waits on a socket.

Wire format (vllm/distributed/kv_events.py): an EventBatch is the msgpack array
[ts, [event, ...]]. Events come in the two encodings vLLM has used, chosen by the config's
`encoding` (a nanoserve key; vLLM's own config has none):
  * "map" (the default; vLLM 0.28+, what vllm-router 0.1.17's kv_aware and llm-d decode):
    a map tagged by "type": {"type": "BlockStored", "block_hashes": ..., "parent_block_hash",
    "token_ids", "block_size", "lora_id", "medium", "lora_name"}, {"type": "BlockRemoved",
    "block_hashes", "medium"}, {"type": "AllBlocksCleared"};
  * "array" (msgspec array_like=True, tag=True, earlier vLLM): the type name, then the
    fields in declaration order:
      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
      ["BlockRemoved", block_hashes, medium]
      ["AllBlocksCleared"]

Transport (vLLM's ZmqEventPublisher): PUB sends [topic, seq as 8 bytes big-endian,
payload]; a ROUTER replay socket answers [b"", start seq] with [b"", seq, payload] for each
buffered batch from start on, then [b"", -1 as 8 signed bytes, b""].
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from itertools import count

import msgpack
import zmq

log = logging.getLogger("nanoserve.kv_events")

MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None

    def wire(self) -> list:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids,
                self.block_size, self.lora_id, self.medium]

    def map(self) -> dict:
        return {"type": "BlockStored", "block_hashes": self.block_hashes,
                "parent_block_hash": self.parent_block_hash, "token_ids": self.token_ids,
                "block_size": self.block_size, "lora_id": self.lora_id, "medium": self.medium,
                "lora_name": None}


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None

    def wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium]

    def map(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass
class AllBlocksCleared:
    def wire(self) -> list:
        return ["AllBlocksCleared"]

    def map(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(events: list[KVEvent], ts: float | None = None, encoding: str = "map") -> bytes:
    """One EventBatch, as vLLM's msgspec encoder writes it."""
    return msgpack.packb([time.time() if ts is None else ts,
                          [e.map() if encoding == "map" else e.wire() for e in events]])


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """The inverse of encode_batch, either encoding (also reads vLLM's): for tests and routers."""
    ts, raw, *_ = msgpack.unpackb(payload)
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
             "AllBlocksCleared": AllBlocksCleared}
    out = []
    for e in raw:
        if isinstance(e, dict):
            kind = kinds[e["type"]]
            out.append(kind(*(e[f.name] for f in fields(kind))))
        else:
            out.append(kinds[e[0]](*e[1:len(fields(kinds[e[0]])) + 1]))
    return ts, out


@dataclass
class KVEventsConfig:
    """--kv-events-config, vLLM's JSON keys (KVEventsConfig): events are published when
    enable_kv_cache_events is true and publisher is "zmq"."""
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "map"      # nanoserve's: "map" (vLLM 0.28+) or "array" (earlier vLLM)

    @classmethod
    def from_cli(cls, text: str) -> "KVEventsConfig":
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(raw) - known):
            raise ValueError(f"unknown keys {unknown} (known: {sorted(known)})")
        cfg = cls(**raw)
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"publisher {cfg.publisher!r}: only 'null' and 'zmq'")
        if cfg.encoding not in ("map", "array"):
            raise ValueError(f"encoding {cfg.encoding!r}: only 'map' and 'array'")
        return cfg

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class ZmqEventPublisher:
    """PUB socket plus a ROUTER replay socket over the last `buffer_steps` batches, served
    by one thread (ZeroMQ sockets belong to one thread); `publish` only enqueues."""

    def __init__(self, cfg: KVEventsConfig):
        self.cfg = cfg
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(cfg.endpoint):   # vLLM's rule: wildcards and ipc bind, hosts connect
            self._pub.bind(cfg.endpoint)
        else:
            self._pub.connect(cfg.endpoint)
        self._replay = None
        if cfg.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(cfg.replay_endpoint)
        self._topic = cfg.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = count()
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(encode_batch(events, encoding=self.cfg.encoding))
        except queue.Full:   # a stalled thread must not stall the engine: routers replay
            self.num_dropped += 1

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if payload is None:
                return
            seq = next(self._seq)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        ident, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((ident, b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    return ("*" in endpoint or "::" in endpoint or "0.0.0.0" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))
