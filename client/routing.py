"""Prefix-affine replica choice for gRPC callers (`Client(targets, routing="prefix")`).

Round robin sends a conversation's turns to N replicas in turn, so its history is in the
prefix cache of the one serving it about 1/N of the time. Here each replica has an index
of the prompt blocks routed to it (chained xxhash64 over fixed-size blocks of the prompt,
an LRU of block hashes, like vllm-router's `cache_aware` tree): a request goes to the
replica holding the longest leading run of its blocks, among the replicas not busier than
the least busy by more than `slack` requests in flight; equal runs (a system prompt every
replica has seen) go to the least busy. So a conversation stays where its history is while
the load stays even, and a replica's death moves only its own conversations.

Token-id prompts are cut into `block_tokens` ids, text and chat prompts into
`block_bytes` bytes of their UTF-8 (chat: role and content of each message).

With the replicas' KV events (`Client(targets, routing="prefix", kv_events=[...])`, one
endpoint per target: their --kv-events-config), a token-id prompt is also matched against
what each replica's prefix cache actually holds (`KVEventIndex`): its blocks hashed as the
scheduler hashes them (chained xxhash64, scheduler_service/block_manager.py), whichever of
the two indexes knows more wins. That also finds prefixes this client never routed (another
client's, or one that was warm before it started) and forgets evicted ones.
"""
from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack
import xxhash

from nanoserve.v1 import generate_pb2


def prompt_blocks(req: generate_pb2.GenerateRequest, block_tokens: int = 16,
                  block_bytes: int = 64) -> list[int]:
    """Chained hashes of the prompt's full blocks (equal chains: equal prefixes)."""
    if req.HasField("token_ids"):
        ids = list(req.token_ids.ids)
        chunks = [struct.pack(f"<{block_tokens}I", *ids[i:i + block_tokens])
                  for i in range(0, len(ids) - block_tokens + 1, block_tokens)]
    else:
        data = (req.text if not req.HasField("chat") else "".join(
            f"\x00{m.role}\x01{m.content}" for m in req.chat.messages)).encode()
        chunks = [data[i:i + block_bytes]
                  for i in range(0, len(data) - block_bytes + 1, block_bytes)]
    out, h = [], 0
    for c in chunks:
        h = xxhash.xxh64_intdigest(h.to_bytes(8, "little") + c)
        out.append(h)
    return out


def server_block_hashes(ids: list[int], block_size: int) -> list[int]:
    """The scheduler's prefix-cache keys of a token prompt's full blocks (base model)."""
    out, h = [], None
    for i in range(0, len(ids) - block_size + 1, block_size):
        x = xxhash.xxh64()
        if h is not None:
            x.update(h.to_bytes(8, "little"))
        x.update(struct.pack(f"<{block_size}i", *ids[i:i + block_size]))
        h = x.intdigest()
        out.append(h)
    return out


class KVEventIndex:
    """Per replica, the block hashes its scheduler says it holds (either tier), followed
    from its KV events (scheduler_service/kv_events.py, either encoding) on one thread."""

    def __init__(self, endpoints: list[str], topic: str = ""):
        import zmq
        self.held: list[set[int]] = [set() for _ in endpoints]
        self.block_size = 0   # the schedulers' --block-size, as their BlockStored events say
        self._ctx = zmq.Context()
        self._subs = []
        for e in endpoints:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(e)
            self._subs.append(sub)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-index", daemon=True)
        self._thread.start()

    def matched(self, replica: int, hashes: list[int]) -> int:
        held, n = self.held[replica], 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        import zmq
        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                *_, payload = sock.recv_multipart()
                self._apply(self.held[self._subs.index(sock)], msgpack.unpackb(payload)[1])

    def _apply(self, held: set[int], events: list) -> None:
        for e in events:
            kind, hashes = (e["type"], e.get("block_hashes")) if isinstance(e, dict) else \
                (e[0], e[1] if len(e) > 1 else None)
            if kind == "BlockStored":
                held.update(hashes)
                self.block_size = e["block_size"] if isinstance(e, dict) else e[4]
            elif kind == "BlockRemoved":   # a block may stay in the other tier: kept (a hint)
                if (e["medium"] if isinstance(e, dict) else e[-1]) == "GPU":
                    held.difference_update(hashes)
            elif kind == "AllBlocksCleared":
                held.clear()


@dataclass
class PrefixRouter:
    """Which replica (an index into the caller's targets) gets each request."""
    num_replicas: int
    slack: int = 4                  # requests in flight a preferred replica may be above the least busy
    capacity: int = 200_000         # block hashes remembered per replica
    block_tokens: int = 16
    block_bytes: int = 64
    kv_index: KVEventIndex | None = None   # the replicas' own reports (KV events)
    kv_block_size: int = 0                 # their --block-size (0: ask the first replica)
    inflight: list[int] = field(default_factory=list)
    index: list[OrderedDict] = field(default_factory=list)
    _next: int = 0                  # round robin among exact ties

    def __post_init__(self) -> None:
        self.inflight = [0] * self.num_replicas
        self.index = [OrderedDict() for _ in range(self.num_replicas)]

    def matched(self, replica: int, blocks: list[int], cached: list[int] = ()) -> int:
        """Prompt tokens the replica likely holds: the routed index's run of `blocks`, or
        the KV events' run of `cached` (the scheduler's hashes), whichever is longer."""
        held, n = self.index[replica], 0
        for h in blocks:
            if h not in held:
                break
            n += 1
        n *= self.block_tokens
        if cached and self.kv_index is not None:
            n = max(n, self.kv_index.matched(replica, cached) * self.server_block_size)
        return n

    def pick(self, req: generate_pb2.GenerateRequest, exclude: set[int] = frozenset()) -> int:
        """The replica for req (never one in exclude unless all are); counted in flight
        until `done`."""
        blocks = prompt_blocks(req, self.block_tokens, self.block_bytes)
        cached = server_block_hashes(list(req.token_ids.ids), self.server_block_size) \
            if self.server_block_size and req.HasField("token_ids") and not req.adapter else []
        live = [i for i in range(self.num_replicas) if i not in exclude] or \
            list(range(self.num_replicas))
        least = min(self.inflight[i] for i in live)
        fit = [i for i in live if self.inflight[i] <= least + self.slack]
        self._next += 1
        best = max(fit, key=lambda i: (self.matched(i, blocks, cached), -self.inflight[i],
                                       -len(self.index[i]), (i - self._next) % self.num_replicas))
        held = self.index[best]
        for h in blocks:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)
        self.inflight[best] += 1
        return best

    @property
    def server_block_size(self) -> int:
        if self.kv_index is None:
            return 0
        return self.kv_block_size or self.kv_index.block_size

    def done(self, replica: int) -> None:
        self.inflight[replica] -= 1

    def forget(self, replica: int) -> None:
        """The replica lost its cache (it died or restarted)."""
        self.index[replica].clear()


@dataclass
class Replicas:
    """A client's per-replica stubs and the router that picks among them; a resumed stream
    (client/resume.py) avoids the replicas its earlier attempts died on."""
    router: PrefixRouter
    stubs: list
    channels: list

    def pick(self, req: generate_pb2.GenerateRequest, tried: list[int]) -> tuple[object, int]:
        if tried:   # the replica an attempt died on lost its cache, and may be gone
            self.router.forget(tried[-1])
        i = self.router.pick(req, set(tried))
        tried.append(i)
        return self.stubs[i], i

    def done(self, i: int) -> None:
        self.router.done(i)

    def close(self) -> None:
        if self.router.kv_index is not None:
            self.router.kv_index.close()
