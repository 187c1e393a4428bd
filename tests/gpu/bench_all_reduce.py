"""All-reduce latency on N GPUs of one host: NCCL against peer memory (models/fast_all_reduce).

For bf16 tensors of 64 KiB to 16 MiB: NCCL, torch's one-shot and two-shot symmetric-memory
kernels, and what `FastAllReduce` picks, each timed as 20 back-to-back all-reduces replayed
from one CUDA graph (as the decode graphs run them). Before timing, every method's sum is
checked against NCCL's (the same on every rank, and equal to NCCL's to bf16 rounding).
Prints a markdown table (median us per all-reduce on rank 0, and bus bandwidth).

Then the decoder layers' all-reduce + residual add + RMSNorm (hidden 4096, a decode step's
rows): torch's kernel and then our RMSNorm kernel, against kernels/all_reduce_norm.py's one
kernel. Checked first: its residual equals NCCL + the norm's bit for bit, on every rank, for
one call and after 20 back-to-back calls of different data from one graph (slot reuse).

    python tests/gpu/bench_all_reduce.py [--gpus 2]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SIZES_KIB = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CALLS, REPS = 20, 30


def graph_us(fn) -> float:
    """Median us of one fn() call, from REPS replays of a graph of CALLS calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(REPS):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return statistics.median(times)


def rank_main(rank: int, world: int, port: int) -> None:
    from models import fast_all_reduce
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    fast = fast_all_reduce.create(device, size=max(SIZES_KIB) << 10)
    assert fast is not None, "peer memory unavailable on this host"
    gn, rows = fast.group_name, []
    for kib in SIZES_KIB:
        n = (kib << 10) // 2
        g = torch.Generator(device=device).manual_seed(1000 * rank + kib)
        x = torch.randn(n, device=device, generator=g).bfloat16()
        staged = fast.buffer[: 2 * n].view(torch.bfloat16)

        def nccl():
            y = x.clone()
            dist.all_reduce(y)
            return y

        def one_shot():
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", gn)

        def two_shot():
            staged.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", gn)
            return staged.clone()

        def picked():   # what TPGroup.all_reduce does
            return fast(x) if fast.handles(x) else nccl()

        ref = nccl()
        checks = []
        for name, fn in (("one-shot", one_shot), ("two-shot", two_shot), ("picked", picked)):
            y = fn()
            gathered = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(gathered, y)
            same = all(torch.equal(gathered[0], t) for t in gathered)
            err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
            checks.append(f"{name}: {'same on all ranks' if same else 'RANKS DIFFER'}, "
                          f"max diff vs NCCL {err:.1e}")
            assert same and err < 1e-2, checks[-1]
        times = [graph_us(fn) for fn in (nccl, one_shot, two_shot, picked)]
        rows.append((kib, times, checks))
    if rank == 0:
        print(f"\n{torch.cuda.get_device_name(0)} x{world}, torch {torch.__version__}; us per "
              f"all-reduce (median of {REPS} graph replays of {CALLS}); bus GB/s = "
              "2(N-1)/N x bytes / time\n")
        print("| bf16 tensor | NCCL us | one-shot us | two-shot us | picked us (route) | "
              "best vs NCCL | NCCL bus GB/s | best bus GB/s |")
        print("|---|---|---|---|---|---|---|---|")
        for kib, (nc, one, two, pick), _ in rows:
            route = ("one-shot" if kib << 10 <= fast_all_reduce.ONE_SHOT_MAX else "two-shot"
                     if kib << 10 <= fast_all_reduce.TWO_SHOT_MAX else "NCCL")
            best = min(one, two)
            bus = 2 * (world - 1) / world * (kib << 10) / 1e3
            print(f"| {kib} KiB | {nc:.1f} | {one:.1f} | {two:.1f} | {pick:.1f} ({route}) | "
                  f"{nc / best:.2f}x | {bus / nc:.0f} | {bus / best:.0f} |")
        print("\nchecks (rank 0): " + "; ".join(c for _, _, cs in rows[:1] for c in cs))
    fused_table(fast, rank, world, device)
    dist.destroy_process_group()


def fused_table(fast, rank: int, world: int, device: torch.device, hidden: int = 4096) -> None:
    from kernels.rmsnorm import rms_norm
    assert fast.fused is not None, "the fused all-reduce + RMSNorm was not set up"
    g = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(hidden, device=device, generator=g).bfloat16()
    rows_out, failed = [], []
    for t in (1, 8, 64, 131, 256):
        gr = torch.Generator(device=device).manual_seed(100 * rank + t)
        xs = [torch.randn(t, hidden, device=device, generator=gr).bfloat16() for _ in range(CALLS)]
        res0 = torch.randn(t, hidden, device=device, generator=g).bfloat16()   # same on all ranks

        def unfused(x, res):
            y = fast(x) if fast.handles(x) else x.clone()
            return rms_norm(y, weight, 1e-6, res)

        def nccl(x, res):
            y = x.clone()
            dist.all_reduce(y)
            return rms_norm(y, weight, 1e-6, res)

        # one call, then CALLS calls of different data from one graph: the same residual
        ref_out, ref_res = nccl(xs[0], res0.clone())
        out, res = fast.all_reduce_norm(xs[0], res0.clone(), weight, 1e-6)
        seq_ref = res0.clone()
        for x in xs:
            nccl(x, seq_ref)
        seq = res0.clone()
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fast.all_reduce_norm(xs[0], res0.clone(), weight, 1e-6)   # warm-up: compile
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            for x in xs:
                fast.all_reduce_norm(x, seq, weight, 1e-6)
        graph.replay()
        torch.cuda.synchronize()
        gathered = [torch.empty_like(res) for _ in range(world)]
        dist.all_gather(gathered, res)
        ok = (torch.equal(res, ref_res) and torch.equal(seq, seq_ref)
              and all(torch.equal(gathered[0], r) for r in gathered))
        err = float((out.float() - ref_out.float()).abs().max())
        failed.extend([] if ok else [t])
        xr = torch.randn(t, hidden, device=device, generator=gr).bfloat16()
        res = torch.zeros(t, hidden, device=device, dtype=torch.bfloat16)
        times = [graph_us(lambda: unfused(xr, res)),
                 graph_us(lambda: fast.all_reduce_norm(xr, res, weight, 1e-6))]
        rows_out.append((t, times, err))
    if rank == 0:
        print(f"\nall-reduce + residual + RMSNorm, hidden {hidden}, bf16, us per call (median of "
              f"{REPS} replays of {CALLS}); residual equal to NCCL + RMSNorm's bit for bit on "
              f"every rank (one call and {CALLS} from a graph)\n")
        print("| rows | MiB | torch's kernel + RMSNorm us | fused us | speed-up | max out diff |")
        print("|---|---|---|---|---|---|")
        for t, (a, b), err in rows_out:
            print(f"| {t} | {t * hidden * 2 / 2**20:.2f} | {a:.1f} | {b:.1f} | {a / b:.2f}x | "
                  f"{err:.1e} |")
    assert not failed, f"rank {rank}: fused all-reduce + norm differs from NCCL's at rows {failed}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    args = ap.parse_args()
    import torch.multiprocessing as mp
    from client.ports import free_port
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    mp.spawn(rank_main, args=(args.gpus, free_port()), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
