"""FP8 weights on a GPU (issue 32 item 2): the GEMM, the model's accuracy, the 8B checkpoint.

    python tests/gpu/fp8_check.py gemm                 # _scaled_mm vs its reference and vs bf16
    python tests/gpu/fp8_check.py logits DIR           # bf16 vs fp8 weights against HF fp32
    python tests/gpu/fp8_check.py checkpoint DIR       # random bf16 Qwen3-8B-shaped checkpoint

gemm: at Qwen3-8B's linear shapes (qkv, o, gate_up, down) and token counts from decode to
prefill, the rel. error of `fp8_linear` (one torch._scaled_mm with rowwise scales) against
`fp8_linear_ref` and against the bf16 product, and both times from CUDA graph replays.
logits: a prefill of three prompts through our model with bf16 and with fp8 weights: rel.
L2 of the logits against HF fp32, and how often the argmax agrees with fp32's.
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import torch  # noqa: E402
from moe_check import graph_us, rel  # noqa: E402  (same measuring tools)


def gemm() -> None:
    from kernels.fp8_linear import fp8_linear, fp8_linear_ref, quantize_rows
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    print("### FP8 GEMM (torch._scaled_mm, rowwise scales) at Qwen3-8B shapes\n")
    print("| layer (N x K) | tokens | rel err vs ref / vs bf16 | bf16 us | fp8 us (incl. x quant) | speed-up |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        wq, ws = quantize_rows(w)
        for t in (1, 64, 131, 256, 2048, 8192):
            x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
            y = fp8_linear(x, wq, ws)
            err = f"{rel(y, fp8_linear_ref(x, wq, ws)):.4f} / {rel(y, x @ w.T):.4f}"
            b16 = graph_us(lambda: x @ w.T)
            f8 = graph_us(lambda: fp8_linear(x, wq, ws))
            print(f"| {name} ({n} x {k}) | {t} | {err} | {b16:.1f} | {f8:.1f} | {b16 / f8:.2f}x |",
                  flush=True)


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
        make_checkpoint("Qwen3-8B", pathlib.Path(sys.argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
