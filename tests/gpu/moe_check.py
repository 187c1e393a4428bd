"""Qwen3-MoE on a GPU (issue 31): the fused MoE kernels at Qwen3-30B-A3B's layer shapes,
the model against Hugging Face, and a full-size random checkpoint for the benchmarks.

    python tests/gpu/moe_check.py kernels            # router, align, layer: before/now/fp8
    python tests/gpu/moe_check.py model              # 4 layers of 30B-A3B: logits vs HF
    python tests/gpu/moe_check.py checkpoint DIR [--layers 48]   # random bf16 30B-A3B

kernels: per T (tokens in the batch) and I (768: TP=1; 384: one rank of TP=2), times
replayed from a CUDA graph: the router and the align step in torch ops and as kernels, the
MoE layer (router, align, both GEMMs, the k sum) as it was with the torch ones, as it is,
and with FP8 experts; the bytes of the experts the batch touches over that time; errors vs
float32; with --sweep the best tiles for the FP8 experts at decode sizes.
Peak: a 1 GiB device-to-device copy's GB/s on this GPU (what HBM gives a streaming kernel).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from test_model_gpu import rel  # noqa: E402

from kernels.fp8_linear import quantize_rows  # noqa: E402

QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False, eos_token_id=151645, bos_token_id=151643)
E, K, H = 128, 8, 2048


def graph_us(fn, reps: int = 50) -> float:
    """Median us of fn() replayed from a CUDA graph (launch overhead out of the way)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def copy_gbs() -> float:
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    us = graph_us(lambda: y.copy_(x), reps=20)
    return 2 * x.numel() * 2 / us / 1e3


SWEEP = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st)
         for bm, bn, bk, w, st in itertools.product((16, 32, 64), (64, 128), (64, 128, 256), (4, 8), (3, 4))
         if not (bm == 64 and bn == 128 and bk >= 128)]


def kernels(args) -> None:
    """Per (I, T): the router and the align step, torch ops vs their kernels; the layer
    (router + fused experts) as before them (torch router, torch align), now, and with FP8
    experts; errors vs a float32 reference (FP8: on the dequantized experts, and on the
    bf16 ones, i.e. with the quantization's own error)."""
    import kernels.fused_moe as fm
    from kernels.fused_moe import align_tokens, align_tokens_ref, default_config, fused_moe
    from kernels.moe_route import route_topk
    from models.moe import moe_reference, route
    peak = copy_gbs()
    print(f"### Fused MoE at Qwen3-30B-A3B layer shapes (E={E}, k={K}, H={H}), bf16\n")
    print(f"device-to-device copy: {peak:,.0f} GB/s; GB/s = touched experts' bytes / layer us\n")
    print("| I | T | touched | route us torch / kernel | align us torch / kernel | layer us before / "
          "now / fp8 experts | GB/s now / fp8 | rel err now / fp8 (dequantized) / fp8 (bf16) "
          "| fp8 best us, tiles |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for inter, tokens in itertools.product((768, 384), args.tokens):
        gate_up = torch.randn(E, 2 * inter, H, device="cuda", generator=g).mul_(0.02).bfloat16()
        down = torch.randn(E, H, inter, device="cuda", generator=g).mul_(0.02).bfloat16()
        x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
        logits = torch.randn(tokens, E, device="cuda", generator=g).bfloat16()
        weights, ids = route_topk(logits, K, True)
        q = []
        for w in (gate_up, down):
            rows, sc = quantize_rows(w.reshape(-1, w.shape[2]))
            q.append((rows.view(w.shape), sc.view(w.shape[:2]).contiguous()))
        (gu8, gus), (dn8, dns) = q
        scales = (gus, dns)
        out = fused_moe(x, gate_up, down, weights, ids)
        out8 = fused_moe(x, gu8, dn8, weights, ids, scales)
        err = "-"
        if tokens <= 1024:
            ref32 = moe_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
            deq = moe_reference(x.float(), gu8.float() * gus[..., None], dn8.float() * dns[..., None],
                                weights.float(), ids)
            err = f"{rel(out, ref32):.4f} / {rel(out8, deq):.4f} / {rel(out8, ref32):.4f}"
            del ref32, deq
        touched = int(torch.unique(ids).numel())
        nbytes = touched * 3 * inter * H * 2 + 2 * tokens * H * 2
        bm = default_config(tokens * K)["block_m"]
        r_torch = graph_us(lambda: route(logits, K, True))
        r_kernel = graph_us(lambda: route_topk(logits, K, True))
        a_torch = graph_us(lambda: align_tokens_ref(ids, E, bm))
        a_kernel = graph_us(lambda: align_tokens(ids, E, bm))
        now = graph_us(lambda: fused_moe(x, gate_up, down, *route_topk(logits, K, True)))
        fp8 = graph_us(lambda: fused_moe(x, gu8, dn8, *route_topk(logits, K, True), scales))
        fm.align_tokens = align_tokens_ref
        try:
            before = graph_us(lambda: fused_moe(x, gate_up, down, *route(logits, K, True)))
        finally:
            fm.align_tokens = align_tokens
        best = (fp8, "default")
        if args.sweep and tokens <= 256:
            for cfg in SWEEP:
                try:
                    t = graph_us(lambda: fused_moe(x, gu8, dn8, *route_topk(logits, K, True),
                                                   scales, **cfg), reps=20)
                except Exception:   # a tile the GPU cannot fit (shared memory)
                    continue
                if t < best[0]:
                    best = (t, json.dumps(cfg, separators=(",", ":")))
        print(f"| {inter} | {tokens} | {touched} | {r_torch:.1f} / {r_kernel:.1f} | "
              f"{a_torch:.1f} / {a_kernel:.1f} | {before:.1f} / {now:.1f} / {fp8:.1f} | "
              f"{nbytes / now / 1e3:,.0f} / {nbytes / 2 / fp8 / 1e3:,.0f} | {err} | "
              f"{best[0]:.1f} {best[1]} |", flush=True)
        del gate_up, down, gu8, dn8
        torch.cuda.empty_cache()


def write_checkpoint(path: pathlib.Path, layers: int, seed: int = 0, device: str = "cuda") -> pathlib.Path:
    """A random bf16 Qwen3-30B-A3B-shaped checkpoint with `layers` layers, one safetensors
    shard per layer, experts stored per expert as Qwen publishes them; the tiny test
    tokenizer (ids < 320). Written a layer at a time: host memory holds one shard."""
    import transformers
    from safetensors.torch import save_file
    from tiny_checkpoint import make_tokenizer
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=layers)
    config = transformers.Qwen3MoeConfig(**cfg)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(path)
    make_tokenizer(320).save_pretrained(path)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, device=device, generator=gen) * std).bfloat16().cpu()

    heads, kv, hd, inter = 32, 4, 128, cfg["moe_intermediate_size"]
    weight_map = {}
    shards = [("model-embed.safetensors", {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], H),
        "lm_head.weight": rand(cfg["vocab_size"], H),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)})]
    for name, tensors in shards:
        save_file(tensors, str(path / name))
        weight_map.update({k: name for k in tensors})
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_proj.weight": rand(heads * hd, H),
             p + "self_attn.k_proj.weight": rand(kv * hd, H),
             p + "self_attn.v_proj.weight": rand(kv * hd, H),
             p + "self_attn.o_proj.weight": rand(H, heads * hd),
             p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
             p + "mlp.gate.weight": rand(E, H)}
        gate_up, down = rand(E, 2 * inter, H), rand(E, H, inter)
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter].clone()
            t[p + f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:].clone()
            t[p + f"mlp.experts.{e}.down_proj.weight"] = down[e].clone()
        name = f"model-layer{i:02d}.safetensors"
        save_file(t, str(path / name))
        weight_map.update({k: name for k in t})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    return path


def model(args) -> None:
    """4 layers of 30B-A3B: our logits (fused experts, Triton attention) vs HF bf16/fp32."""
    from test_model_gpu import logits_rows
    path = write_checkpoint(pathlib.Path(args.dir or "/tmp/qwen3-30b-a3b-4l"), layers=4)
    print("### 4 layers of Qwen3-30B-A3B, bf16: logits rel. L2 vs HF fp32\n")
    print("| prompt | prefill ours | prefill HF bf16 | decode ours | decode HF bf16 | prefill argmax = fp32 |")
    print("|---|---|---|---|---|---|")
    for r in logits_rows(path):
        print(f"| {r['tokens']} | {r['prefill_ours']:.4f} | {r['prefill_hf16']:.4f} | "
              f"{r['decode_ours']:.4f} | {r['decode_hf16']:.4f} | {r['prefill_argmax']:.3f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["kernels", "model", "checkpoint"])
    p.add_argument("dir", nargs="?")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 16, 64, 131, 256, 1024, 4096])
    p.add_argument("--sweep", action="store_true", help="tile sweep for FP8 experts, T <= 256")
    args = p.parse_args()
    if args.what == "kernels":
        kernels(args)
    elif args.what == "model":
        model(args)
    else:
        t0 = time.perf_counter()
        write_checkpoint(pathlib.Path(args.dir), args.layers)
        print(f"wrote {args.layers}-layer checkpoint to {args.dir} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
