"""Paged decode attention bandwidth: bytes the kernel must move / time, vs HBM peak.

Batch 256 (default), contexts 100..2048, head_dim 128, 8 KV heads (--kv-heads), GQA group 2 (Qwen3-0.6B:
16 q heads), 4 and 8 (larger Qwen3s); page size 256 with shuffled block tables. Bytes
counted: every context token's K and V rows of the sequence's KV heads, q in, out out,
and the block table / context lengths (fp8 KV: 1-byte K/V plus each token's two fp32
scales). The cache is stored head-major as the worker's (kernels.attention.new_kv_cache),
or on request token-major. Sweeps DecodeConfig (key tile, warps, stages), and on request
num_splits, the batch order and the layout, and prints one markdown table. Each call is
timed as the model runs it: replayed from a CUDA graph (no Python launch cost), L2 flushed
before each replay. A streaming read (torch.sum) is timed first: what this machine's HBM
gives in practice.
    python tests/gpu/bench_decode_attention.py [--batch 256] [--peak-tbs 3.35] [--kv bf16,fp8]
        [--contexts "U[100,2048];100"] [--splits 1,2] [--orders random,longest]
        [--layouts head,token]
"""
from __future__ import annotations

import argparse

import torch
import triton

from kernels.kv_quant import quantize_ref
from kernels.paged_attention import DecodeConfig, paged_decode
from tests import paged_kv

CONTEXTS = {"1": (1, 1), "100": (100, 100), "512": (512, 512), "1024": (1024, 1024),
            "2048": (2048, 2048), "U[100,2048]": (100, 2048), "U[100,1024]": (100, 1024)}


def make_case(batch: int, lo: int, hi: int, hq: int, hkv: int, d: int = 128, page: int = 256,
              dtype=torch.bfloat16, seed: int = 0, fp8: bool = False,
              longest_first: bool = False, head_major: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(lo, hi + 1, (batch,), generator=g, dtype=torch.int32)
    if longest_first:   # program i gets the i-th longest context (the GPU starts low ids first)
        ctx = ctx.sort(descending=True).values
    need = (ctx + page - 1) // page
    num_blocks = int(need.sum())
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(batch, int(need.max()), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need.tolist()):
        table[i, :n] = perm[start:start + n]
        start += n
    k = torch.randn(num_blocks, page, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    esz = k.element_size()
    scales = {}
    if fp8:
        for name, x in (("k", k), ("v", v)):
            xq, xs = quantize_ref(x.view(-1, hkv, d))
            scales[name], scales[name + "_scale"] = xq.view(x.shape), xs.view(num_blocks, page)
        k, v = scales.pop("k"), scales.pop("v")
    if head_major:   # stored as the worker stores it (kernels.attention.new_kv_cache)
        k, v = paged_kv.head_major(k), paged_kv.head_major(v)
    kv_row = hkv * d * k.element_size() + (4 if fp8 else 0)       # one token's K (or V)
    nbytes = (int(ctx.sum()) * kv_row * 2 + 2 * q.numel() * esz
              + table.numel() * 4 + batch * 4)
    return dict(q=q, k=k, v=v, table=table.cuda(), ctx=ctx.cuda(), bytes=nbytes,
                scale=d ** -0.5, **scales)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, after the warm-up call on a side stream that capture
    needs (profile_decode.py replays a whole decode step with it too)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def gpu_time_ms(fn, reps: int = 50) -> float:
    """Median GPU time of fn replayed from a CUDA graph (as the model runs it: no launch
    overhead from Python), L2 flushed before each replay (the caches here exceed L2, but
    a short-context batch would otherwise fit)."""
    fn()
    graph = capture_graph(fn)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--peak-tbs", type=float, default=0.0,
                    help="HBM peak in TB/s for the %% column (default: 3.35 H100 SXM, 4.8 H200)")
    ap.add_argument("--kv", default="bf16,fp8", help="KV cache dtypes to run")
    ap.add_argument("--groups", default="2,4,8", help="GQA groups (q heads per kv head) to run")
    ap.add_argument("--kv-heads", type=int, default=8,
                    help="kv heads (a TP rank holds 1/TP of the model's: 4 at Qwen3-8B TP=2)")
    ap.add_argument("--contexts", default=";".join(CONTEXTS),
                    help="context ranges to run, separated by ;")
    ap.add_argument("--splits", default="1", help="num_splits values to run (flash-decoding)")
    ap.add_argument("--orders", default="random",
                    help="batch orders to run: random, longest (longest context first)")
    ap.add_argument("--layouts", default="head",
                    help="cache layouts to run: head (head-major, the worker's), token "
                         "(token-major: a token's kv heads side by side)")
    ap.add_argument("--configs", default="all", help="'all' or 'default': DecodeConfigs to run")
    ap.add_argument("--runs", default="off",
                    help="off: no runs; on: runs of one row each (paged_decode's runs variant, "
                         "which the decode CUDA graphs capture); off,on: both. Compare one "
                         "case in separate runs: each case allocates its cache anew, and on an "
                         "H100 the second fp8 case of a run (batch 256) read 14%% slower, "
                         "whichever it was")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    peak = args.peak_tbs or (4.8 if "H200" in name else 3.35)
    configs = [DecodeConfig(None, 4, 2), DecodeConfig(32, 4, 2), DecodeConfig(64, 4, 2),
               DecodeConfig(64, 8, 2), DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 2),
               DecodeConfig(128, 8, 2), DecodeConfig(64, 2, 2), DecodeConfig(32, 2, 2),
               DecodeConfig(32, 2, 3)]
    if args.configs == "default":
        configs = configs[:1]
    print(f"{name}, batch {args.batch}, head_dim 128, {args.kv_heads} kv heads, page 256, bf16 q; "
          f"peak {peak} TB/s\n")
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")   # what a plain read reaches
    ms = triton.testing.do_bench(lambda: x.sum(), warmup=10, rep=100)
    print(f"Reference, a streaming read (torch.sum over 2 GiB of bf16): {x.nbytes / ms / 1e9:.2f}"
          f" TB/s = {100 * x.nbytes / ms / 1e9 / peak:.1f}% of peak\n")
    del x
    print("| KV | group | contexts | order | layout | runs | splits | config (block_n, warps, stages) "
          "| us | GB/s | % peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    best: dict = {}
    cases = [(kv, int(g), label, order, layout, r) for kv in args.kv.split(",")
             for g in args.groups.split(",") for label in args.contexts.split(";")
             for order in args.orders.split(",") for layout in args.layouts.split(",")
             for r in args.runs.split(",")]
    for kv, group, label, order, layout, r in cases:
        lo, hi = CONTEXTS[label]
        c = make_case(args.batch, lo, hi, args.kv_heads * group, args.kv_heads, fp8=kv == "fp8",
                      longest_first=order == "longest", head_major=layout == "head")
        runs = None
        if r == "on":   # every row its own sequence: place 0, one row left
            runs = torch.zeros(2, args.batch, dtype=torch.int32, device="cuda")
            runs[1] = 1
        ref = None
        for cfg, splits in [(cfg, int(n)) for cfg in configs for n in args.splits.split(",")]:
            fn = lambda: paged_decode(c["q"], c["k"], c["v"], c["table"], c["ctx"],
                                      c["scale"], num_splits=splits, config=cfg,
                                      k_scale=c.get("k_scale"), v_scale=c.get("v_scale"),
                                      runs=runs)
            out = fn()
            if ref is None:
                ref = out
            else:   # every config computes the same attention
                torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
            ms = gpu_time_ms(fn)
            gbs = c["bytes"] / ms / 1e6
            pct = 100 * gbs / (peak * 1e3)
            key = (kv, group, label, order, layout, r)
            best[key] = max(best.get(key, (0, 0, None, 1)), (pct, -ms, cfg, splits),
                            key=lambda t: t[0])
            print(f"| {kv} | {group} | {label} | {order} | {layout} | {r} | {splits} | "
                  f"({cfg.block_n or 'default'}, {cfg.num_warps}, {cfg.num_stages}) | "
                  f"{ms * 1e3:.1f} | {gbs:.0f} | {pct:.1f} |", flush=True)
    print("\nBest per case:\n\n| KV | group | contexts | order | layout | runs | us | % peak | "
          "splits | config |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    for (kv, group, label, order, layout, r), (pct, neg_ms, cfg, splits) in best.items():
        print(f"| {kv} | {group} | {label} | {order} | {layout} | {r} | {-neg_ms * 1e3:.1f} | {pct:.1f} | "
              f"{splits} | {cfg} |")


if __name__ == "__main__":
    main()
