"""Prometheus metrics of the control plane, served by the supervisor on `--metrics-port`.

The control plane is several processes (supervisor, engine core, N frontends), so this
uses prometheus_client's multiprocess mode: the supervisor points PROMETHEUS_MULTIPROC_DIR
at a folder in its ipc dir before it spawns any child, each child's metrics live in
mmap'ed files there, and the supervisor's /metrics sums them (counters keep what a dead
child counted; gauges count live processes only). Without --metrics-port the same
objects exist per process and nobody reads them.

Who records what, keeping the hot path cheap:
* frontends (generation.py), once per request: the request counter by finish reason and
  gRPC status code, TTFT, mean inter-token latency, end-to-end latency, token counters;
* the engine core, twice a second (`EngineCoreMetrics.sync`): copies the counters it
  already keeps (EngineStats, Scheduler.num_preemptions, the BlockManager's free list,
  the queue times the Engine noted) into Prometheus objects. The engine loop itself
  observes nothing.

Beside its own names, the engine core exports the load signals routers read from vLLM
under vLLM's names (the Gateway API Inference Extension's endpoint picker scores queue
depth, KV utilisation and LoRA affinity from them): vllm:num_requests_waiting,
vllm:num_requests_running, vllm:gpu_cache_usage_perc and vllm:kv_cache_usage_perc (0..1,
blocks in use / blocks), vllm:lora_requests_info (value: the time of the update; labels
max_lora, running_lora_adapters, waiting_lora_adapters: comma-separated names).
"""
from __future__ import annotations

import os
import time

from prometheus_client import Counter, Gauge, Histogram

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Latency buckets (s): from a fast decode step to a long generation.
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
            5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
              0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# ---- frontends: one update per request ---------------------------------------------------
REQUESTS = Counter("nanoserve_requests", "Generation requests ended, by finish reason "
                   "(stop, length, abort, error) and gRPC status code",
                   ["finish_reason", "code"])
TTFT = Histogram("nanoserve_time_to_first_token_seconds",
                 "Request arrival at the frontend to its first token", buckets=_LATENCY)
ITL = Histogram("nanoserve_inter_token_latency_seconds",
                "Mean gap between a request's output tokens (one observation per request "
                "with 2+ tokens)", buckets=_TOKEN_GAP)
E2E = Histogram("nanoserve_request_duration_seconds",
                "Request arrival at the frontend to its last token", buckets=_LATENCY)
PROMPT_TOKENS = Counter("nanoserve_prompt_tokens", "Prompt tokens of ended requests")
GENERATION_TOKENS = Counter("nanoserve_generation_tokens", "Tokens generated for clients")
PREFIX_HIT_TOKENS = Counter("nanoserve_prefix_cache_hit_tokens",
                            "Prompt tokens served from the prefix cache (at first admission)")
# Per caller: the API key's name (--api-keys; "default" for --api-key, "-" without keys) and
# the priority class (GenerateRequest.priority / OpenAI `priority`), one update per request.
CALLER_REQUESTS = Counter("nanoserve_caller_requests", "Generation requests ended, by API key, "
                          "priority, finish reason and gRPC status code (429s: "
                          "RESOURCE_EXHAUSTED)", ["key", "priority", "finish_reason", "code"])
CALLER_TTFT = Histogram("nanoserve_caller_time_to_first_token_seconds",
                        "Request arrival at the frontend to its first token, by API key and "
                        "priority", ["key", "priority"], buckets=_LATENCY)
CALLER_QUEUE_TIME = Histogram("nanoserve_caller_queue_time_seconds",
                              "Arrival at the engine core to the first scheduled step (the "
                              "longest of n completions), by API key and priority",
                              ["key", "priority"], buckets=_LATENCY)
CALLER_TOKENS = Counter("nanoserve_caller_tokens", "Tokens of ended requests by API key, "
                        "priority and kind (prompt, generation)", ["key", "priority", "kind"])

# ---- engine core: synced from its own counters --------------------------------------------
QUEUE_TIME = Histogram("nanoserve_request_queue_time_seconds",
                       "Request arrival at the engine core to its first scheduled step",
                       buckets=_LATENCY)
RUNNING = Gauge("nanoserve_sequences_running", "Sequences decoding", multiprocess_mode="livesum")
WAITING = Gauge("nanoserve_sequences_waiting",
                "Sequences waiting (new, mid chunked prefill, preempted or re-prefilling)",
                multiprocess_mode="livesum")
KV_TOTAL = Gauge("nanoserve_kv_blocks_total", "KV cache blocks the scheduler manages",
                 multiprocess_mode="livesum")
KV_USED = Gauge("nanoserve_kv_blocks_used", "KV cache blocks held by sequences",
                multiprocess_mode="livesum")
WORKERS_HEALTHY = Gauge("nanoserve_workers_healthy", "1 while the worker group serves",
                        multiprocess_mode="livesum")
HOST_KV_TOTAL = Gauge("nanoserve_host_kv_blocks_total",
                      "Blocks of the prefix cache's host tier (workers' --host-kv-cache-gb)",
                      multiprocess_mode="livesum")
HOST_KV_OFFLOADED = Counter("nanoserve_host_kv_offloaded_blocks",
                            "KV blocks copied to the host tier as they left the device")
HOST_KV_RESTORED = Counter("nanoserve_host_kv_restored_blocks",
                           "KV blocks copied back from the host tier for a prefix hit")
PREEMPTIONS = Counter("nanoserve_preemptions", "Sequences preempted (KV released, recomputed later)")
STEPS = Counter("nanoserve_steps", "Steps run on the workers (prefill and decode)")
DECODE_STEPS = Counter("nanoserve_decode_steps", "Decode steps run on the workers")
DECODE_SEQS = Counter("nanoserve_decode_sequences",
                      "Sequences summed over decode steps (/ decode steps = mean batch)")
DECODE_SECONDS = Counter("nanoserve_decode_step_seconds",
                         "Time in decode steps by phase: wall (step to step), schedule, rpc "
                         "(waiting for the answer), worker (the workers' step time), gpu, "
                         "postprocess", ["phase"])
SPEC_PROPOSED = Counter("nanoserve_spec_proposed_tokens",
                        "Speculative decoding: tokens proposed for verification (predictions, n-grams)")
SPEC_ACCEPTED = Counter("nanoserve_spec_accepted_tokens", "Of the proposed tokens, those accepted")
VERIFY_STEPS = Counter("nanoserve_spec_verify_steps", "Decode steps that verified proposed tokens")
SPEC_ACCEPTED_LENGTH = Histogram("nanoserve_spec_accepted_per_verify",
                                 "Proposed tokens accepted per sequence and verify step",
                                 buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64))

# ---- engine core: vLLM's names, for routers (labelled by model_name like vLLM's) ----------
VLLM_WAITING = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed",
                     ["model_name"], multiprocess_mode="livesum")
VLLM_RUNNING = Gauge("vllm:num_requests_running", "Requests in model execution batches",
                     ["model_name"], multiprocess_mode="livesum")
VLLM_GPU_CACHE = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage",
                       ["model_name"], multiprocess_mode="livemax")
VLLM_KV_CACHE = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage",
                      ["model_name"], multiprocess_mode="livemax")
VLLM_LORA_INFO = Gauge("vllm:lora_requests_info", "Running stats on lora requests",
                       ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                       multiprocess_mode="livemostrecent")

# EngineStats field -> the phase label it feeds
_PHASES = {"decode_wall_ms": "wall", "decode_schedule_ms": "schedule", "decode_rpc_ms": "rpc",
           "decode_worker_ms": "worker", "decode_gpu_ms": "gpu",
           "decode_postprocess_ms": "postprocess"}


def enabled() -> bool:
    """True in a process whose metrics someone serves (multiprocess mode is on)."""
    return bool(os.environ.get(MULTIPROC_ENV))


def request_ended(finish_reason: str, code: str = "OK") -> None:
    REQUESTS.labels(finish_reason, code).inc()


def caller(key: str, priority: int) -> tuple[str, str]:
    """The per-caller labels of a request. Keys come from the operator's file; priorities
    from callers, so past +-16 they share a label (bounded series)."""
    return key or "-", (str(priority) if -16 <= priority <= 16
                        else "<-16" if priority < 0 else ">16")


class EngineCoreMetrics:
    """Copies the engine core's own bookkeeping into the Prometheus objects: counters by
    the delta since the last sync (so a restarted core adds on), gauges as they are."""

    def __init__(self, model_name: str = ""):
        self._last: dict[str, float] = {}
        self._decode = {phase: DECODE_SECONDS.labels(phase) for phase in _PHASES.values()}
        self._vllm = [g.labels(model_name) for g in (VLLM_WAITING, VLLM_RUNNING, VLLM_GPU_CACHE,
                                                     VLLM_KV_CACHE)]

    def _delta(self, key: str, value: float) -> float:
        d = value - self._last.get(key, 0)
        self._last[key] = value
        return max(d, 0)

    def sync(self, engine, adapters: dict[int, str] | None = None) -> None:
        """adapters: LoRA adapter id -> name (vllm:lora_requests_info names them)."""
        sched, stats = engine.scheduler, engine.stats
        bm = sched.block_manager
        self.sync_vllm(sched, bm, getattr(engine.info, "max_loras", 0), adapters or {})
        RUNNING.set(len(sched.running))
        WAITING.set(len(sched.waiting))
        KV_TOTAL.set(bm.num_blocks)
        KV_USED.set(bm.num_used_blocks)
        WORKERS_HEALTHY.set(int(engine.healthy))
        HOST_KV_TOTAL.set(bm.num_host_blocks)
        HOST_KV_OFFLOADED.inc(self._delta("host_offloaded", bm.num_offloaded))
        HOST_KV_RESTORED.inc(self._delta("host_restored", bm.num_restored))
        PREEMPTIONS.inc(self._delta("preemptions", sched.num_preemptions))
        STEPS.inc(self._delta("steps", stats.num_steps))
        DECODE_STEPS.inc(self._delta("decode_steps", stats.num_decode_steps))
        DECODE_SEQS.inc(self._delta("decode_seqs", stats.num_decode_seqs))
        SPEC_PROPOSED.inc(self._delta("spec_proposed", stats.num_spec_proposed_tokens))
        SPEC_ACCEPTED.inc(self._delta("spec_accepted", stats.num_spec_accepted_tokens))
        VERIFY_STEPS.inc(self._delta("verify_steps", stats.num_verify_steps))
        for accepted, times in list(stats.spec_accepted_runs.items()):
            for _ in range(int(self._delta(f"accepted_{accepted}", times))):
                SPEC_ACCEPTED_LENGTH.observe(accepted)
        for field, phase in _PHASES.items():
            self._decode[phase].inc(self._delta(field, getattr(stats, field)) / 1e3)
        queued, engine.queue_times = engine.queue_times, []
        for q in queued:
            QUEUE_TIME.observe(q)


    def sync_vllm(self, sched, bm, max_loras: int, adapters: dict[int, str]) -> None:
        waiting, running, gpu, kv = self._vllm
        waiting.set(len(sched.waiting))
        running.set(len(sched.running))
        usage = bm.num_used_blocks / bm.num_blocks
        gpu.set(usage)
        kv.set(usage)

        def names(seqs) -> str:
            return ",".join(sorted({adapters.get(s.sampling.adapter_id, str(s.sampling.adapter_id))
                                    for s in seqs if s.sampling.adapter_id}))
        VLLM_LORA_INFO.labels(str(max_loras), names(sched.waiting), names(sched.running)).set(
            time.time())


def serve(port: int, host: str, path: str) -> None:
    """Serve the sum of every process's metrics under `path` (the supervisor's job)."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path)
    start_http_server(port, addr=host, registry=registry)


def process_dead(pid: int, path: str) -> None:
    """Forget a dead child's live gauges (its counters stay in the sums)."""
    from prometheus_client import multiprocess
    multiprocess.mark_process_dead(pid, path)
