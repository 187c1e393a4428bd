"""python -m scheduler_service: the public gRPC server + engine loop (CPU only, no torch)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_service",
        description="nanoserve scheduler: serves the public Generation API, batches requests "
                    "(continuous batching, paged KV with prefix caching, preemption) and drives "
                    "one group of worker services (one per tensor-parallel rank) over gRPC.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True,
                   help="model directory; the scheduler reads its tokenizer and chat template")
    p.add_argument("--workers", required=True,
                   help="comma-separated worker addresses, rank 0 first (host:port,host:port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051,
                   help="port to listen on (0 = any free port; the bound port is printed)")
    p.add_argument("--block-size", type=int, default=256,
                   help="tokens per KV block (prefix-cache granularity; flash-attn wants 256)")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="KV blocks to use (0 = all the workers fit)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="most tokens in one prefill step; longer prompts are chunked")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context length: prompt + completion (0 = the workers' limit)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests queued or running before new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="completion length when a request sets no max_tokens")
    p.add_argument("--max-message-mb", type=int, default=16,
                   help="largest request message accepted (bigger: RESOURCE_EXHAUSTED)")
    p.add_argument("--no-overlap", action="store_true",
                   help="keep one step in flight instead of two (by default step N+1 is "
                        "scheduled and sent while the workers compute step N)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.block_size < 1:
        p.error("--block-size must be >= 1")
    return args


async def serve(args: argparse.Namespace) -> None:
    from grpc_health.v1 import health_pb2

    from scheduler_service.engine import Engine
    from scheduler_service.scheduler import SchedulerConfig
    from scheduler_service.server import SERVICE_NAME, GenerationService, Limits, build_server
    from scheduler_service.tokenizer import Tokenizer
    from scheduler_service.worker_client import WorkerGroup, wait_for_group

    log = logging.getLogger("nanoserve.scheduler")
    # The engine thread and the event loop share the GIL; a short switch interval keeps
    # the engine from waiting up to 5 ms (the default) behind a busy loop every step.
    sys.setswitchinterval(0.0005)
    loop = asyncio.get_running_loop()
    tokenizer = Tokenizer.from_dir(args.model)
    group = WorkerGroup([a.strip() for a in args.workers.split(",") if a.strip()])
    log.info("connecting to %d worker(s): %s", len(group.addresses), ", ".join(group.addresses))
    info = await loop.run_in_executor(None, wait_for_group, group, args.block_size, args.num_kv_blocks)
    max_model_len = min(args.max_model_len or info.max_model_len, info.max_model_len)
    config = SchedulerConfig(num_kv_blocks=info.num_kv_blocks, block_size=args.block_size,
                             max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=max_model_len, eos_token_id=info.eos_token_id)
    limits = Limits(max_model_len=max_model_len, vocab_size=info.vocab_size,
                    max_kv_tokens=info.num_kv_blocks * args.block_size,
                    max_waiting=args.max_waiting, default_max_tokens=args.default_max_tokens)
    service = GenerationService(None, tokenizer, limits, info.model, engine_eos_id=info.eos_token_id)
    engine = Engine(group, info, config, service.post_updates, overlap=not args.no_overlap)
    service.engine = engine
    engine.start()
    server, port, health_servicer = await build_server(
        service, args.host, args.port, args.max_message_mb << 20)
    print(f"nanoserve scheduler listening on {args.host}:{port} (model {info.model}, "
          f"{info.num_kv_blocks} KV blocks of {args.block_size}, TP={info.world_size})", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = True
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass
        if engine.healthy != serving:   # mirror the worker group in grpc.health.v1
            serving = engine.healthy
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)

    log.info("shutting down: no new requests, %.0fs for in-flight ones", args.shutdown_grace)
    service.accepting = False
    await health_servicer.enter_graceful_shutdown()
    try:   # in-flight generations finish; health watches and the like do not hold us up
        await asyncio.wait_for(service.idle.wait(), timeout=args.shutdown_grace)
    except asyncio.TimeoutError:
        log.warning("%d requests still running after %.0fs: cancelling them",
                    service.in_flight, args.shutdown_grace)
    await server.stop(0)
    engine.stop()
    group.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
