"""Host-tier copies on a GPU host (issue 48): the bandwidth of the worker's block copies
(worker_service/host_tier.py HostTier.copy: each block gathered into a device staging
buffer, then one contiguous pinned memcpy; the reverse on the way back) against
one contiguous pinned memcpy of the same bytes (the link's peak as torch sees it), both
ways, at Qwen3-8B shapes (36 layers, 8 KV heads of 128, bf16, 256-token blocks).

    python tests/gpu/bench_host_kv.py [--blocks 64] [--layers 36]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kernels.attention import new_kv_cache
from worker_service.host_tier import HostTier


def timed(fn, reps: int = 5) -> float:
    """Median seconds of fn() on the GPU (events on the current stream)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--block-size", type=int, default=256)
    args = p.parse_args()
    n, L, bs = args.blocks, args.layers, args.block_size
    dev = torch.device("cuda")
    kv = new_kv_cache(L, 2 * n, bs, 8, 128, torch.bfloat16, dev)
    tier = HostTier.allocate(kv, None, n)   # as the worker's
    kv.normal_()
    nbytes = n * kv[:, :, 0].numel() * kv.element_size()

    def blocks_out():
        tier.copy([(0, i, i) for i in range(n)], kv, None)

    def blocks_in():
        tier.copy([(1, n + i, i) for i in range(n)], kv, None)

    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    rows = [("blocks -> host (the worker's copies)", blocks_out),
            ("host -> blocks (the worker's copies)", blocks_in),
            ("one pinned memcpy, device -> host", lambda: flat_host.copy_(flat_dev, non_blocking=True)),
            ("one pinned memcpy, host -> device", lambda: flat_dev.copy_(flat_host, non_blocking=True))]
    blocks_out()
    torch.cuda.synchronize()
    blocks_in()
    torch.cuda.synchronize()
    assert torch.equal(kv[:, :, n:2 * n], kv[:, :, :n]), "a block came back different"
    print(f"{torch.cuda.get_device_name()}: {n} blocks of {bs} tokens x {L} layers, "
          f"{nbytes / 2**20 / n:.1f} MiB a block")
    print("| copy | ms | GB/s |")
    print("|---|---|---|")
    for name, fn in rows:
        s = timed(fn)
        print(f"| {name} | {s * 1e3:.1f} | {nbytes / s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
