"""Per-kernel GPU time of one decode step (torch.profiler): unfused, fused, fused + fp8 KV.

Random-weight Qwen3-0.6B (tests/gpu/test_model_gpu.py makes it) or --model DIR (e.g. the
8B-shaped checkpoint of fp8_check.py; --quantization fp8 for e4m3 weights), bf16, batch
131 (the nano-vllm workload's mean decode batch; --batch 1 for a single caller), contexts
U[100, 1024], page 256. A step is what
the worker runs: the forward, the LM head, and the fused sampling at temperature 0.6
(no logprobs, as the benchmark asks; its kernels are the `_gumbel_*` rows). Prints for each
variant a markdown table (kernel, calls, total us per step) and the step's GPU busy time
next to its bandwidth floor. Fused = Triton SiLU-and-mul and q/k norm + rotary in one
kernel; unfused = NANOSERVE_FUSED_KERNELS=0; fp8 = an fp8 KV cache (kernels/kv_quant.py).
The floor is (weight bytes + the batch's KV bytes, of the variant's KV dtype) / --hbm-tbs.
Each variant also replays the step from a CUDA graph (as the worker does) and prints its
wall time beside the kernels' sum: the difference is what launches and tails cost.
--variants picks them: "+"-joined words from fused (else unfused), fp8kv, gemv (the decode
GEMV of kernels/gemv.py for <= its token limit; without it, cuBLAS / fp8_linear), det (the
worker's --deterministic: batch-invariant GEMMs and split-length attention), cublas (2-8 rows
on cuBLAS, not kernels/small_m.py), nopdl (no programmatic dependent launch). A second
table per variant charges the GPU time to modules (each projection, attention, norms, LM
head; CUDA events around each in eager steps) with the bytes each must read: weights, or
the batch's KV for attention, and the bandwidth that achieves.
--tp 2: the same step on two GPUs (NCCL and the peer-memory all-reduce as the worker sets
them up; --all-reduce unfused: without the fused all-reduce + norm kernel); rank 0 prints,
and its weight bytes and floor are the rank's. Read the graph replay line there: the eager
kernel table's collectives include the wait for the other rank (eager ranks drift apart).
    python tests/gpu/profile_decode.py [--batch 131] [--hbm-tbs 3.0] [--model DIR] [--tp 2]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=131)
    ap.add_argument("--hbm-tbs", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--model", default=None, help="checkpoint (default: the random 0.6B)")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8"])
    ap.add_argument("--variants", default="unfused+gemv,fused+gemv,fused+gemv+fp8kv")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one GPU each")
    ap.add_argument("--all-reduce", default="auto", choices=("auto", "unfused"),
                    help="with --tp: the worker's --all-reduce (unfused: no all-reduce + norm kernel)")
    args = ap.parse_args()
    if args.tp == 1:
        run_variants(args)
    else:
        import torch.multiprocessing as mp
        mp.spawn(_rank_main, args=(args, _free_port()), nprocs=args.tp)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, args, port: int) -> None:
    """One TP rank: NCCL group, the peer-memory all-reduce, then the same profile; only
    rank 0 prints (the others run every step too: the collectives need them)."""
    import torch.distributed as dist

    from models import fast_all_reduce
    from models.parallel import TPGroup
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.tp, device_id=torch.device("cuda", rank))
    tp = TPGroup(rank=rank, size=args.tp)
    tp.use_peer_memory(fast_all_reduce.create(torch.device("cuda", rank),
                                              fused=args.all_reduce == "auto"))
    if rank:
        sys.stdout = open(os.devnull, "w")
    try:
        run_variants(args, tp)
    finally:
        dist.destroy_process_group()


def run_variants(args, tp=None) -> None:
    """Every variant's kernel table, graph replay and module table (see the docstring)."""
    import kernels.gemv
    import kernels.pdl
    import models.kernel_choice
    from kernels.attention import select_backend
    from kernels.sampling import gumbel_sample
    from models.loader import load_model
    from models.parallel import TPGroup
    from paged_kv import PagedKV
    from test_model_gpu import main_checkpoint
    backend = select_backend("triton", "cuda")
    model, _ = load_model(args.model or str(main_checkpoint()), tp=tp or TPGroup(),
                          dtype=torch.bfloat16, device="cuda", attn_backend=backend,
                          quantization=args.quantization)
    labels, module_events = _label_modules(model)
    gemv_limit = kernels.gemv.GEMV_MAX_TOKENS
    small_m_limit, pdl_on = models.kernel_choice.SMALL_M_MAX_ROWS, kernels.pdl.ENABLED
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 1025, (args.batch,), generator=g).tolist()
    ids = torch.randint(0, 10000, (args.batch,), generator=g).cuda()
    temps = torch.full((args.batch,), 0.6, device="cuda")
    seeds = torch.randint(0, 2**31 - 1, (args.batch,), generator=g, dtype=torch.int32).cuda()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{torch.cuda.get_device_name()}, TP={args.tp}, batch {args.batch}, contexts U[100,1024] "
          f"(mean {sum(ctx) / len(ctx):.0f}); weights {weight_bytes / 1e9:.2f} GB"
          f"{' per rank' if args.tp > 1 else ''}")

    for name in args.variants.split(","):
        words = set(name.split("+"))
        fused, fp8 = "fused" in words, "fp8kv" in words
        kernels.gemv.GEMV_MAX_TOKENS = gemv_limit if "gemv" in words else 0
        models.kernel_choice.SMALL_M_MAX_ROWS = 0 if "cublas" in words else small_m_limit
        kernels.pdl.ENABLED = pdl_on and "nopdl" not in words
        # det: the worker's --deterministic (batch-invariant GEMMs, split-length attention)
        models.kernel_choice.DETERMINISTIC = backend.invariant = "det" in words
        kv = PagedKV(model, ctx, block_size=256, fp8=fp8)
        if fp8:
            kv.kv.copy_(torch.randn(kv.kv.shape, device="cuda").to(kv.kv.dtype))
            kv.scales.fill_(1.0)
        else:
            kv.kv.normal_()
        pos, meta = kv.metadata([(i, n - 1, n) for i, n in enumerate(ctx)], is_decode=True)
        shape = kv.kv.shape       # [2, layers, blocks, page, kv heads, head dim]
        row = shape[4] * shape[5] * kv.kv.element_size() + (4 if fp8 else 0)
        kv_bytes = sum(ctx) * 2 * shape[1] * row
        floor_ms = (weight_bytes + kv_bytes) / (args.hbm_tbs * 1e12) * 1e3

        def step():
            logits = model.compute_logits(model(ids, pos, meta))
            return gumbel_sample(logits, temps, seeds, logprobs=False)

        models.kernel_choice.FUSED = fused
        with torch.inference_mode():
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
        per = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name][0] += 1
                per[e.name][1] += e.device_time
        total = sum(t for _, t in per.values()) / args.steps
        calls = sum(c for c, _ in per.values()) / args.steps
        print(f"\n### {name} (NANOSERVE_FUSED_KERNELS={int(fused)}): {calls:.0f} kernels, "
              f"GPU busy {total / 1e3:.2f} ms/step; KV {kv_bytes / 1e9:.2f} GB -> floor "
              f"{floor_ms:.2f} ms at {args.hbm_tbs} TB/s: {total / 1e3 / floor_ms:.2f}x floor\n")
        graph_ms = _graph_step_ms(step)
        print(f"CUDA graph replay: {graph_ms:.2f} ms/step = {graph_ms / floor_ms:.2f}x floor; "
              f"{graph_ms - total / 1e3:+.2f} ms vs the kernels' sum "
              f"({(graph_ms * 1e3 - total) / calls:+.2f} us per kernel)\n")
        print("| kernel | calls/step | us/step | % |\n|---|---|---|---|")
        for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"| {name[:90]} | {c / args.steps:.0f} | {t / args.steps:.0f} | "
                  f"{100 * t / args.steps / total:.1f} |")
        _module_table(step, labels, module_events, kv_bytes, total, args)


def _label_modules(model) -> tuple[dict[str, int], dict[str, list]]:
    """CUDA events around each projection, attention, norm and the LM head (hooks), for
    the module table; returns the bytes each kind must read per step (weights; attention:
    the KV, added per variant) and the event pairs recorded, by kind (emptied per use).
    Events, not profiler ranges: Triton's launches are not charged to enclosing ranges."""
    kinds = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down",
             "lm_head": "lm_head", "attn": "attention"}
    nbytes: dict[str, int] = collections.defaultdict(int)
    events: dict[str, list] = collections.defaultdict(list)
    for path, mod in model.named_modules():
        leaf = path.rpartition(".")[2]
        kind = kinds.get(leaf) or ("norms" if "norm" in leaf else None)
        if kind is None or ".experts" in path:
            continue
        if kind not in ("attention", "norms"):
            nbytes[kind] += sum(t.numel() * t.element_size()
                                for t in list(mod.parameters()) + list(mod.buffers()))

        def pre(m, a, kind=kind):
            if RECORDING:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                events[kind].append([start, None])

        def post(m, a, out, kind=kind):
            if RECORDING:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events[kind][-1][1] = end
        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)
    return nbytes, events


RECORDING = False


def _module_table(step, labels: dict[str, int], events: dict[str, list], kv_bytes: int,
                  total_us: float, args) -> None:
    """Eager steps with events around every module: GPU time per module kind (its kernels
    plus any gaps between them inside the module), bytes, bandwidth; `other` = the rest
    of the kernels' sum."""
    global RECORDING
    events.clear()
    RECORDING = True
    with torch.inference_mode():
        for _ in range(args.steps):
            step()
    RECORDING = False
    torch.cuda.synchronize()
    print("\n| module (eager, events) | calls/step | us/step | MB/step | TB/s | % of HBM |\n"
          "|---|---|---|---|---|---|")
    covered = 0.0
    rows = {k: (len(v), sum(a.elapsed_time(b) for a, b in v) * 1e3) for k, v in events.items()}
    for kind, (count, t) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        us = t / args.steps
        covered += us
        b = kv_bytes if kind == "attention" else labels.get(kind, 0)
        bw = b / us / 1e6 if us and b else 0.0
        print(f"| {kind} | {count / args.steps:.0f} | {us:.0f} | {b / 1e6:.1f} | "
              f"{bw:.2f} | {100 * bw / args.hbm_tbs:.0f} |")
    print(f"| other (embedding, residual adds, sampling) | | {total_us - covered:.0f} | | | |")


def _graph_step_ms(step, replays: int = 50) -> float:
    """Wall time of the step replayed from a CUDA graph, as the worker runs decode: the
    kernels' sum plus the gaps between them (launch latency, tails)."""
    from bench_decode_attention import capture_graph
    with torch.inference_mode():
        graph = capture_graph(step)
        for _ in range(5):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


if __name__ == "__main__":
    main()
