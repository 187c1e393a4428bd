"""python -m scheduler_service: the whole control plane (CPU only, no torch).

This process is a supervisor. It starts the engine core (queues, BlockManager, the
workers' Step streams) and, beside it, N frontend processes serving the public gRPC API
on one port once the core has reached the workers (their imports and tokenizer load
overlap the workers' start-up); it restarts either if it dies, and on SIGTERM/SIGINT
drains the frontends, then stops the core; SIGHUP has them all re-read --api-keys.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time

from nanoserve import cli, model_task
from scheduler_service.speculation import METHODS, SpecConfig

# A frontend's gRPC streaming costs ~50-150 us of CPU per message; at online token rates
# one frontend nears a full core (tests/gpu/RESULTS.md, 2026-11-24). Small hosts keep one:
# a second would compete with the engine core and the workers' launch threads.
AUTO_FRONTENDS = 2
AUTO_FRONTENDS_MIN_CPUS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_service",
        description="nanoserve scheduler (the control plane): serves the public Generation "
                    "API, batches requests (continuous batching, paged KV with prefix caching, "
                    "preemption) and drives one group of worker services (one per "
                    "tensor-parallel rank) over gRPC. Runs as a supervisor process, an engine "
                    "core process (the batching loop) and --frontends processes (gRPC API, "
                    "tokenizer, detokenizer), restarting any that dies.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True,
                   help="model directory; the scheduler reads its tokenizer and chat template")
    p.add_argument("--workers", required=True,
                   help="comma-separated worker addresses, rank 0 first (host:port,host:port)")
    p.add_argument("--task", default="auto",
                   help=model_task.HELP.replace("auto (default): ", "auto (default): what the "
                        "workers serve (their --task; theirs resolves auto as follows): ")
                   + "; a request for another task gets INVALID_ARGUMENT / 400")
    p.add_argument("--score-tokens", default="yes,no", metavar="YES,NO",
                   help="--task score: the two words whose LM head rows the reranker compares "
                        "(one token each in the model's vocabulary; Qwen3-Reranker's: yes,no)")
    cli.add_listen_flags(p, 50051, "the public gRPC API")
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
    p.add_argument("--priority-preemption-gap", type=int, default=1, metavar="N",
                   help="a waiting request (GenerateRequest.priority, OpenAI `priority`: lower "
                        "runs earlier) that finds the batch or the KV cache full preempts the "
                        "newest running request of the lowest class, if that class's value is "
                        "at least N above its own (the preempted one is recomputed later, its "
                        "output unchanged; >= 1: equal classes never preempt each other)")
    p.add_argument("--max-background-prefill-tokens", type=int, default=0, metavar="N",
                   help="latency for the better priority classes against throughput for the "
                        "worse: while a better class has requests alive (or had one in the last "
                        "2 s), a worse class's prompts go in at most N tokens a step, beside the "
                        "running sequences' decode rows (mixed steps), so a better class's new "
                        "request waits for one short step and its streams get a token every step "
                        "(null worker, 5 ms steps + 4 us a prefill token, beside an embedding "
                        "flood: N 1024 TTFT p99 3.4x -> 1.2x idle, ITL p99 5.6-6.9x -> 1.8x, the "
                        "flood 0.87x -> 0.61x its rate alone; N 256: 1.3x, 1.05x, 0.26x). On "
                        "an H200 (Qwen3-0.6B, mixed steps from CUDA graphs) beside an embedding "
                        "flood: N 1024 ITL p99 8-20x -> 1.3-2.0x idle, the flood ~0.8x; beside a "
                        "generation flood little changes (its decode rows share every step): "
                        "tests/gpu/RESULTS.md; 0 (default): off")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="completion length when a request sets no max_tokens")
    p.add_argument("--max-message-mb", type=int, default=16,
                   help="largest request message accepted (bigger: RESOURCE_EXHAUSTED)")
    p.add_argument("--no-overlap", action="store_true",
                   help="keep one step in flight instead of two (by default step N+1 is "
                        "scheduled and sent while the workers compute step N)")
    p.add_argument("--fast-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="structured output: where a request's format allows exactly one "
                        "continuation (a JSON schema's fixed keys and punctuation), emit those "
                        "tokens without a decode step each; they run as extra decode rows of "
                        "the next step, whose attention reads the sequence's KV once for "
                        "all of them. Requests with logprobs or penalties sample every token. "
                        "--no-fast-forward samples every token of every request")
    spec = p.add_argument_group(
        "speculative decoding",
        "A decode step verifies tokens proposed ahead of sampling, several per weight read; "
        "output is unchanged (greedy: the same tokens; sampled: the same distribution). "
        "Requests' predictions (OpenAI `prediction`, gRPC SamplingParams.prediction) are "
        "always proposed; proposals stop while more than --speculative-max-batch sequences "
        "run, and per sequence follow its recent acceptance and the measured cost of a row.")
    spec.add_argument("--speculative", default="off", choices=METHODS,
                      help="ngram: also propose for every request by prompt lookup (the tokens "
                           "after the latest earlier occurrence of its last n tokens in its "
                           "prompt + output); draft (or eagle3): by the workers' --draft-model "
                           "(a smaller model of the same tokenizer, or an EAGLE-3 head), "
                           "greedily, k tokens a step; off: only requests' predictions")
    spec.add_argument("--num-speculative-tokens", type=int, default=8, metavar="K",
                      help="most tokens proposed per sequence and step")
    spec.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched")
    spec.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram matched")
    spec.add_argument("--speculative-max-batch", type=int, default=32, metavar="N",
                      help="propose nothing while more than N sequences run (big batches are "
                           "bound by compute and KV reads, not by the weight read)")
    spec.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction,
                      default=True,
                      help="per sequence, propose as many tokens as its recent acceptance pays "
                           "for at the measured cost of a decode row; --no-speculative-adaptive "
                           "always proposes up to K")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve (PEFT format: a directory with "
                        "adapter_config.json and adapter_model.safetensors, as the workers see "
                        "it); a request picks one by name (gRPC GenerateRequest.adapter, OpenAI "
                        "`model`); the workers need --max-loras. An item may also hold several "
                        "comma-separated pairs (NAME=PATH,NAME=PATH); empty items are ignored, "
                        "so --lora-modules= (e.g. from an unset environment variable) means none")
    cli.add_adapter_root_flag(p)
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--frontends", type=int, default=0,
                   help="frontend processes sharing the port (SO_REUSEPORT); 0 = auto: "
                        f"{AUTO_FRONTENDS} on hosts with >= {AUTO_FRONTENDS_MIN_CPUS} CPUs, else 1 "
                        "(each streams its clients' tokens on one core: on an H100 host at "
                        "26 req/s two frontends kept TTFT p99 within 3-10%% of in-process, one "
                        "ran 20-38%% over)")
    p.add_argument("--stream-deltas-per-turn", type=int, default=8, metavar="N",
                   help="most stream messages a frontend writes per event-loop turn, so that it "
                        "keeps accepting new calls while streaming (0 = no limit); a stream "
                        "that waits sends its tokens together in its next message")
    cli.add_http_port_flag(p)
    p.add_argument("--served-model-name", default="",
                   help="the model id /v1/models and GetModelInfo report and HTTP requests must "
                        "name (default: the model directory's name)")
    p.add_argument("--http-request-timeout", type=float, default=0.0,
                   help="seconds an HTTP request may run before it is aborted with 504 "
                        "(0 = no limit)")
    p.add_argument("--kv-events-config", default="", metavar="JSON",
                   help="publish KV cache events as vLLM does, for prefix-aware routers "
                        "(llm-d, vllm-router kv_aware): vLLM's JSON, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                        "\"tcp://*:5558\", \"topic\": \"kv-events\"}' "
                        "(scheduler_service/kv_events.py)")
    cli.add_metrics_flags(p.add_argument_group("metrics"),
                          "the sum over the engine core and every frontend (prometheus_client "
                          "multiprocess mode, files under the ipc dir)")
    cli.add_logging_flags(p)
    sec = p.add_argument_group(
        "security",
        "Defaults: loopback, plaintext, no auth. Before exposing the public port set --api-key "
        "and TLS; workers on other hosts need --worker-secret and/or mutual TLS.")
    cli.add_api_key_flag(sec)
    sec.add_argument("--api-keys", default=None, metavar="FILE",
                     help="several API keys, each with a name and optional limits: a JSON list "
                          "of {name, key, max_concurrent, tokens_per_minute, highest_priority, "
                          "default_priority, load_adapters} (scheduler_service/api_keys.py). "
                          "A key over a limit gets RESOURCE_EXHAUSTED / HTTP 429 with "
                          "Retry-After; its name labels metrics and logs and is the unit of "
                          "fair shares. Re-read on SIGHUP (streams keep running; a bad file "
                          "keeps the old keys). --api-key still works beside it (a key named "
                          "`default` without limits)")
    cli.add_tls_flags(sec, "the public port")
    sec.add_argument("--worker-tls-ca", default=None,
                     help="PEM CA that signed the workers' certificates: talk TLS to the workers "
                          "(their certificates must name the --workers host)")
    sec.add_argument("--worker-tls-cert", default=None,
                     help="PEM client certificate for workers that require one (mutual TLS)")
    sec.add_argument("--worker-tls-key", default=None, help="PEM private key of --worker-tls-cert")
    cli.add_worker_secret_flag(sec)
    args = p.parse_args(argv)
    cli.check_tls_flags(p, args)
    cli.check_adapter_root(p, args)
    if bool(args.worker_tls_cert) != bool(args.worker_tls_key):
        p.error("--worker-tls-cert and --worker-tls-key go together")
    from nanoserve.security import channel_credentials, server_credentials
    try:   # unreadable PEM files: fail here, not in a child the supervisor keeps restarting
        server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
        channel_credentials(args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key)
    except (OSError, ValueError) as e:
        p.error(f"TLS: {e}")
    if args.block_size < 1:
        p.error("--block-size must be >= 1")
    try:
        args.speculation = SpecConfig(method=args.speculative,
                                      num_tokens=args.num_speculative_tokens,
                                      ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                                      max_batch=args.speculative_max_batch,
                                      adaptive=args.speculative_adaptive)
    except ValueError as e:
        p.error(str(e))
    args.adapters = []
    # NAME=PATH items, each of which may hold several comma-separated pairs; empty ones are
    # skipped (docker compose passes "--lora-modules=${LORA_MODULES:-}").
    pairs = [pair.strip() for item in args.lora_modules for pair in item.split(",")]
    for item in filter(None, pairs):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--lora-modules: {item!r} is not NAME=PATH")
        if name in (n for n, _ in args.adapters) or name == args.served_model_name:
            p.error(f"--lora-modules: the name {name!r} is taken")
        args.adapters.append((name, path))
    if args.frontends < 0:
        p.error("--frontends must be >= 0 (0 = auto)")
    if args.frontends == 0:
        args.frontends = AUTO_FRONTENDS if (os.cpu_count() or 1) >= AUTO_FRONTENDS_MIN_CPUS else 1
    if args.stream_deltas_per_turn < 0:
        p.error("--stream-deltas-per-turn must be >= 0")
    if args.http_request_timeout < 0:
        p.error("--http-request-timeout must be >= 0")
    if args.max_background_prefill_tokens < 0:
        p.error("--max-background-prefill-tokens must be >= 0")
    if args.priority_preemption_gap < 1:
        p.error("--priority-preemption-gap must be >= 1")
    if args.task != "auto":
        try:
            model_task.resolve(args.task, None)
        except ValueError as e:
            p.error(f"--task: {e}")
    if len([w for w in args.score_tokens.split(",") if w]) != 2:
        p.error("--score-tokens: two words joined by a comma (yes,no)")
    if args.kv_events_config:
        from scheduler_service.kv_events import KVEventsConfig
        try:
            KVEventsConfig.from_cli(args.kv_events_config)
        except (ValueError, TypeError) as e:
            p.error(f"--kv-events-config: {e}")
    if args.api_keys:
        from scheduler_service.api_keys import KeyRing
        try:   # a bad file fails here, not in every child
            KeyRing(args.api_keys, args.api_key)
        except (OSError, ValueError) as e:
            p.error(f"--api-keys {args.api_keys}: {e}")
    return args


log = logging.getLogger("nanoserve.scheduler")


class ChildFailed(RuntimeError):
    pass


class ControlPlane:
    """Starts, watches, restarts and stops the engine core and the frontends."""

    def __init__(self, args: argparse.Namespace):
        from scheduler_service.engine_core import EngineCoreConfig
        from scheduler_service.frontend import FrontendConfig
        from scheduler_service.supervision import RestartPolicy
        self.args = args
        self.mp = multiprocessing.get_context("spawn")
        self.ipc_dir = tempfile.mkdtemp(prefix="nanoserve-")   # 0700: ours alone
        self.metrics_dir = os.path.join(self.ipc_dir, "metrics") if args.metrics_port else None
        self.core_config = EngineCoreConfig(
            workers=[a.strip() for a in args.workers.split(",") if a.strip()],
            ipc_dir=self.ipc_dir, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, max_waiting=args.max_waiting,
            overlap=not args.no_overlap, log_level=args.log_level,
            fast_forward=args.fast_forward, model_dir=args.model,
            speculation=args.speculation,
            worker_tls_ca=args.worker_tls_ca, worker_tls_cert=args.worker_tls_cert,
            worker_tls_key=args.worker_tls_key, worker_secret=args.worker_secret,
            adapters=tuple(args.adapters), api_keys=args.api_keys,
            priority_preemption_gap=args.priority_preemption_gap, task=args.task,
            max_background_prefill_tokens=args.max_background_prefill_tokens,
            kv_events=args.kv_events_config, served_model_name=args.served_model_name)
        self.frontend_configs = [FrontendConfig(
            index=i, model=args.model, ipc_dir=self.ipc_dir, host=args.host, port=args.port,
            reuse_port=args.frontends > 1, max_message_mb=args.max_message_mb,
            default_max_tokens=args.default_max_tokens, shutdown_grace=args.shutdown_grace,
            log_level=args.log_level, http_port=args.http_port,
            served_model_name=args.served_model_name, api_key=args.api_key or None,
            http_request_timeout=args.http_request_timeout, tls_cert=args.tls_cert,
            tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
            deltas_per_turn=args.stream_deltas_per_turn, adapter_root=args.adapter_root,
            api_keys=args.api_keys, score_tokens=tuple(args.score_tokens.split(",")))
            for i in range(args.frontends)]
        self.policies = {name: RestartPolicy() for name in
                         ["engine core"] + [f"frontend {i}" for i in range(args.frontends)]}
        self.core: multiprocessing.Process | None = None
        self.frontends: list[multiprocessing.Process | None] = [None] * args.frontends
        self.stopping = False

    # ---- children ---------------------------------------------------------------------

    def _start(self, name: str, target, config) -> tuple[str, multiprocessing.Process, object]:
        """Start a child; `_await` then waits until it says it is ready."""
        parent, child = self.mp.Pipe(duplex=False)
        proc = self.mp.Process(target=target, args=(config, child), name=name)
        proc.start()
        child.close()
        return name, proc, parent

    def _await(self, starting: tuple[str, multiprocessing.Process, object],
               needs_core: bool = False):
        """Wait until a started child says it is ready: (process, what it sent).

        needs_core (a frontend: ready only once the engine core answers it): give up at
        once if the core dies meanwhile, so that watch() restarts the core next; waiting
        would hold the core's restart up for as long as the frontend waits for it."""
        name, proc, parent = starting
        while True:
            ready = multiprocessing.connection.wait([parent, proc.sentinel], timeout=0.5)
            if needs_core and not ready and (self.core is None or not self.core.is_alive()):
                proc.terminate()
                proc.join(5)
                raise ChildFailed(f"{name}: the engine core died while it started")
            if parent in ready:
                try:
                    status, payload = parent.recv()
                except EOFError:
                    status, payload = "error", "exited before it was ready"
                if status == "ready":
                    return proc, payload
                proc.join(5)
                raise ChildFailed(f"{name}: {payload}")
            if proc.sentinel in ready:
                proc.join()
                raise ChildFailed(f"{name} exited with status {proc.exitcode} before it was ready")
            if self.stopping:
                proc.terminate()
                proc.join(5)
                raise ChildFailed(f"{name}: stopped while starting")

    def _start_core(self):
        from scheduler_service import engine_core
        return self._start("engine core", engine_core.run, self.core_config)

    def start_core(self) -> dict:
        self.core, info = self._await(self._start_core())
        return info

    def _start_frontend(self, i: int):
        from scheduler_service import frontend
        return self._start(f"frontend {i}", frontend.run, self.frontend_configs[i])

    def start_frontend(self, i: int, starting=None) -> tuple[int, int | None]:
        """(gRPC port, HTTP port or None) the frontend bound; `starting`: its process, if
        already started (_start_frontend)."""
        self.frontends[i], (port, http_port) = self._await(
            starting or self._start_frontend(i), needs_core=True)
        for cfg in self.frontend_configs:   # every restart and sibling binds these ports
            cfg.port, cfg.http_port = port, http_port
        return port, http_port

    def start_all(self) -> tuple[dict, int, int | None]:
        """The core and, beside it, the frontends: a frontend's imports and tokenizer take
        ~0.6 s, which the first token waited for when they started after the core was
        ready (it is ready only once the workers are). Siblings of a port 0 (the OS picks it)
        start once the first has bound it: they must bind the same."""
        core = self._start_core()
        ephemeral = self.args.port == 0 or self.args.http_port == 0
        early = {i: self._start_frontend(i) for i in range(len(self.frontends))
                 if i == 0 or not ephemeral}
        try:
            self.core, info = self._await(core)
        except ChildFailed:
            for _, proc, _ in early.values():
                proc.terminate()
                proc.join(5)
            raise
        port, http_port = 0, None
        for i in range(len(self.frontends)):
            port, http_port = self.start_frontend(i, early.get(i))
        return info, port, http_port

    def _restart(self, name: str, start) -> bool:
        """Restart a dead child after its backoff; False when it is crash-looping."""
        delay = self.policies[name].next_delay()
        if delay is None:
            log.critical("%s keeps dying (crash loop): stopping the control plane", name)
            return False
        log.error("%s died; restarting in %.1fs", name, delay)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not self.stopping:
            time.sleep(0.05)
        if self.stopping:
            return True
        try:
            start()
        except ChildFailed as e:
            log.error("restart failed: %s", e)   # the next round of watch() retries
        return True

    # ---- lifecycle ----------------------------------------------------------------------

    def start_metrics(self) -> None:
        """Before any child starts: children inherit the env var and write their metrics
        under it (scheduler_service/metrics.py); this process serves the sum."""
        os.mkdir(self.metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        from scheduler_service import metrics
        try:
            metrics.serve(self.args.metrics_port, self.args.host, self.metrics_dir)
        except OSError as e:
            raise ChildFailed(f"cannot serve metrics on port {self.args.metrics_port}: {e}") from e
        log.info("metrics on http://%s:%d/metrics", self.args.host, self.args.metrics_port)

    def _forget(self, proc: multiprocessing.Process) -> None:
        if self.metrics_dir:
            from scheduler_service import metrics
            metrics.process_dead(proc.pid, self.metrics_dir)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hangup)
        code = 0
        try:
            if self.metrics_dir:
                self.start_metrics()
            info, port, http_port = self.start_all()
            http = "" if http_port is None else f"; OpenAI HTTP API on {self.args.host}:{http_port}"
            print(f"nanoserve scheduler listening on {self.args.host}:{port} (model "
                  f"{info['model']}, {info['num_kv_blocks']} KV blocks of {info['block_size']}"
                  f"{' ' + info['kv_cache_dtype'] if info.get('kv_cache_dtype') else ''}, "
                  f"TP={info['world_size']}, {len(self.frontends)} frontend(s)){http}", flush=True)
            code = self.watch()
        except ChildFailed as e:
            if not self.stopping:
                log.error("%s", e)
                code = 1
        finally:
            self.shutdown()
        return code

    def _on_signal(self, *_) -> None:
        self.stopping = True

    def _on_hangup(self, *_) -> None:
        """SIGHUP: the engine core and the frontends re-read --api-keys."""
        log.info("SIGHUP: reloading --api-keys")
        for p in (self.core, *self.frontends):
            if p is not None and p.is_alive():
                os.kill(p.pid, signal.SIGHUP)

    def watch(self) -> int:
        """Until a signal: restart whatever dies. 1 on a crash loop."""
        while not self.stopping:
            procs = [p for p in (self.core, *self.frontends) if p is not None]
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.5)
            if self.stopping:
                break
            if self.core is None or not self.core.is_alive():
                if self.core is not None:
                    log.error("engine core exited with status %s", self.core.exitcode)
                    self._forget(self.core)
                    self.core = None
                if not self._restart("engine core", self.start_core):
                    return 1
            for i, p in enumerate(self.frontends):
                if p is None or not p.is_alive():
                    if p is not None:
                        log.error("frontend %d exited with status %s", i, p.exitcode)
                        self._forget(p)
                        self.frontends[i] = None
                        from scheduler_service import ipc
                        ipc.tell_frontend_gone(self.ipc_dir, i)   # before the backoff
                    if not self._restart(f"frontend {i}", lambda i=i: self.start_frontend(i)):
                        return 1
        return 0

    def shutdown(self) -> None:
        """Frontends first (they drain their requests), then the core."""
        log.info("shutting down the control plane")
        grace = self.args.shutdown_grace + 5
        for p in self.frontends:
            if p is not None and p.is_alive():
                p.terminate()
        for p in self.frontends:
            if p is not None:
                p.join(grace)
                if p.is_alive():
                    p.kill()
                    p.join()
        if self.core is not None and self.core.is_alive():
            self.core.terminate()
            self.core.join(10)
            if self.core.is_alive():
                self.core.kill()
                self.core.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(name)s[supervisor] %(levelname)s %(message)s")
    return ControlPlane(args).run()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
