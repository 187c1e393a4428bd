"""python -m worker_service: serve one tensor-parallel rank of a model over gRPC."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from nanoserve import cli, model_task, process

EXIT_GROUP_BROKEN = 69   # == worker_service.distributed.EXIT_GROUP_BROKEN (not imported: no torch for --help)
EXIT_CONFIG = 78         # sysexits EX_CONFIG: the model, the host and the flags cannot go together
                         # (a restart would only repeat it); the launcher does not restart on it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m worker_service",
        description="nanoserve worker: owns the model weights and the KV cache of one "
                    "tensor-parallel rank and executes the Step batches a scheduler sends.",
        epilog=f"Exit status {EXIT_CONFIG}: the model, the host and the flags cannot go together "
               "(the reason on stderr; a restart would repeat it, so the launcher stops); "
               f"{EXIT_GROUP_BROKEN}: the TP group broke (restart the group); 2: bad flags.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory (config.json + *.safetensors); required "
                        "unless --null")
    cli.add_listen_flags(p, 50061, "the Worker API")
    p.add_argument("--task", default="auto", help=model_task.HELP)
    p.add_argument("--device", default=None,
                   help="torch device, e.g. cuda, cuda:1, cpu (default: cuda:<local rank> if "
                        "available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and KV dtype (auto = the checkpoint's torch_dtype)")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flash_attn", "triton", "torch"],
                   help="auto on GPU: triton where the prefill CUDA graphs will be captured "
                        "(they need its paged prefill; without them a prompt chunk beside "
                        "decode rows runs eager, ~10x its kernels' time in launches); else "
                        "flash_attn when its build covers the model (head dim, dtype, GPU arch; "
                        "`make flash-attn`) and it measures faster than triton at the model's "
                        "shapes, else triton (logged); torch on CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="auto = the model's dtype; fp8 = e4m3 with one scale per token "
                        "(about twice the KV blocks; triton or torch backend, sm_89+ GPUs)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "fp8"],
                   help="weights: auto = as the checkpoint is (block-scaled FP8 checkpoints: fp8; "
                        "GPTQ int4 / int8 and AWQ int4 checkpoints: packed, as they are); fp8 = "
                        "e4m3 linear layers with per-channel scales, activations quantized per "
                        "token (about half the weight bytes; sm_89+ GPUs for the FP8 GEMM)")
    p.add_argument("--rope-scaling", type=json_object, default=None, metavar="JSON",
                   help='RoPE scaling replacing the checkpoint\'s, e.g. \'{"rope_type": "yarn", '
                        '"factor": 4.0, "original_max_position_embeddings": 32768}\' (yarn, '
                        'llama3, linear, dynamic); the context grows with it')
    p.add_argument("--hf-overrides", type=json_object, default=None, metavar="JSON",
                   help="config.json fields replaced before the model is built (nested dicts "
                        "merged key by key), as vLLM's --hf-overrides")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    p.add_argument("--kv-cache-gb", type=float, default=1.0,
                   help="KV cache size on CPU (GPU sizes it by profiling)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="largest prefill batch; the memory profiler plans for it")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context length limit (0 = the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="largest decode batch: CUDA graphs are captured for batch sizes up to it")
    p.add_argument("--max-prefill-graph-tokens", type=int, default=2048,
                   help="prefills of one sequence up to this many tokens (a new prompt, or a "
                        "chunk of one: online serving's usual prefill) replay a CUDA graph "
                        "captured at startup, in 64/128-token buckets, instead of launching "
                        "each kernel from Python; triton backend; 0 = all prefills eager")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (every step launches each kernel from Python)")
    p.add_argument("--small-batch-kernel", default="off", choices=["off", "persistent"],
                   help="persistent: decode steps of up to 8 sequences run as one persistent "
                        "Triton kernel (kernels/persistent_decode.py) instead of a kernel per "
                        "op, where the model is covered (dense, one rank, no FP8, no LoRA; the "
                        "worker logs why not); experimental, off by default until measured")
    p.add_argument("--profile-steps", type=profile_steps, default=None, metavar="A:B",
                   help="trace steps A to B of this worker's Step stream (counted from its "
                        "start) with the torch profiler, as served: a chrome trace in "
                        "--profile-dir and a log line of the device's kernels, copies and "
                        "idle time over those steps (worker_service/step_profile.py)")
    p.add_argument("--profile-dir", default="nanoserve-profile", metavar="DIR",
                   help="where --profile-steps writes its trace (default: %(default)s)")
    p.add_argument("--deterministic", nargs="?", const="on", default="off", choices=["on", "off"],
                   help="batch-invariant kernels (issue 68): a sequence's logits, hence its "
                        "greedy and seeded tokens, do not depend on what else runs beside it "
                        "(batch, graph bucket, prefill chunks, prefix-cache hits). One rank "
                        "(TP=1), triton attention; GPU cost unmeasured (README). Off by default")
    p.add_argument("--host-kv-cache-gb", type=float, default=0.0, metavar="GB",
                   help="a host-memory tier for the prefix cache (pinned on CUDA): KV blocks "
                        "evicted from the device are copied here, and a later request whose "
                        "prefix is found here gets them copied back instead of recomputed "
                        "(multi-turn chat past the device cache); 0 = off")
    p.add_argument("--max-loras", type=int, default=0, metavar="N",
                   help="LoRA adapters held on the device at once (the most one step may mix; "
                        "others wait in host memory and swap in least-recently-used first); "
                        "0 = no LoRA. The scheduler names the adapters (--lora-modules)")
    p.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                   help="the largest adapter rank accepted (slots are sized for it)")
    p.add_argument("--draft-model", default="", metavar="DIR",
                   help="speculative decoding with a draft model: a smaller model sharing the "
                        "target's tokenizer (e.g. Qwen3-0.6B for Qwen3-8B), or an EAGLE-3 head "
                        "for this target (speculators or EAGLE/AngelSlim layout: drafts from "
                        "the target's hidden states; found by its config), run on every rank "
                        "beside the target with a KV cache of its own (its blocks are counted "
                        "in each KV block's bytes); it proposes tokens greedily for the steps "
                        "of a scheduler started with --speculative draft, and the target "
                        "verifies them (output unchanged). Refused at start if its vocabulary, "
                        "tokenizer files or (a head's) hidden size differ from the target's")
    p.add_argument("--draft-sampling", default="greedy", choices=["greedy", "sampled"],
                   help="how a draft model drafts for requests with temperature > 0: greedy "
                        "(a point mass: a seeded request draws exactly what it draws without "
                        "speculation) or sampled (drawn from the draft's distribution q, kept "
                        "for the rejection rule: more drafts accepted, the same distribution, "
                        "other draws). Requests with an output format and EAGLE-3 heads "
                        "draft greedily")
    tp = p.add_argument_group(
        "tensor parallelism",
        "N > 1 ranks = N worker processes (one per GPU), each started with its --rank and the "
        "same --world-size, --dist-init and model; they join over NCCL (CUDA) or gloo (CPU). "
        "Heads, KV heads, MLP and vocabulary are sharded, so num_attention_heads, "
        "num_key_value_heads and intermediate_size must divide by N (N > num_key_value_heads "
        "is not supported). A rank whose group breaks (a step fails, a peer dies or is "
        f"restarted, rank 0 goes away) exits with status {EXIT_GROUP_BROKEN}: run workers "
        "under a supervisor that restarts them; the scheduler reconnects and re-prefills.")
    tp.add_argument("--rank", type=int, default=0, help="tensor-parallel rank of this worker")
    tp.add_argument("--world-size", type=int, default=1, help="tensor-parallel world size")
    tp.add_argument("--dist-init", default="tcp://127.0.0.1:29500",
                    help="rendezvous tcp://host:port for world size > 1 (rank 0 listens there)")
    tp.add_argument("--dist-timeout", type=float, default=60.0,
                    help="seconds to wait for the other ranks at startup and inside each "
                         "collective before giving up (then the worker exits)")
    tp.add_argument("--heartbeat-timeout", type=float, default=5.0,
                    help="every rank beats once a second through rank 0's store; a peer silent "
                         "this long is dead or hung and this rank exits (so the whole group is "
                         "restarted in seconds, not after NCCL's own timeout)")
    tp.add_argument("--all-reduce", choices=("auto", "unfused", "nccl"), default="auto",
                    help="auto: tensors up to 8 MiB (decode steps) are summed through peer "
                         "memory over NVLink (torch symmetric memory; one-shot/two-shot "
                         "kernels, inside CUDA graphs), larger ones by NCCL, and up to 2 MiB "
                         "the decoder layers' sums are one kernel with the residual add and "
                         "RMSNorm after them; falls back to NCCL alone where peer memory is "
                         "unavailable. unfused: auto without that fused kernel. nccl: NCCL for all")
    tp.add_argument("--standby", action="store_true",
                    help="import the model code, then wait (named ns-standby-<rank>, no GPU touched) "
                         "for a line on stdin before starting; exit if stdin closes first. The "
                         "launcher keeps one such process per rank, so a restarted group "
                         "skips the imports (seconds of every restart)")
    null = p.add_argument_group(
        "null worker (control-plane benchmarks and tests)",
        "--null serves the same Worker API without a model or torch: every step takes "
        "--step-ms of emulated device time and samples made-up, deterministic ids. The "
        "limits (vocab size, context length, eos id) come from --model's config.json, or "
        "Qwen3-0.6B's without --model.")
    null.add_argument("--null", action="store_true", help="compute nothing (see above)")
    null.add_argument("--step-ms", type=float, default=7.0,
                      help="emulated device time per step")
    null.add_argument("--prefill-us-per-token", type=float, default=0.0,
                      help="emulated device time per token a step computes past one a row "
                           "(a prefill's price; 0: every step takes --step-ms)")
    null.add_argument("--null-kv-blocks", type=int, default=65536,
                      help="KV capacity reported, in blocks of 16 tokens")
    cli.add_metrics_flags(p.add_argument_group("metrics"),
                          "step and device time histograms, KV capacity")
    cli.add_logging_flags(p)
    sec = p.add_argument_group(
        "security",
        "By default the worker listens on loopback in plaintext and obeys anyone who reaches "
        "it. Anyone who can reach its port can drive or reset its KV cache: set --secret "
        "(and the scheduler's --worker-secret) and/or mutual TLS (--tls-client-ca here, "
        "--worker-tls-cert/--worker-tls-key at the scheduler) whenever the port is reachable "
        "from other hosts.")
    cli.add_tls_flags(sec, "the worker's port")
    cli.add_worker_secret_flag(sec, "--secret")
    args = p.parse_args(argv)
    cli.check_tls_flags(p, args)
    try:
        args.credentials = server_credentials_of(args)
    except OSError as e:
        p.error(f"TLS: {e}")
    if not args.model and not args.null:
        p.error("--model is required (or --null)")
    try:
        args.tasks = model_task.resolve(args.task, args.model)
    except ValueError as e:
        p.error(f"--task: {e}")
    if args.null and args.world_size != 1:
        p.error("--null serves a single rank (--world-size 1)")
    if args.host_kv_cache_gb < 0:
        p.error("--host-kv-cache-gb must be >= 0")
    if args.max_loras < 0 or args.max_lora_rank < 1:
        p.error("--max-loras must be >= 0 and --max-lora-rank >= 1")
    return args


def serve_metrics(args: argparse.Namespace) -> None:
    if args.metrics_port:
        from worker_service import metrics
        try:
            metrics.serve(args.metrics_port, args.host)
        except OSError as e:
            raise SystemExit(f"nanoserve worker: cannot serve metrics on port "
                             f"{args.metrics_port}: {e}") from e


def profile_steps(text: str) -> tuple[int, int]:
    """--profile-steps A:B (argparse type): 1 <= A <= B."""
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (step numbers), got {text!r}") from None
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, got {text!r}")
    return first, last


def json_object(text: str) -> dict:
    """A flag's JSON object (argparse type)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def hf_overrides_of(args: argparse.Namespace) -> dict | None:
    """--hf-overrides with --rope-scaling as its rope_scaling (the flag wins)."""
    overrides = dict(args.hf_overrides or {})
    if args.rope_scaling is not None:
        overrides["rope_scaling"] = args.rope_scaling
    return overrides or None


def server_credentials_of(args: argparse.Namespace):
    from nanoserve.security import server_credentials
    return server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)


def serve_null(args: argparse.Namespace) -> int:
    import asyncio

    from worker_service.null_worker import NullWorkerServicer, model_limits, serve

    async def run() -> None:
        limits = model_limits(args.model)
        if args.max_model_len:
            limits["max_model_len"] = min(args.max_model_len, limits["max_model_len"])
        servicer = NullWorkerServicer(step_ms=args.step_ms, num_kv_blocks=args.null_kv_blocks,
                                      model=os.path.basename(os.path.normpath(args.model or "null")),
                                      model_dir=args.model, tasks=args.tasks,
                                      prefill_us_per_token=args.prefill_us_per_token, **limits)
        server, port = await serve(servicer, args.host, args.port, args.secret, args.credentials)
        serve_metrics(args)
        print(f"nanoserve null worker ({args.step_ms:g} ms/step) listening on {args.host}:{port}",
              flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(grace=2)

    asyncio.run(run())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not 0 <= args.rank < args.world_size:
        raise SystemExit(f"nanoserve worker: --rank {args.rank} is not in [0, --world-size "
                         f"{args.world_size})")
    if args.null:
        if args.profile_steps is not None:
            raise SystemExit("nanoserve worker: --profile-steps traces a model's steps; a "
                             "--null worker computes none")
        return serve_null(args)
    if args.standby:
        process.set_name(f"standby {args.rank}")
    t0 = time.perf_counter()
    import torch  # after --help, which should not pay for importing torch

    from worker_service import distributed
    from worker_service.model_runner import ModelRunner, RunnerConfig
    from worker_service.phases import phase, phases_line
    from worker_service.server import serve
    phases = {"imports": time.perf_counter() - t0}
    if args.standby:
        print(f"nanoserve worker rank {args.rank} standing by (imports {phases['imports']:.1f} s)",
              flush=True)
        try:
            go = sys.stdin.readline()
        except KeyboardInterrupt:   # Ctrl-C at `make serve` reaches the whole process group
            go = ""
        if not go:
            return 0   # the launcher is gone or stopped us
        process.set_name(f"rank {args.rank}")
        phases = {"imports (done standing by)": 0.0}

    device = args.device or (f"cuda:{args.rank % max(torch.cuda.device_count(), 1)}"
                             if torch.cuda.is_available() else "cpu")
    assert distributed.EXIT_GROUP_BROKEN == EXIT_GROUP_BROKEN
    group = None
    if args.world_size > 1:
        try:
            with open(os.path.join(args.model, "config.json")) as f:
                distributed.check_tp_config(json.load(f), args.world_size)
            with phase(phases, "rendezvous"):
                group = distributed.DistGroup(distributed.DistConfig(
                    rank=args.rank, world_size=args.world_size, init_method=args.dist_init,
                    timeout_s=args.dist_timeout, heartbeat_timeout_s=args.heartbeat_timeout,
                    all_reduce=args.all_reduce,
                    backend=distributed.backend_for(torch.device(device))),
                    torch.device(device), distributed.model_fingerprint(args.model))
        except (OSError, ValueError, RuntimeError) as e:
            raise SystemExit(f"nanoserve worker rank {args.rank}: {e}") from e
    runner_config = RunnerConfig(
        model_dir=args.model, device=device, dtype=args.dtype,
        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization, draft_model=args.draft_model,
        hf_overrides=hf_overrides_of(args),
        draft_sampling=args.draft_sampling, gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gb=args.kv_cache_gb,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_prefill_graph_tokens=args.max_prefill_graph_tokens,
        enforce_eager=args.enforce_eager, small_batch_kernel=args.small_batch_kernel,
        deterministic=args.deterministic == "on",
        max_loras=args.max_loras,
        host_kv_cache_gb=args.host_kv_cache_gb,
        max_lora_rank=args.max_lora_rank, tasks=args.tasks)
    try:
        runner = (distributed.TPModelRunner(runner_config, group) if group is not None
                  else ModelRunner(runner_config))
    except ValueError as e:   # a refused configuration (the loader's and the modes' checks)
        print(f"nanoserve worker rank {args.rank}: configuration error: {e}", file=sys.stderr,
              flush=True)
        return EXIT_CONFIG
    profile = None
    if args.profile_steps is not None:
        from worker_service.step_profile import StepProfile
        profile = StepProfile(*args.profile_steps, args.profile_dir, args.rank, runner.device)
    server, port = serve(runner, os.path.basename(os.path.normpath(args.model)), args.host,
                         args.port, args.secret, args.credentials, profile)
    serve_metrics(args)
    # where start-up went (Init adds the KV cache and CUDA graphs: the server logs it)
    print(f"nanoserve worker rank {args.rank} start-up: "
          f"{phases_line({**phases, **runner.phases})}", flush=True)
    print(f"nanoserve worker rank {args.rank} listening on {args.host}:{port} ({runner.device}, "
          f"{str(runner.dtype).removeprefix('torch.')}, attention {runner.backend.name}, "
          f"KV cache {runner.kv_cache_dtype_name}"
          f"{', deterministic' if runner.config.deterministic else ''})", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if group is not None:
        group.stop_watching()   # peers shutting down too must not make this an error exit
    server.stop(grace=5).wait()
    if group is not None:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
