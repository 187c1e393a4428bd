"""gRPC server for the internal Worker API (protos/nanoserve/v1/worker.proto).

One scheduler drives a worker; the Step stream is processed strictly in order on the
thread that serves it, so the ModelRunner needs no locking beyond Init vs Step.
"""
from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc

from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service.model_runner import ModelRunner, StepError

log = logging.getLogger("nanoserve.worker")

MAX_MESSAGE_BYTES = 256 << 20


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, model_name: str):
        self.runner = runner
        self.model_name = model_name
        self.lock = threading.Lock()   # Init and Step never overlap

    def Info(self, request, context):
        block_size = request.block_size or 16
        r = self.runner
        return worker_pb2.WorkerInfo(
            rank=r.tp.rank, world_size=r.tp.size, model=self.model_name,
            model_fingerprint=r.fingerprint, num_kv_blocks=r.kv_capacity(block_size),
            block_size=block_size, vocab_size=r.vocab_size, max_model_len=r.max_model_len,
            eos_token_id=r.eos_token_id, device=str(r.device), dtype=str(r.dtype).removeprefix("torch."),
            attention_backend=r.backend.name)

    def Init(self, request, context):
        if request.num_kv_blocks == 0 or request.block_size == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_kv_blocks and block_size must be > 0")
        with self.lock:
            capacity = self.runner.kv_capacity(request.block_size) + self.runner.num_blocks * (
                self.runner.block_size == request.block_size)
            if request.num_kv_blocks > capacity:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{request.num_kv_blocks} blocks asked, {capacity} fit")
            self.runner.init_kv(request.num_kv_blocks, request.block_size)
        log.info("KV cache: %d blocks of %d tokens", request.num_kv_blocks, request.block_size)
        return worker_pb2.InitResponse(num_kv_blocks=request.num_kv_blocks)

    def Step(self, request_iterator, context):
        for req in request_iterator:
            try:
                with self.lock:
                    resp = self.runner.step(req)
            except StepError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {req.step_id}: {e}")
            except Exception as e:  # noqa: BLE001 - report, don't hang the scheduler
                log.exception("step %d failed", req.step_id)
                context.abort(grpc.StatusCode.INTERNAL, f"step {req.step_id}: {type(e).__name__}: {e}")
            yield resp

    def Health(self, request, context):
        ready = self.runner.kv_cache is not None
        return worker_pb2.HealthResponse(ready=ready, status="serving" if ready else "waiting for Init")


def serve(runner: ModelRunner, model_name: str, host: str, port: int) -> tuple[grpc.Server, int]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, model_name), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    return server, bound
