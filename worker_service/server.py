"""gRPC server for the internal Worker API (protos/nanoserve/v1/worker.proto).

One scheduler drives a worker. Its Step stream is launched strictly in order on one
thread and answered strictly in order on another (the one serving the stream), so the
ModelRunner needs no locking beyond Init vs launch. The answering thread waits on CUDA
events without the GIL and needs it back quickly while a launch runs: `serve` shortens
the interpreter's switch interval for that.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from concurrent import futures

import grpc

from nanoserve.security import OPEN_WORKER, SyncGuard, add_port
from nanoserve.worker_group import steps_in
from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service.adapters import AdapterError
from worker_service.metrics import WorkerMetrics
from worker_service.model_runner import ModelRunner, StepError
from worker_service.phases import phases_line

log = logging.getLogger("nanoserve.worker")

MAX_MESSAGE_BYTES = 256 << 20
# Python's 5 ms default would let a launching thread hold the GIL for up to 5 ms while a
# finished step's answer waits.
SWITCH_INTERVAL_S = 0.0005


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, model_name: str, profile=None):
        self.runner = runner
        self.profile = profile   # StepProfile (--profile-steps) or None
        self.model_name = model_name
        self.lock = threading.Lock()   # Init and Step never overlap
        self.steps = self.steps_overlapped = 0
        self._launched = self._answered = 0   # steps (each counter written by one thread)
        self.metrics = WorkerMetrics(runner.tp.rank)

    def Info(self, request, context):
        block_size = request.block_size or 16
        r = self.runner
        return worker_pb2.WorkerInfo(
            rank=r.tp.rank, world_size=r.tp.size, model=self.model_name,
            model_fingerprint=r.fingerprint, num_kv_blocks=r.kv_capacity(block_size),
            block_size=block_size, vocab_size=r.vocab_size, max_model_len=r.max_model_len,
            eos_token_id=r.eos_token_id, device=str(r.device), dtype=str(r.dtype).removeprefix("torch."),
            attention_backend=r.backend.name, kv_cache_dtype=r.kv_cache_dtype_name,
            structured_output=r.grammar_tokenizer is not None,
            max_loras=r.config.max_loras, max_lora_rank=r.config.max_lora_rank,
            num_host_kv_blocks=r.host_capacity(block_size),
            draft_model=r.drafter.name if r.drafter is not None else "",
            task=",".join(r.config.tasks), hidden_size=r.hf_config.hidden_size,
            deterministic=r.config.deterministic)

    def Init(self, request, context):
        t0 = time.perf_counter()
        if request.num_kv_blocks == 0 or request.block_size == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_kv_blocks and block_size must be > 0")
        with self.lock:
            capacity = self.runner.kv_capacity(request.block_size)
            if request.num_kv_blocks > capacity:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{request.num_kv_blocks} blocks asked, {capacity} fit")
            if request.adapters and self.runner.adapters is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{len(request.adapters)} LoRA adapter(s) sent, but this worker "
                              f"was started without --max-loras")
            if self.runner.adapters is not None:
                try:
                    self.runner.adapters.set_adapters(request.adapters)
                except AdapterError as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            host = min(request.num_host_kv_blocks, self.runner.host_capacity(request.block_size))
            self.runner.init_kv(request.num_kv_blocks, request.block_size, host)
            self.steps = self.steps_overlapped = 0
        self.metrics.initialized(request.num_kv_blocks, request.block_size)
        log.info("KV cache: %d blocks of %d tokens, %s (Init: %.1f s with CUDA graphs and "
                 "adapters: %s)", request.num_kv_blocks, request.block_size,
                 self.runner.kv_cache_dtype_name, time.perf_counter() - t0,
                 phases_line(self.runner.init_phases))
        return worker_pb2.InitResponse(num_kv_blocks=request.num_kv_blocks)

    def SetAdapters(self, request, context):
        """The LoRA adapters to serve from now on, while steps run (models/lora.py)."""
        store = self.runner.adapters
        if store is None:
            if request.adapters:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              "this worker was started without --max-loras")
            return worker_pb2.AdapterSet()
        try:
            store.set_adapters(request.adapters)
        except AdapterError as e:   # NOT_FOUND / PERMISSION_DENIED: a caller's path refused
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        log.info("LoRA adapters: %s", ", ".join(a.name for a in request.adapters) or "none")
        return worker_pb2.AdapterSet(adapters=request.adapters)

    def Step(self, request_iterator, context):
        """Launch each step on a thread of its own the moment it arrives, so the GPU goes
        from one step to the next without waiting for our answer's round trip, and answer
        each here, in order, the moment its GPU work is done. Launching and answering never
        wait for each other: a long launch (an eager prefill's hundreds of kernels) does
        not hold back the answer of the step before it, which the scheduler needs to send
        the next one."""
        launched: queue.Queue = queue.Queue()   # pending steps, or (status, message), None: end

        def launch_all() -> None:
            try:
                for message in request_iterator:
                    for req in steps_in(message):
                        self.steps += 1
                        self.steps_overlapped += self._answered < self._launched
                        if self.profile is not None:
                            self.profile.before(self.steps)
                        pending, error = self._launch(req)
                        if self.profile is not None:
                            self.profile.after(self.steps)
                        self._launched += 1
                        launched.put(error or pending)
                        if error:
                            return
            except Exception:  # noqa: BLE001 - the stream was cancelled; end as if closed
                pass
            finally:
                launched.put(None)

        threading.Thread(target=launch_all, name="step-launcher", daemon=True).start()
        while (item := launched.get()) is not None:
            if isinstance(item, tuple):   # a bad step: the ones before it were answered
                context.abort(*item)
            yield self._finish(item, context)
            self._answered += 1

    def _launch(self, req):
        """(pending step, None) or (None, (status code, message))."""
        try:
            with self.lock:
                pending = self.runner.launch(req)
            if req.kv_transfers_i32:
                self.metrics.transferred(req.kv_transfers_i32,
                                         self.runner.block_bytes(self.runner.block_size))
            if self.runner.host is not None:   # the copies finished by now (never waits)
                self.metrics.host_kv_seconds.inc(self.runner.host.take_seconds())
            return pending, None
        except StepError as e:
            self.metrics.failures.inc()
            return None, (grpc.StatusCode.INVALID_ARGUMENT, f"step {req.step_id}: {e}")
        except Exception as e:  # noqa: BLE001 - report, don't hang the scheduler
            self.metrics.failures.inc()
            log.exception("step %d failed", req.step_id)
            return None, (grpc.StatusCode.INTERNAL, f"step {req.step_id}: {type(e).__name__}: {e}")

    def _finish(self, pending, context):
        """No lock: finishing reads only the pending step (its events and host copies), so
        it runs while the next step launches."""
        try:
            resp = self.runner.finish(pending)
            self.metrics.stepped(resp.step_ms, resp.gpu_ms)
            return resp
        except Exception as e:  # noqa: BLE001
            self.metrics.failures.inc()
            log.exception("step %d failed", pending.step_id)
            context.abort(grpc.StatusCode.INTERNAL, f"step {pending.step_id}: {type(e).__name__}: {e}")

    def Health(self, request, context):
        ready = self.runner.kv_cache is not None
        return worker_pb2.HealthResponse(ready=ready, status="serving" if ready else "waiting for Init",
                                         steps=self.steps, steps_overlapped=self.steps_overlapped)


def serve(runner: ModelRunner, model_name: str, host: str, port: int, secret: str | None = None,
          credentials: grpc.ServerCredentials | None = None, profile=None
          ) -> tuple[grpc.Server, int]:
    """secret: every RPC but Health needs it (`authorization: Bearer`); credentials: TLS;
    profile: a StepProfile (--profile-steps)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8), interceptors=[SyncGuard(secret, OPEN_WORKER)],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, model_name, profile),
                                                 server)
    bound = add_port(server, f"{host}:{port}", credentials)
    server.start()
    return server, bound
