"""The persistent small-batch decode kernel (kernels/persistent_decode.py) on a GPU against
the per-op decode graph: logits (rel. L2 error, same argmax) and the step's GPU time from
its CUDA graph, at batch 1, 2, 4 and 8, on the random Qwen3-0.6B checkpoint (or --model);
with NANOSERVE_PERSISTENT_PROFILE=1 also the kernel's critical path per phase kind (us).

    python tests/gpu/bench_persistent.py [--model DIR] [--context 256] [--replays 100]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("NANOSERVE_QWEN06B", "/tmp/qwen3-0.6b-random"))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--replays", type=int, default=100)
    args = ap.parse_args()
    from nanoserve.v1 import worker_pb2
    from worker_service.cuda_graphs import DecodeGraphs
    from worker_service.executors import StepInputs
    from worker_service.model_runner import ModelRunner, RunnerConfig
    from kernels.persistent_decode import profile
    from worker_service.persistent_executor import PersistentGraphs
    t0 = time.perf_counter()
    runner = ModelRunner(RunnerConfig(model_dir=args.model, device="cuda", dtype="bfloat16",
                                      attention_backend="triton", gpu_memory_utilization=0.5,
                                      max_model_len=4096, max_num_seqs=8,
                                      max_prefill_graph_tokens=0,
                                      small_batch_kernel="persistent"))
    runner.init_kv(64, 256)
    print(f"start-up + capture {time.perf_counter() - t0:.1f} s; Init: {runner.init_phases}",
          flush=True)
    pg = runner.executors[0]
    dg = next(e for e in runner.executors if type(e) is DecodeGraphs)
    assert isinstance(pg, PersistentGraphs)
    gen = torch.Generator().manual_seed(0)
    for s in range(8):   # 8 sequences of --context tokens
        req = worker_pb2.StepRequest(step_id=1 + s)
        w = req.seqs.add(seq_id=s, num_tokens=args.context, start_pos=0, sample=True,
                         reset_block_table=True,
                         block_table_i32=np.arange(4 * s, 4 * s + 4, dtype="<i4").tobytes())
        w.sampling.temperature = 0.0
        req.token_ids_i32 = torch.randint(0, 10000, (args.context,), generator=gen).numpy().astype("<i4").tobytes()
        runner.step(req)
    print("| batch | rel. L2 err | same argmax | per-op graph ms | persistent graph ms |")
    print("|---|---|---|---|---|")
    for bs in (1, 2, 4, 8):
        req = worker_pb2.StepRequest(step_id=100 + bs)
        req.decode.seq_ids_u64 = np.arange(bs, dtype="<u8").tobytes()
        req.decode.token_ids_i32 = torch.randint(0, 10000, (bs,), generator=gen).numpy().astype("<i4").tobytes()
        plan = runner.table.plan(req)
        step = StepInputs(plan)
        with torch.inference_mode():
            kv = runner.kv_cache.clone()
            ref = dg.run(step).out.float().clone()
            runner.kv_cache.copy_(kv)
            got = pg.run(step).out.float().clone()
            torch.cuda.synchronize()
            rel = float((got - ref).norm() / ref.norm())
            same = bool((got.argmax(-1) == ref.argmax(-1)).all())
            times = []
            for g in (dg, pg):
                graph = g.graphs[g.load(step)].graph
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.replays):
                    graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / args.replays)
            runner.kv_cache.copy_(kv)
        print(f"| {bs} | {rel:.2e} | {same} | {times[0]:.3f} | {times[1]:.3f} |", flush=True)
        if pg.kernel.ws.prof is not None:
            phases = profile(pg.kernel.ws, pg.kernel.dims)
            print("|  | profile us: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    from kernels.persistent_decode import compiled
    print("compiled:", compiled)


if __name__ == "__main__":
    main()
