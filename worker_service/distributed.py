"""Tensor-parallel process group of one worker: preconditions, rendezvous, failure policy.

World size N = N worker processes (one per GPU), joined by torch.distributed: NCCL on
CUDA, gloo on CPU (so CI runs TP). Ranks meet at a TCP rendezvous (`--dist-init
tcp://host:port`, rank 0 listens there) and, before any collective, check that they
agree on the world size, the model and the backend: a mismatch would otherwise show up
as a hang or a shape error deep inside the first all-reduce.

Failure policy (the contract documented in worker.proto and --help): a torch.distributed
group cannot lose a member and carry on, so a worker whose group breaks *exits* with
status EXIT_GROUP_BROKEN and leaves restarting to its supervisor (compose, systemd, k8s);
the scheduler reconnects and re-prefills once every rank is back. A group breaks when:

* a step fails on this rank for any reason other than a StepError (StepErrors are
  raised before the forward, identically on every rank, so the group stays in step);
  that covers a collective that fails because a peer died (gloo notices a closed socket
  at once; a silent peer is caught by the collective timeout, `--dist-timeout`);
* rank 0, which hosts the rendezvous store, goes away (a watcher on every other rank
  polls the store), so idle ranks do not linger in a dead group;
* a peer stops beating: every rank's watcher bumps its own heartbeat counter in the
  store each second and checks the others'; one that has not moved for
  `--heartbeat-timeout` seconds (default 5) means the peer is dead or hung. Without this
  a rank blocked in an NCCL collective with a dead peer only learns of it after NCCL's
  own timeout (~80 s);
* a restarted peer finds its rank already taken at the rendezvous: it marks the old
  group abandoned, the old group's live ranks exit, and everyone meets afresh.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator, NoReturn
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from models import fast_all_reduce
from models.parallel import TPGroup
from worker_service.model_runner import ModelRunner, StepError
from worker_service.phases import phase

log = logging.getLogger("nanoserve.worker")

EXIT_GROUP_BROKEN = 69          # sysexits EX_UNAVAILABLE: restart the whole TP group
_PREFIX = "nanoserve/"
_ABANDON = _PREFIX + "abandon"  # set by a restarted rank that found a stale group
WATCH_INTERVAL_S = 1.0


class TPConfigError(ValueError):
    """The model cannot be split over the requested world size, or ranks disagree."""


@dataclass(frozen=True)
class DistConfig:
    rank: int
    world_size: int
    init_method: str          # tcp://host:port, rank 0 listens there
    timeout_s: float          # rendezvous and collective timeout
    backend: str              # "nccl" or "gloo"
    heartbeat_timeout_s: float = 5.0   # a peer silent this long is dead
    all_reduce: str = "auto"  # "auto": peer memory for decode-sized tensors, fused with the
    # norms after them; "unfused": the same without that fusion; "nccl": NCCL only


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def model_fingerprint(model_dir: str) -> str:
    """Hash of config.json (the same value ModelRunner reports in WorkerInfo)."""
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def check_tp_config(config: dict, world_size: int) -> None:
    """Raise TPConfigError unless every sharded dimension of the model divides by N.

    Runs before the rendezvous so a bad world size fails every rank at once with a
    message naming the dimension, not later inside a layer constructor."""
    if world_size < 1:
        raise TPConfigError(f"--world-size must be >= 1, got {world_size}")
    if world_size == 1:
        return
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if world_size > kv_heads:
        raise TPConfigError(
            f"--world-size {world_size} exceeds num_key_value_heads={kv_heads}: replicating KV "
            f"heads across ranks is not supported; use a world size that divides {kv_heads}")
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", config["intermediate_size"])):
        if value % world_size:
            raise TPConfigError(f"{name}={value} is not divisible by --world-size {world_size}")


def _host_port(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise TPConfigError(f"--dist-init must be tcp://host:port, got {init_method!r}")
    return url.hostname, url.port


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def _rendezvous(cfg: DistConfig, fingerprint: str) -> dist.TCPStore:
    """Connect to rank 0's store and claim this rank; retry while a stale group holds it."""
    host, port = _host_port(cfg.init_method)
    deadline = time.monotonic() + cfg.timeout_s
    while True:
        left = max(deadline - time.monotonic(), 1.0)
        try:
            store = dist.TCPStore(host, port, None, is_master=cfg.rank == 0,
                                  timeout=datetime.timedelta(seconds=left), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - rewrap: torch's text is a C++ backtrace
            where = "listen on" if cfg.rank == 0 else "reach rank 0 at"
            raise RuntimeError(f"cannot {where} {cfg.init_method}: "
                               f"{_first_line(e)}") from e
        if store.add(f"{_PREFIX}join/{cfg.rank}", 1) == 1:
            break
        # This rank already joined the group behind this store: we are its replacement.
        # Tell the old group's live ranks to exit (their watcher sees the key), then retry
        # against the fresh rank 0 their supervisor starts.
        log.warning("rank %d already taken at %s: a stale group is still up; asking it to "
                    "exit and retrying", cfg.rank, cfg.init_method)
        store.set(_ABANDON, str(cfg.rank))
        del store
        if time.monotonic() > deadline:
            raise RuntimeError(f"a stale group kept {cfg.init_method} for "
                               f"{cfg.timeout_s:.0f}s")
        time.sleep(WATCH_INTERVAL_S)

    mine = {"world_size": cfg.world_size, "fingerprint": fingerprint, "backend": cfg.backend,
            "all_reduce": cfg.all_reduce}
    store.set(f"{_PREFIX}rank/{cfg.rank}", json.dumps(mine))
    problem = None
    for r in range(cfg.world_size):
        key = f"{_PREFIX}rank/{r}"
        try:
            store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"rank {r} did not join {cfg.init_method} within "
                               f"{cfg.timeout_s:.0f}s (--dist-timeout)") from e
        theirs = json.loads(store.get(key))
        problem = next((f"rank {r} has {what} {theirs[what]!r}, rank {cfg.rank} has {value!r}: "
                        "every rank must be started alike"
                        for what, value in mine.items() if theirs[what] != value), None)
        if problem:
            break
    checked = store.add(f"{_PREFIX}checked", 1)
    if problem:
        if cfg.rank == 0:   # the store dies with us: give the others a moment to read it
            end = time.monotonic() + 5.0
            while checked < cfg.world_size and time.monotonic() < end:
                time.sleep(0.1)
                checked = store.add(f"{_PREFIX}checked", 0)
        raise TPConfigError(problem)
    return store


class DistGroup:
    """The joined process group of this worker plus its liveness watcher.

    Joining is split so start-up overlaps it with the weights load: the constructor meets
    the peers (store, checks, process group: fail fast on a bad config) and starts the
    watcher; then, while the main thread loads weights, a thread builds NCCL's
    communicators (the first all-reduce, ~1-1.5 s on 2x H100) as another allocates the
    peer-memory buffer (torch's one-time symmetric-memory set-up, ~2.5-3.5 s), and the
    ranks agree on peer memory. `wait_joined` returns once that is done; the runner calls
    it before its first forward."""

    def __init__(self, cfg: DistConfig, device: torch.device, fingerprint: str):
        self.cfg = cfg
        self._closing = threading.Event()
        self._joined = threading.Event()
        self._join_error: BaseException | None = None
        self.steps: list[str] = []    # the rendezvous, step by step, for the log
        t = time.perf_counter()
        store = _rendezvous(cfg, fingerprint)
        self.steps.append(f"store and peers' checks {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        dist.init_process_group(cfg.backend, store=store, rank=cfg.rank,
                                world_size=cfg.world_size, timeout=timeout)
        self.steps.append(f"process group {time.perf_counter() - t:.1f} s")
        self.tp = TPGroup(rank=cfg.rank, size=cfg.world_size)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        threading.Thread(target=self._finish_join, args=(device,), name="tp-join",
                         daemon=True).start()

    def _finish_join(self, device: torch.device) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)   # this thread's current device: the rank's GPU
            t = time.perf_counter()
            peer = self.cfg.all_reduce in ("auto", "unfused") and device.type == "cuda"
            buffer: list = []   # this rank's peer-memory buffer, allocated beside NCCL's set-up
            alloc = threading.Thread(
                target=lambda: buffer.append(fast_all_reduce.allocate(device)), daemon=True,
                name="tp-peer-memory")
            if peer:
                alloc.start()
            # NCCL builds its communicators on the first collective: better here, with a
            # clear error, than inside the memory-profiling forward.
            all_ranks_meet(device, self.cfg.world_size, "all-reduce warm-up")
            self.steps.append(f"first all-reduce at {time.perf_counter() - t:.1f} s")
            fast = None
            if peer:
                alloc.join()
                self.steps.append(f"peer buffer at {time.perf_counter() - t:.1f} s")
                fast = fast_all_reduce.create(device, buffer=buffer[0],
                                              fused=self.cfg.all_reduce == "auto")
                self.steps.append(f"peer memory agreed at {time.perf_counter() - t:.1f} s")
            self.tp.use_peer_memory(fast)
            log.info("rank %d/%d joined %s over %s%s (%s)", self.cfg.rank, self.cfg.world_size,
                     self.cfg.init_method, self.cfg.backend, " (peer-memory all-reduce up to "
                     f"{fast.two_shot_max >> 20} MiB)" if fast else "", ", ".join(self.steps))
        except BaseException as e:  # noqa: BLE001 - handed to wait_joined's caller
            self._join_error = e
        finally:
            self._joined.set()

    def wait_joined(self) -> None:
        """Block until the join thread is done; a group that could not form breaks."""
        self._joined.wait()
        if self._join_error is not None:
            group_broken(f"joining the group failed on rank {self.cfg.rank}: "
                         f"{_first_line(self._join_error)}")

    def _watch(self) -> None:
        """Exit when rank 0's store disappears, a replacement rank abandons this group or a
        peer's heartbeat stops."""
        host, port = _host_port(self.cfg.init_method)
        try:   # own connection: never shares a socket with the process group's store use
            store = dist.TCPStore(host, port, None, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=max(self.cfg.timeout_s, 5.0)))
        except Exception as e:  # noqa: BLE001
            group_broken(f"rendezvous store at {self.cfg.init_method} unreachable: {_first_line(e)}")
        rank, now = self.cfg.rank, time.monotonic()
        beats = {r: (-1, now) for r in range(self.cfg.world_size) if r != rank}
        while not self._closing.wait(WATCH_INTERVAL_S):
            try:
                abandoned = store.check([_ABANDON])
                store.add(f"{_PREFIX}beat/{rank}", 1)
                now = time.monotonic()
                for r, (last, since) in beats.items():
                    count = store.add(f"{_PREFIX}beat/{r}", 0)
                    if count != last:
                        beats[r] = (count, now)
                    elif now - since > self.cfg.heartbeat_timeout_s and not self._closing.is_set():
                        group_broken(f"rank {r} sent no heartbeat for "
                                     f"{now - since:.1f}s (--heartbeat-timeout): it is dead or hung")
            except Exception as e:  # noqa: BLE001
                if self._closing.is_set():
                    return
                group_broken(f"lost the rendezvous store at {self.cfg.init_method} "
                             f"(rank 0 is gone): {_first_line(e)}")
            if abandoned:
                group_broken(f"rank {store.get(_ABANDON).decode()} was restarted and rejoined "
                             f"{self.cfg.init_method}: this group is stale")

    def stop_watching(self) -> None:
        """Clean shutdown begins: rank 0 leaving is expected from now on."""
        self._closing.set()

    def close(self) -> None:
        """Clean shutdown (SIGTERM): stop watching, then tear the group down."""
        self._closing.set()
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            log.warning("destroy_process_group: %s", _first_line(e))


def all_ranks_meet(device: torch.device, world_size: int, what: str) -> None:
    """One all-reduce of ones over the default group: returns once every rank made the
    same call, and checks that all world_size of them took part."""
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != world_size:
        raise RuntimeError(f"{what} summed {probe.item()}, expected {world_size}")


def group_broken(reason: str) -> NoReturn:
    """Exit now with EXIT_GROUP_BROKEN.

    os._exit, not sys.exit: threads may be blocked inside a collective that will never
    finish, and the scheduler learns faster from a closed connection (UNAVAILABLE, which
    it answers by reconnecting and re-prefilling) than from a half-alive worker."""
    log.critical("tensor-parallel group broken: %s; exiting with status %d so the group can "
                 "be restarted", reason, EXIT_GROUP_BROKEN)
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stderr.flush()
    os._exit(EXIT_GROUP_BROKEN)


class TPModelRunner(ModelRunner):
    """ModelRunner of a rank in a group of N > 1: a failed step breaks the group.

    The server drives launch/finish (step is finish(launch())), so both are guarded, and
    Init (init_kv), whose CUDA graph capture runs the model's collectives."""

    def __init__(self, config, group: DistGroup) -> None:
        self.group = group
        super().__init__(config, group.tp)

    def _await_group(self) -> None:
        with phase(self.phases, "group set-up left"):
            self.group.wait_joined()

    def init_kv(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        """Meet every peer in an all-reduce on this rank's device before anything else.

        Init is a collective call: capturing CUDA graphs runs the model's all-reduces, so
        every rank must be inside Init at the same time (the scheduler sends them
        concurrently). Capture happens only on CUDA; this barrier makes the rule hold on
        every backend, so a scheduler that Inits ranks one by one hangs and breaks the
        group on CPU (gloo, CI) exactly as it does under NCCL."""
        with _group_guard("Init", self.tp.rank):
            self._bind_device()
            all_ranks_meet(self.device, self.tp.size, "Init barrier")
            super().init_kv(num_blocks, block_size, num_host_blocks)

    def launch(self, req):
        with _group_guard(f"step {req.step_id}", self.tp.rank):
            return super().launch(req)

    def finish(self, pending):
        with _group_guard(f"step {pending.step_id}", self.tp.rank):
            return super().finish(pending)


@contextlib.contextmanager
def _group_guard(what: str, rank: int) -> Iterator[None]:
    """Let StepErrors through (raised before the forward, on every rank alike: the group is
    intact); any other exception means a collective failed or will never be matched."""
    try:
        yield
    except StepError:
        raise
    except Exception as e:  # noqa: BLE001
        log.exception("%s failed", what)
        group_broken(f"{what} failed on rank {rank}: {_first_line(e)}")
