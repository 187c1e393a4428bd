"""The engine core process: the Engine loop, its worker group and the frontends' socket.

It owns the queues, the BlockManager and the workers' Step streams, and nothing else:
tokenizing, detokenizing and streaming to clients happen in the frontend processes, so
the loop never waits behind client traffic for the GIL. Frontends talk to it over one
ZeroMQ ROUTER socket (ipc.py); each step's tokens go out as one message per frontend.

Started by the control plane's supervisor (scheduler_service.__main__), which restarts
it if it dies; a restarted core knows no requests, so frontends fail the ones they had
(UNAVAILABLE) and carry on once it is back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import time
from array import array
from dataclasses import dataclass, field

import grpc
import zmq
import zmq.asyncio

from nanoserve.adapter_root import describe
from nanoserve.security import channel_credentials
from nanoserve.worker_group import WorkerGroupError
from scheduler_service import ipc, metrics
from scheduler_service.api_keys import KeyRing, Quotas
from scheduler_service.engine import Engine, EngineStats, StepOutputs
from scheduler_service.fast_forward import FastForward
from scheduler_service.kv_events import AllBlocksCleared, KVEventsConfig, ZmqEventPublisher
from scheduler_service.speculation import SpecConfig, Speculator
from scheduler_service.scheduler import SchedulerConfig
from scheduler_service.worker_client import WorkerGroup, wait_for_group

log = logging.getLogger("nanoserve.engine")


@dataclass
class EngineCoreConfig:
    workers: list[str]
    ipc_dir: str
    block_size: int = 256
    num_kv_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0          # 0 = the workers' limit
    max_waiting: int = 1024
    overlap: bool = True
    fast_forward: bool = True            # --[no-]fast-forward (scheduler_service/fast_forward.py)
    model_dir: str = ""                  # its tokenizer.json, for fast-forward
    speculation: SpecConfig = field(default_factory=SpecConfig)   # scheduler_service/speculation.py
    log_level: str = "INFO"
    worker_tls_ca: str | None = None     # PEM paths: TLS to the workers when set
    worker_tls_cert: str | None = None   # our client cert, for workers that require one
    worker_tls_key: str | None = None
    worker_secret: str | None = None     # sent with every worker call
    adapters: tuple[tuple[str, str], ...] = ()   # --lora-modules: (name, path) each
    api_keys: str | None = None          # --api-keys FILE: per-key quotas (api_keys.py)
    priority_preemption_gap: int = 1     # --priority-preemption-gap (scheduler.py)
    max_background_prefill_tokens: int = 0   # --max-background-prefill-tokens (scheduler.py)
    task: str = "auto"                   # --task: what the APIs serve (nanoserve/model_task.py)
    kv_events: str = ""                  # --kv-events-config JSON (kv_events.py), "": off
    served_model_name: str = ""          # vLLM-named metrics' model_name ("": the model's dir)


class EngineCore:
    def __init__(self, config: EngineCoreConfig):
        self.config = config
        self.engine: Engine | None = None
        self.info: dict = {}
        self.sock: zmq.asyncio.Socket | None = None
        self.frontends: set[bytes] = set()
        self.quotas = Quotas(KeyRing(config.api_keys))   # per key, across all frontends
        self.kv_events: ZmqEventPublisher | None = None   # --kv-events-config

    async def serve(self, ready) -> None:
        """Connect to the workers, tell the supervisor (`ready`, a Connection), run."""
        cfg = self.config
        group = WorkerGroup(cfg.workers, credentials=channel_credentials(
            cfg.worker_tls_ca, cfg.worker_tls_cert, cfg.worker_tls_key), secret=cfg.worker_secret,
            adapters=self._saved_adapters())
        log.info("connecting to %d worker(s): %s", len(cfg.workers), ", ".join(cfg.workers))
        info = await wait_for_group(group, cfg.block_size, cfg.num_kv_blocks)
        if cfg.speculation.method == "draft" and not info.draft_model:
            raise WorkerGroupError("--speculative draft: the workers have no draft model "
                                   "(start them with --draft-model DIR)", lost=False)
        max_model_len = min(cfg.max_model_len or info.max_model_len, info.max_model_len)
        tasks = self._tasks(info.task)
        sched = SchedulerConfig(num_kv_blocks=info.num_kv_blocks, block_size=cfg.block_size,
                                max_num_seqs=cfg.max_num_seqs,
                                max_num_batched_tokens=cfg.max_num_batched_tokens,
                                max_model_len=max_model_len, eos_token_id=info.eos_token_id,
                                max_loras=info.max_loras,
                                num_host_kv_blocks=info.num_host_kv_blocks,
                                priority_preemption_gap=cfg.priority_preemption_gap,
                                max_background_prefill_tokens=cfg.max_background_prefill_tokens)
        self.group = group
        self.info = {**dataclasses.asdict(info), "max_model_len": max_model_len,
                     "adapters": self._adapter_names(), "task": ",".join(tasks)}
        self._adapter_op = asyncio.Lock()   # one load / unload at a time
        self._gone: set[int] = set()        # adapter ids unloaded (or being unloaded)
        # never reused while this core lives: its prefix cache keys blocks by adapter id
        self._next_adapter_id = max((i for i, _, _ in group.adapters), default=0) + 1
        ff = FastForward.for_model(cfg.model_dir, info) if cfg.fast_forward else None
        self.engine = Engine(group, info, sched, self._send_outputs, overlap=cfg.overlap,
                             on_health=self._send_health, fast_forward=ff,
                             speculator=Speculator(cfg.speculation, ff and ff.allowed))
        ctx = zmq.asyncio.Context()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)   # never drop a step's tokens
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        path = ipc.engine_address(cfg.ipc_dir)
        try:
            os.unlink(path.removeprefix("ipc://"))   # left by a core that died
        except FileNotFoundError:
            pass
        self.sock.bind(path)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.engine.stop)
        loop.add_signal_handler(signal.SIGHUP, self._reload_keys)
        ready.send(("ready", self.info))
        tasks = [asyncio.ensure_future(self._read())]
        if metrics.enabled():
            tasks.append(asyncio.ensure_future(self._sync_metrics()))
        if cfg.kv_events and (kv_cfg := KVEventsConfig.from_cli(cfg.kv_events)).active:
            self.kv_events = ZmqEventPublisher(kv_cfg)
            # a core that starts (or restarts: the workers' KV outlives it, but not its
            # index) holds nothing: routers that knew a core before us forget it
            self.engine.scheduler.block_manager.events = [AllBlocksCleared()]
            tasks.append(asyncio.ensure_future(self._flush_kv_events()))
        try:
            await self.engine.run()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.kv_events is not None:
                self.kv_events.close()
            await group.close()
            ctx.destroy(linger=0)
            if os.getppid() == 1:   # the supervisor died (SIGKILL): nobody else cleans up
                shutil.rmtree(cfg.ipc_dir, ignore_errors=True)

    def _tasks(self, served: str) -> tuple[str, ...]:
        """--task (auto: what the workers serve), each one the workers must serve."""
        from nanoserve import model_task
        workers = model_task.parse(served)
        if self.config.task == "auto":
            return workers
        tasks = model_task.resolve(self.config.task, None)
        if missing := [t for t in tasks if t not in workers]:
            raise WorkerGroupError(f"--task {','.join(missing)}: the workers serve "
                                   f"{','.join(workers)} (start them with --task)", lost=False)
        return tasks

    async def _sync_metrics(self, interval_s: float = 0.5) -> None:
        """Prometheus sees the engine's own counters, at most interval_s old."""
        name = self.config.served_model_name or os.path.basename(
            os.path.normpath(self.info.get("model") or self.config.model_dir))
        m = metrics.EngineCoreMetrics(name)
        while True:
            m.sync(self.engine, {i: n for i, n, _ in self.group.adapters})
            await asyncio.sleep(interval_s)

    async def _flush_kv_events(self, interval_s: float = 0.05) -> None:
        """KV events go out with each step's outputs; this sends those of idle spells (a
        worker's restart clearing the cache, evictions while nothing streams)."""
        while True:
            await asyncio.sleep(interval_s)
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        bm = self.engine.scheduler.block_manager
        if bm.events:
            self.kv_events.publish(bm.drain_events())

    # ---- frontends -> core ------------------------------------------------------------

    async def _read(self) -> None:
        sock, engine = self.sock, self.engine
        while True:
            ident, data = await sock.recv_multipart()
            msg = ipc.unpack(data)
            kind = msg[0]
            if kind == ipc.HELLO:
                self._hello(ident)
            elif kind == ipc.GONE and ident == ipc.SUPERVISOR:
                self._abort_owned_by(ipc.identity(msg[1]), "died")
                self.frontends.discard(ipc.identity(msg[1]))
            elif ident not in self.frontends:
                # Sent to the core before us and queued by ZeroMQ across its death (the
                # frontend had not noticed yet): once we answer its HELLO the frontend
                # resends every request it still holds, this one included.
                continue
            elif kind == ipc.ADD:
                self._add(ident, *msg[1:])
            elif kind == ipc.ABORT:
                engine.abort(msg[1])
                self.quotas.release(msg[1])
            elif kind == ipc.STATS:
                sock.send_multipart([ident, ipc.pack([ipc.STATS, msg[1], self._stats()])])
            elif kind == ipc.ADAPTER:
                asyncio.ensure_future(self._adapter(ident, *msg[1:]))

    def _saved_adapters(self) -> tuple[tuple[int, str, str], ...]:
        """The LoRA adapters to serve: --lora-modules, or the set a core before us (that
        died) had after loads and unloads at run time, which it left in the IPC folder."""
        try:
            with open(os.path.join(self.config.ipc_dir, "adapters.json")) as f:
                return tuple(tuple(a) for a in json.load(f))
        except FileNotFoundError:
            return tuple((i + 1, n, p) for i, (n, p) in enumerate(self.config.adapters))

    def _adapter_names(self) -> list[list]:
        """[[id, name], ...]: what frontends learn of the adapters (INFO, ADAPTERS)."""
        return [[i, n] for i, n, _ in self.group.adapters]

    def _save_adapters(self) -> None:
        path = os.path.join(self.config.ipc_dir, "adapters.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.group.adapters, f)
        os.replace(path + ".tmp", path)

    async def _adapter(self, ident: bytes, req_id: int, op: str, name: str, path: str) -> None:
        """Load or unload a LoRA adapter on every worker, then tell every frontend the
        set; answers [ADAPTER, req_id, error] (error: None or [status code name, message])."""
        async with self._adapter_op:
            error = await self._change_adapters(op, name, path)
        if error is None:
            self._save_adapters()
            self.info["adapters"] = self._adapter_names()
            for f in self.frontends:
                self.sock.send_multipart([f, ipc.pack([ipc.ADAPTERS, self.info["adapters"]])])
        self.sock.send_multipart([ident, ipc.pack([ipc.ADAPTER, req_id, error])])

    async def _change_adapters(self, op: str, name: str, path: str) -> list | None:
        old = self.group.adapters
        if not self.engine.info.max_loras:
            return ["FAILED_PRECONDITION", "the workers were started without --max-loras"]
        current = {n: i for i, n, _ in old}
        if op == "load":
            if name in current:
                return ["ALREADY_EXISTS", f"a LoRA adapter named `{name}` is already loaded"]
            new = (*old, (self._next_adapter_id, name, path))
            self._next_adapter_id += 1
        else:
            if name not in current:
                return ["NOT_FOUND", f"no LoRA adapter named `{name}` is loaded"]
            busy = sum(s.sampling.adapter_id == current[name] for s in self.engine.sequences())
            if busy:
                return ["FAILED_PRECONDITION", f"LoRA adapter `{name}` has {busy} request(s) "
                                               f"in flight: unload it once they finish"]
            new = tuple(a for a in old if a[1] != name)
            self._gone.add(current[name])   # _add refuses it from now on
        try:
            await self.group.set_adapters(new)
        except WorkerGroupError as e:
            cause = e.__cause__
            rpc = isinstance(cause, grpc.aio.AioRpcError)
            detail = cause.details() if rpc else str(e)
            code = cause.code().name if rpc else ""
            if code not in ("NOT_FOUND", "PERMISSION_DENIED"):   # a caller's path refused
                code = "INVALID_ARGUMENT"                        # (nanoserve/adapter_root.py)
            try:   # a rank that took the new set before another refused it goes back
                await self.group.set_adapters(old)
            except WorkerGroupError:
                pass   # a lost worker gets the group's set when it reconnects
            if op == "unload":
                self._gone.discard(current[name])
            return ["UNAVAILABLE" if e.lost else code, detail]
        log.info("LoRA adapter %s %sed (%s)", name, op, describe(path) or "-")
        return None

    def _hello(self, ident: bytes) -> None:
        """A frontend (re)connected: abort what an earlier incarnation of it left behind."""
        self._abort_owned_by(ident, "restarted")
        self.frontends.add(ident)

    def _abort_owned_by(self, ident: bytes, why: str) -> None:
        """Abort every sequence of frontend `ident`: queued, running, held siblings and adds
        the engine has not taken in yet. (Missing those, a frontend that said HELLO twice
        while its first resume was still pending resent its streams onto their first
        copies: 'already scheduled' errors failed them, seen in tests/test_chaos.py under
        CPU contention; and a restarted frontend, whose ids start over, would meet its
        earlier incarnation's.)"""
        index = int(ident[2:])
        stale = [s.seq_id for s in self.engine.sequences() if ipc.owner(s.seq_id) == index]
        for seq_id in stale:
            self.engine.abort(seq_id)
            self.quotas.release(seq_id)
        if stale:
            log.warning("frontend %d %s: aborted its %d requests", index, why, len(stale))
        self.sock.send_multipart([ident, ipc.pack([ipc.INFO, self.info, self.engine.healthy])])

    def _add(self, ident: bytes, seq_id: int, prompt: bytes, sampling: list,
             output: bytes = b"") -> None:
        """A new request, or (output: its tokens so far) one a frontend resumes after the
        engine core it was sent to died."""
        engine = self.engine
        if engine.num_pending() >= self.config.max_waiting and not output:
            self._send_outputs(StepOutputs(errors=[(
                seq_id, "RESOURCE_EXHAUSTED",
                f"too many requests in flight (limit {self.config.max_waiting})")]))
            return
        opts = ipc.unpack_sampling(sampling)
        a = opts.adapter_id
        if a and (a in self._gone or all(a != i for i, _, _ in self.group.adapters)):
            self._send_outputs(StepOutputs(errors=[(
                seq_id, "NOT_FOUND", "the LoRA adapter this request names was unloaded")]))
            return
        ids, out = array("i"), array("i")
        ids.frombytes(prompt)
        out.frombytes(output)
        if output:
            self.quotas.track(seq_id, opts.tenant)
        elif refused := self.quotas.admit(seq_id, opts.tenant, opts.n,
                                          len(ids) + opts.max_tokens * opts.n):
            why, retry_s = refused
            self._send_outputs(StepOutputs(errors=[(
                seq_id, "RESOURCE_EXHAUSTED", f"{why} (retry after {math.ceil(retry_s)} s)")]))
            return
        engine.add_request(seq_id, ids.tolist(), opts,
                           time.monotonic(), out.tolist())

    def _stats(self) -> dict:
        e = self.engine
        sched = e.scheduler
        return {"num_waiting": len(sched.waiting), "num_running": len(sched.running),
                "num_kv_blocks": sched.block_manager.num_blocks,
                "num_free_kv_blocks": sched.block_manager.num_free_blocks,
                "num_preemptions": sched.num_preemptions, "workers_healthy": e.healthy,
                "num_priority_preemptions": sched.num_priority_preemptions,
                "num_deadline_drops": sched.num_deadline_drops,
                "num_fast_forward_mismatches": sched.num_fast_forward_mismatches,
                "num_host_kv_blocks": sched.block_manager.num_host_blocks,
                "num_host_kv_offloaded_blocks": sched.block_manager.num_offloaded,
                "num_host_kv_restored_blocks": sched.block_manager.num_restored,
                "deterministic": e.info.deterministic,
                **dataclasses.asdict(e.stats)}

    # ---- core -> frontends ------------------------------------------------------------

    def _reload_keys(self) -> None:
        if self.quotas.ring.reload():
            self.quotas.reload()

    def _send_outputs(self, out: StepOutputs) -> None:
        """One message per frontend that has sequences in this step's output."""
        if self.kv_events is not None:
            self._publish_kv_events()
        if self.quotas.owner:   # sequences of keys with limits end
            for f in out.finished:
                self.quotas.release(f[0])
            for e in out.errors:
                self.quotas.release(e[0])
        shift = ipc.OWNER_SHIFT
        owners = {s >> shift for s in out.seq_ids}
        owners.update(f[0] >> shift for f in out.finished)
        owners.update(e[0] >> shift for e in out.errors)
        owners.update(p[0] >> shift for p in out.pooled)
        if len(owners) == 1:   # the usual case: one frontend
            self._send_part(owners.pop(), out)
            return
        for owner in owners:
            rows = [i for i, s in enumerate(out.seq_ids) if s >> shift == owner]
            self._send_part(owner, StepOutputs(
                seq_ids=[out.seq_ids[i] for i in rows], token_ids=[out.token_ids[i] for i in rows],
                logprobs=None if out.logprobs is None else [out.logprobs[i] for i in rows],
                top_logprobs=None if out.top_logprobs is None else [out.top_logprobs[i] for i in rows],
                finished=[f for f in out.finished if f[0] >> shift == owner],
                errors=[e for e in out.errors if e[0] >> shift == owner],
                pooled=[p for p in out.pooled if p[0] >> shift == owner]))

    def _send_part(self, owner: int, out: StepOutputs) -> None:
        msg = [ipc.OUT, array("Q", out.seq_ids).tobytes(), array("i", out.token_ids).tobytes(),
               array("f", out.logprobs).tobytes() if out.logprobs is not None else b"",
               out.finished, out.errors, _pack_top(out.top_logprobs)]
        if out.pooled:   # embeddings and scores (ipc.py)
            msg.append(out.pooled)
        self.sock.send_multipart([ipc.identity(owner), ipc.pack(msg)])

    def _send_health(self, healthy: bool) -> None:
        for ident in self.frontends:
            self.sock.send_multipart([ident, ipc.pack([ipc.HEALTH, healthy])])


def _pack_top(top: list[tuple[list[int], list[float]]] | None) -> list:
    """ipc.py's OUT `top` item: [k per sequence (u8), all ids (i32), all logprobs (f32)]."""
    if top is None:
        return []
    ids, lps = array("i"), array("f")
    for t_ids, t_lps in top:
        ids.extend(t_ids)
        lps.extend(t_lps)
    return [bytes(len(t[0]) for t in top), ids.tobytes(), lps.tobytes()]


def run(config: EngineCoreConfig, ready) -> None:
    """Process entry point (multiprocessing, spawn)."""
    from scheduler_service.supervision import child_setup
    child_setup(config.log_level, "engine core")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the supervisor decides when we stop
    try:
        asyncio.run(EngineCore(config).serve(ready))
    except WorkerGroupError as e:
        log.error("engine core: %s", e)
        ready.send(("error", str(e)))
        raise SystemExit(1)
