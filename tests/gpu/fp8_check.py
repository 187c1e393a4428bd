"""FP8 weights on a GPU (issue 32 item 2): the GEMM, the model's accuracy, the 8B checkpoint.

    python tests/gpu/fp8_check.py gemm                 # _scaled_mm vs its reference and vs bf16
    python tests/gpu/fp8_check.py logits DIR           # bf16 vs fp8 weights against HF fp32
    python tests/gpu/fp8_check.py checkpoint DIR [NAME [RESIDUAL_SCALE [echo|count]]]   # random bf16 Qwen3-8B-shaped (or NAME's, test_tp_gpu.SHAPES) checkpoint

gemm: at Qwen3-8B's linear shapes (qkv, o, gate_up, down) and token counts from decode to
prefill, fp8_linear (per-token quantization, then the small-M Triton kernel up to 16 tokens
or one torch._scaled_mm with rowwise scales) against its reference and the bf16 product, and
its times from CUDA graph replays over enough weight copies that each call reads HBM, not L2.
logits: a prefill of three prompts through our model with bf16 and with fp8 weights: rel.
L2 of the logits against HF fp32, and how often the argmax agrees with fp32's.
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import torch  # noqa: E402
from moe_check import graph_us  # noqa: E402  (same measuring tools)
from test_model_gpu import rel  # noqa: E402

# Qwen3-8B's linear layers (N x K)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def hbm_copies(nbytes: int) -> int:
    """Copies of a weight that together exceed 5x the H100's 50 MB L2: cycling through them,
    every GEMM streams its weight from HBM."""
    return max(2, -(-256 * 2**20 // nbytes))


def gemm() -> None:
    from kernels.fp8_linear import fp8_linear, fp8_linear_ref, quantize_rows, quantize_rows_
    print("### FP8 GEMMs at Qwen3-8B shapes, weights streamed from HBM (copies > L2)\n")
    print("x quant + _scaled_mm (rowwise scales) unpadded; fp8_linear = what the model runs "
          "(x quant + the small-M Triton kernel up to 16 tokens, else x quant + _scaled_mm, > 128 "
          "rows padded to a multiple of 128)\n")
    print("| layer (N x K) | tokens | rel err fp8_linear vs bf16 | bf16 us | x quant us | "
          "_scaled_mm us | fp8_linear us | fp8_linear vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        copies = hbm_copies(w.nbytes)
        ws = [w.clone() for _ in range(copies)]
        qs = [quantize_rows(c) for c in ws]
        for t in (1, 8, 64, 131, 256, 2048, 8192):
            x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
            xq, xs = quantize_rows_(x)
            y8 = fp8_linear(x, *qs[0])
            assert rel(y8, fp8_linear_ref(x, *qs[0])) < 0.01
            err = f"{rel(y8, x @ w.T):.4f}"
            per = lambda f: graph_us(lambda: [f(i) for i in range(copies)], reps=20) / copies  # noqa: E731
            b16 = per(lambda i: x @ ws[i].T)
            qz = per(lambda i: quantize_rows_(x))
            mm = per(lambda i: torch._scaled_mm(xq, qs[i][0].T, scale_a=xs,
                                                scale_b=qs[i][1].reshape(1, -1), out_dtype=x.dtype))
            a8 = per(lambda i: fp8_linear(x, *qs[i]))
            print(f"| {name} ({n} x {k}) | {t} | {err} | {b16:.1f} | {qz:.1f} | {mm:.1f} | "
                  f"{a8:.1f} | {b16 / a8:.2f}x |", flush=True)
        del ws, qs
        torch.cuda.empty_cache()


def logits(path: str) -> None:
    import transformers
    from kernels.attention import select_backend
    from models.loader import load_model
    from paged_kv import PagedKV
    gen = torch.Generator().manual_seed(1)
    lens = [300, 517, 64]
    prompts = [torch.randint(0, 10000, (n,), generator=gen) for n in lens]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        refs = [hf(p.cuda()[None]).logits[0] for p in prompts]
    del hf
    torch.cuda.empty_cache()
    print("### Logits against HF fp32 (prefill of 300 + 517 + 64 tokens)\n")
    print("| weights | rel. L2 (worst prompt) | argmax = fp32's |")
    print("|---|---|---|")
    for quant in ("none", "fp8"):
        model, _ = load_model(path, dtype=torch.bfloat16, device="cuda", quantization=quant,
                              attn_backend=select_backend("triton", "cuda"))
        kv = PagedKV(model, lens, block_size=256)
        with torch.inference_mode():
            pos, meta = kv.metadata([(i, 0, n) for i, n in enumerate(lens)])
            out = model.compute_logits(model(torch.cat(prompts).cuda(), pos, meta)).split(lens)
        errs = [rel(o, r) for o, r in zip(out, refs)]
        agree = sum(int((o.argmax(-1) == r.argmax(-1)).sum()) for o, r in zip(out, refs)) / sum(lens)
        print(f"| {'bf16' if quant == 'none' else 'fp8 (per channel, dynamic per token)'} | "
              f"{max(errs):.4f} | {agree:.3f} |", flush=True)
        del model
        torch.cuda.empty_cache()


def main() -> int:
    what = sys.argv[1]
    if what == "gemm":
        gemm()
    elif what == "logits":
        logits(sys.argv[2])
    elif what == "checkpoint":
        from test_tp_gpu import make_checkpoint
        make_checkpoint(sys.argv[3] if len(sys.argv) > 3 else "Qwen3-8B", pathlib.Path(sys.argv[2]),
                        float(sys.argv[4]) if len(sys.argv) > 4 else 1.0,
                        head=sys.argv[5] if len(sys.argv) > 5 else "random")
    return 0


if __name__ == "__main__":
    sys.exit(main())
