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
"""
from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass, field

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


@dataclass
class PrefixRouter:
    """Which replica (an index into the caller's targets) gets each request."""
    num_replicas: int
    slack: int = 4                  # requests in flight a preferred replica may be above the least busy
    capacity: int = 200_000         # block hashes remembered per replica
    block_tokens: int = 16
    block_bytes: int = 64
    inflight: list[int] = field(default_factory=list)
    index: list[OrderedDict] = field(default_factory=list)
    _next: int = 0                  # round robin among exact ties

    def __post_init__(self) -> None:
        self.inflight = [0] * self.num_replicas
        self.index = [OrderedDict() for _ in range(self.num_replicas)]

    def matched(self, replica: int, blocks: list[int]) -> int:
        held, n = self.index[replica], 0
        for h in blocks:
            if h not in held:
                break
            n += 1
        return n

    def pick(self, req: generate_pb2.GenerateRequest, exclude: set[int] = frozenset()) -> int:
        """The replica for req (never one in exclude unless all are); counted in flight
        until `done`."""
        blocks = prompt_blocks(req, self.block_tokens, self.block_bytes)
        live = [i for i in range(self.num_replicas) if i not in exclude] or \
            list(range(self.num_replicas))
        least = min(self.inflight[i] for i in live)
        fit = [i for i in live if self.inflight[i] <= least + self.slack]
        self._next += 1
        best = max(fit, key=lambda i: (self.matched(i, blocks), -self.inflight[i],
                                       -len(self.index[i]), (i - self._next) % self.num_replicas))
        held = self.index[best]
        for h in blocks:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)
        self.inflight[best] += 1
        return best

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
