"""A frontend's handle on the engine core: submit, abort, stats, and each request's results.

One ZeroMQ DEALER socket to the core's ROUTER (ipc.py). A reader task takes each step's
message and appends every sequence's token to its RequestStream; the gRPC handler that
owns the stream wakes only if it is waiting, and takes everything that arrived since
its last look (a busy frontend sends several steps' tokens in one message instead of
falling behind).

The socket's monitor tells when the core goes away (the connection drops the moment the
process dies). New requests are then refused (UNAVAILABLE) until the restarted core
answers our HELLO, but those in flight are not lost: each stream keeps its prompt, its
sampling and every token it has received, and once the core is back each unfinished
sequence is added again with those tokens as output already generated. The new core
re-prefills them and decoding goes on where it stopped: the handlers never notice, and
greedy or seeded streams continue exactly as they would have (the worker draws a seeded
token's noise from (seed, position), not from how many draws came before).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from array import array
from typing import Any, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from scheduler_service import ipc
from scheduler_service.sequence import SamplingOptions, sibling_options
from scheduler_service.turn_budget import TurnBudget

log = logging.getLogger("nanoserve.frontend")


class EngineUnavailable(RuntimeError):
    pass


class RequestStream:
    """Results of one sequence (one of a request's n completions) not yet taken by its handler."""
    __slots__ = ("seq_id", "token_ids", "logprobs", "top_logprobs", "finish", "error", "_waiter",
                 "_first", "prompt_ids", "sampling", "sibling", "generated", "pooled")

    def __init__(self, seq_id: int, prompt_ids: array | None = None,
                 sampling: SamplingOptions | None = None, sibling: int = 0):
        self.seq_id = seq_id
        # What a restarted engine core needs to resume it (shared by siblings but `sibling`):
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.sibling = sibling              # which of the request's n completions
        self.generated = array("i")         # every token received, handed out or not
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[tuple[list[int], list[float]]] = []  # one per token when asked
        self.finish: tuple | None = None   # (reason, *engine.usage(seq))
        self.error: tuple[str, str] | None = None    # (status code name, message)
        self.pooled: bytes | None = None   # a pooling request's answer (float32), at its finish
        self._waiter: asyncio.Future | None = None
        self._first = True    # nothing handed out yet: the next delta carries the TTFT

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self, turns: TurnBudget
                   ) -> tuple[list[int], list[float], list[tuple[list[int], list[float]]],
                              tuple[str, int] | None, tuple[str, str] | None]:
        """Everything that arrived since the last call (waits for something, then for a
        grant from `turns`, at once for the first): (token ids, logprobs, top logprobs,
        finish, error)."""
        while not (self.token_ids or self.finish or self.error):
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        await turns.take(first=self._first)
        self._first = False
        ids, self.token_ids = self.token_ids, []
        lps, self.logprobs = self.logprobs, []
        top, self.top_logprobs = self.top_logprobs, []
        return ids, lps, top, self.finish, self.error


class EngineClient:
    def __init__(self, ipc_dir: str, index: int,
                 on_state: Callable[[bool], None] | None = None):
        self.address = ipc.engine_address(ipc_dir)
        self.index = index
        self.on_state = on_state or (lambda serving: None)
        self.info: dict = {}
        self.connected = False     # the core answered our HELLO and has not gone away
        self.workers_healthy = False
        self.streams: dict[int, RequestStream] = {}
        self._seq_ids = itertools.count(1)
        self._stats_ids = itertools.count(1)
        self._stats: dict[int, asyncio.Future] = {}   # STATS and ADAPTER answers
        self.adapters: dict[str, int] = {}   # LoRA adapters served: name -> the core's id
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def serving(self) -> bool:
        return self.connected and self.workers_healthy

    async def start(self, timeout: float | None = None) -> dict:
        """Connect and wait for the core's INFO: by default as long as the core takes to
        reach the workers (the supervisor starts frontends beside a core whose workers may
        load for minutes, and stops a frontend whose core died)."""
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, ipc.identity(self.index))
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.ensure_future(self._watch(monitor)),
                       asyncio.ensure_future(self._read())]
        self.sock.connect(self.address)
        await asyncio.wait_for(self._ready.wait(), timeout)
        return self.info

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)   # every socket, the monitor's too

    # ---- requests ---------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], sampling: SamplingOptions) -> list[RequestStream]:
        """One stream per completion: sampling.n consecutive sequence ids, which the core
        turns into n sibling sequences (ipc.py)."""
        if not self.connected:
            raise EngineUnavailable("the engine core is not available (restarting?)")
        base = self.index << ipc.OWNER_SHIFT | next(self._seq_ids)
        for _ in range(sampling.n - 1):   # reserve the siblings' ids
            next(self._seq_ids)
        prompt = array("i", prompt_ids)
        streams = [RequestStream(base + i, prompt, sampling, i) for i in range(sampling.n)]
        for s in streams:
            self.streams[s.seq_id] = s
        self.sock.send(ipc.pack([ipc.ADD, base, prompt.tobytes(), ipc.pack_sampling(sampling)]))
        return streams

    def release(self, stream: RequestStream, abort: bool) -> None:
        """The handler is done with `stream`; abort=True also stops the sequence."""
        self.streams.pop(stream.seq_id, None)
        if abort and self.connected:
            self.sock.send(ipc.pack([ipc.ABORT, stream.seq_id]))

    async def stats(self, timeout: float = 5.0) -> dict:
        return await self._ask(timeout, ipc.STATS)

    async def change_adapter(self, op: str, name: str, path: str = "",
                             timeout: float = 600.0) -> list | None:
        """Load ("load") or unload a LoRA adapter through the core: None, or the error
        [status code name, message]. Loading reads the files on every worker: slow."""
        return await self._ask(timeout, ipc.ADAPTER, op, name, path)

    async def _ask(self, timeout: float, kind: int, *args) -> Any:
        """Send [kind, request id, *args] to the core; its answer's payload."""
        if not self.connected:
            raise EngineUnavailable("the engine core is not available")
        req_id = next(self._stats_ids)
        fut = self._stats[req_id] = asyncio.get_running_loop().create_future()
        self.sock.send(ipc.pack([kind, req_id, *args]))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"the engine core did not answer in {timeout:g}s") from None
        finally:
            self._stats.pop(req_id, None)

    # ---- core -> us -------------------------------------------------------------------

    async def _read(self) -> None:
        streams = self.streams
        while True:
            msg = ipc.unpack(await self.sock.recv())
            kind = msg[0]
            if kind == ipc.OUT:
                _, seq_ids, token_ids, logprobs, finished, errors, top, *pooled = msg
                for seq_id, values in pooled[0] if pooled else ():   # before their finish
                    if (s := streams.get(seq_id)) is not None:
                        s.pooled = values
                ids = array("Q")
                ids.frombytes(seq_ids)
                toks = array("i")
                toks.frombytes(token_ids)
                if logprobs:
                    lps = array("f")
                    lps.frombytes(logprobs)
                    for seq_id, tok, lp in zip(ids, toks, lps):
                        if (s := streams.get(seq_id)) is not None:
                            s.token_ids.append(tok)
                            s.generated.append(tok)
                            s.logprobs.append(lp)
                            s._wake()
                else:
                    for seq_id, tok in zip(ids, toks):
                        if (s := streams.get(seq_id)) is not None:
                            s.token_ids.append(tok)
                            s.generated.append(tok)
                            s._wake()
                if top:
                    self._add_top_logprobs(ids, top)
                for seq_id, reason, *usage in finished:
                    if (s := streams.get(seq_id)) is not None:
                        s.finish = (reason, *usage)
                        s._wake()
                for seq_id, code, message in errors:
                    if (s := streams.get(seq_id)) is not None:
                        s.error = (code, message)
                        s._wake()
            elif kind in (ipc.STATS, ipc.ADAPTER):
                fut = self._stats.get(msg[1])
                if fut is not None and not fut.done():
                    fut.set_result(msg[2])
            elif kind == ipc.ADAPTERS:
                self.adapters = {name: i for i, name in msg[1]}
            elif kind == ipc.HEALTH:
                self.workers_healthy = msg[1]
                self.on_state(self.serving)
            elif kind == ipc.INFO:
                self.info, self.workers_healthy = msg[1], msg[2]
                self.adapters = {name: i for i, name in self.info.get("adapters") or ()}
                self.connected = True
                self._ready.set()
                log.info("engine core connected (workers %s)",
                         "healthy" if self.workers_healthy else "not ready")
                self._resume_all()
                self.on_state(self.serving)

    def _resume_all(self) -> None:
        """Add every unfinished stream again to a (re)started core, each sibling on its own
        with its own seed, its tokens so far as output already generated. A stream whose
        last token already ended it (the finish was lost with the core) ends here."""
        resumed = 0
        for s in self.streams.values():
            if s.finish or s.error or s.prompt_ids is None:
                continue
            opts = sibling_options(s.sampling, s.sibling)
            if s.generated and self._ended(s, opts):
                continue
            self.sock.send(ipc.pack([ipc.ADD, s.seq_id, s.prompt_ids.tobytes(),
                                     ipc.pack_sampling(opts), s.generated.tobytes()]))
            resumed += 1
        if resumed:
            log.warning("engine core back: resumed %d requests", resumed)

    def _ended(self, s: RequestStream, opts: SamplingOptions) -> bool:
        """Finish `s` here if its tokens already end it (length, or a stop id as the core's
        Scheduler would have judged it); True if so."""
        last = s.generated[-1]
        if (len(s.generated) >= opts.max_tokens
                or len(s.prompt_ids) + len(s.generated) >= self.info["max_model_len"]):
            s.finish = ("length", 0, 0, 0, 0, 0.0)
        elif last in opts.stop_token_ids or (not opts.ignore_eos
                                              and last == self.info.get("eos_token_id")):
            s.finish = ("stop", 0, 0, 0, 0, 0.0)
        else:
            return False
        s._wake()
        return True

    def _add_top_logprobs(self, seq_ids: array, top: list) -> None:
        """top = [k per listed sequence (u8), their ids (i32), their logprobs (f32)]."""
        ks = array("B")
        ks.frombytes(top[0])
        ids = array("i")
        ids.frombytes(top[1])
        lps = array("f")
        lps.frombytes(top[2])
        pos = 0
        for seq_id, k in zip(seq_ids, ks):
            if not k:
                continue
            if (s := self.streams.get(seq_id)) is not None:
                s.top_logprobs.append((ids[pos:pos + k].tolist(), lps[pos:pos + k].tolist()))
            pos += k

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                self.sock.send(ipc.pack([ipc.HELLO]))
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self._lost()

    def _lost(self) -> None:
        """The core went away with its queues and KV; the streams stay, to be resumed."""
        self.connected = False
        log.error("engine core went away: %d requests in flight wait for it to come back",
                  len(self.streams))
        for fut in self._stats.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable("the engine core went away"))
        self.on_state(False)
