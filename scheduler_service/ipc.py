"""The messages between frontends and the engine core (ZeroMQ + msgpack, same host).

Why ZeroMQ: the engine core must never block on a slow frontend, and frontends come and
go. A ROUTER socket in the core and a DEALER per frontend give framing, queueing in
ZeroMQ's own I/O thread (sending is a memcpy for the engine loop), reconnects after a
restart and one socket for any number of frontends. msgpack keeps messages plain data:
nothing a peer sends can run code here.

Every message is one msgpack list whose first item says what it is:

frontend -> core
    [HELLO]                              a frontend (re)started: forget its old requests
    [ADD, seq_id, prompt_ids, sampling]  a new request (sampling: `pack_sampling`); with
                                         sampling.n > 1 its completions are the sibling
                                         sequences seq_id + 0 .. seq_id + n - 1
    [ADD, seq_id, prompt_ids, sampling, output_ids]
                                         a request resumed after the core restarted, with
                                         the tokens it had generated (n = 1: each sibling
                                         comes on its own)
    [ABORT, seq_id]                      (one per sibling)
    [STATS, request_id]
    [ADAPTER, request_id, "load" | "unload", name, path]   a LoRA adapter at run time
supervisor -> core
    [GONE, frontend_index]               that frontend died: its clients are gone, so are
                                         its requests (before a new one says HELLO)
core -> frontend
    [INFO, group_info, healthy]          answers HELLO
    [OUT, seq_ids_u64, token_ids_i32, logprobs_f32, finished, errors, top]
        one step: a token for each listed sequence (little-endian arrays, logprobs empty
        when nobody asked), finished = [[seq_id, reason, cached_tokens, accepted,
        rejected, host_cached_tokens, queue_ms]] (accepted / rejected: prediction tokens;
        engine.usage), errors =
        [[seq_id, status code name, message]], top = [] when nobody asked for
        top_logprobs, else [k_u8 (one per listed sequence, 0 = none), ids_i32, logprobs_f32]
        with each sequence's k alternatives in turn; then, when some sequence pooled,
        pooled = [[seq_id, values_f32], ...] (its embedding or score; no token listed)
    [HEALTH, healthy]                    the worker group went down or came back
    [STATS, request_id, stats]
    [ADAPTER, request_id, error]         error: None (done) or [status code name, message]
    [ADAPTERS, [[id, name], ...]]        the LoRA adapters served now (to every frontend;
                                         INFO's group_info["adapters"] at HELLO)

A sequence id carries its frontend's index in its top bits (`owner`), so the core routes
a step's tokens without a lookup table.
"""
from __future__ import annotations

import dataclasses
import os

import msgpack

from scheduler_service.sequence import SamplingOptions

HELLO, ADD, ABORT, STATS, INFO, OUT, HEALTH, GONE, ADAPTER, ADAPTERS = range(10)
SUPERVISOR = b"sv"      # the supervisor's routing id

OWNER_SHIFT = 40        # seq_id = frontend index << 40 | per-frontend counter


def owner(seq_id: int) -> int:
    return seq_id >> OWNER_SHIFT


def identity(frontend_index: int) -> bytes:
    """The ZeroMQ routing id of frontend i."""
    return b"fe%d" % frontend_index


def tell_frontend_gone(ipc_dir: str, index: int) -> None:
    """From the supervisor: frontend `index` died (one short-lived socket; a core that is
    itself down has nothing to abort)."""
    import zmq
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, SUPERVISOR)
        sock.setsockopt(zmq.LINGER, 200)
        sock.connect(engine_address(ipc_dir))
        sock.send(pack([GONE, index]))
        sock.close()
    finally:
        ctx.term()


def engine_address(ipc_dir: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, 'engine')}"


pack = msgpack.Packer(use_bin_type=True).pack


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)


_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingOptions)]


def pack_sampling(s: SamplingOptions) -> list:
    return [getattr(s, name) for name in _SAMPLING_FIELDS]


def unpack_sampling(values: list) -> SamplingOptions:
    s = SamplingOptions(*values)
    s.stop_token_ids = tuple(s.stop_token_ids)
    s.logit_bias = tuple(map(tuple, s.logit_bias))
    s.prediction = tuple(s.prediction)
    s.score_ids = tuple(s.score_ids)
    return s
