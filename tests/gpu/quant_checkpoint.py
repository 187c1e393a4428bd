"""Random int4 / int8 checkpoints at real shapes, for the speed of issue 64's formats: the
packed weights, zeros and scales written straight from random bits in the layouts
Hugging Face checkpoints carry (as tests/tiny_quantized.py documents them), one
safetensors shard per layer, bf16 embedding / norms / LM head, the tiny test tokenizer.
Correctness is the CPU tests' (tiny checkpoints against HF); these only have to load and
stream their bytes, so the values are random: q uniform over its range, zero in the middle,
scales that keep the dequantized weights near N(0, 0.02).

    python tests/gpu/quant_checkpoint.py DIR Qwen3-8B awq          # AutoAWQ GEMM int4, g128
    python tests/gpu/quant_checkpoint.py DIR Qwen3-0.6B gptq8      # GPTQ int8, g128
    python tests/gpu/quant_checkpoint.py DIR Qwen3-30B-A3B gptq4   # GPTQ int4 experts too
    python tests/gpu/quant_checkpoint.py DIR Qwen3-8B bf16         # plain bf16, same writer
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import torch  # noqa: E402

GROUP = 128
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # (CPU: to check the layout here)
FORMATS = {"awq": ("awq", 4), "gptq4": ("gptq", 4), "gptq8": ("gptq", 8),
           "bf16": ("none", 16)}   # (the same writer, plain weights: a reference in seconds)


def shapes(name: str) -> tuple[dict, str]:
    """The model's config fields and its architecture."""
    if name == "Qwen3-30B-A3B":
        from moe_check import QWEN3_30B_A3B
        return dict(QWEN3_30B_A3B), "Qwen3MoeForCausalLM"
    from test_tp_gpu import COMMON, SHAPES
    return dict(COMMON, **SHAPES[name]), "Qwen3ForCausalLM"


def quantized(method: str, bits: int, n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One projection (weight [n, k] as a Linear holds it) in the format's tensors."""
    per, groups = 32 // bits, k // GROUP
    maxq = (1 << bits) - 1
    mid = (maxq + 1) // 2
    # every value of a word's fields in its range: random 32-bit words
    shape = (k // per, n) if method == "gptq" else (k, n // per)
    qweight = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=DEVICE, generator=gen)
    stored_zero = mid - 1 if method == "gptq" else mid      # GPTQ stores zero - 1
    word = sum(stored_zero << (i * bits) for i in range(per))
    word -= (word >> 31) << 32                               # as an int32
    qzeros = torch.full((groups, n // per), word, dtype=torch.int32)
    # uniform q - zero has std ~ (maxq + 1) / sqrt(12)
    scales = torch.full((groups, n), 0.02 / ((maxq + 1) / 12 ** 0.5), dtype=torch.float16)
    t = {"qweight": qweight.cpu(), "qzeros": qzeros, "scales": scales}
    if method == "gptq":
        t["g_idx"] = (torch.arange(k) // GROUP).to(torch.int32)
    return t


def write(path: pathlib.Path, name: str, fmt: str, seed: int = 0) -> pathlib.Path:
    import transformers
    from safetensors.torch import save_file
    from tiny_checkpoint import make_tokenizer
    method, bits = FORMATS[fmt]
    cfg, arch = shapes(name)
    moe = arch == "Qwen3MoeForCausalLM"
    config = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(**cfg)
    config.architectures = [arch]
    config.torch_dtype = "bfloat16"
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    qc = ({"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": False,
           "sym": True, "checkpoint_format": "gptq", "true_sequential": True}
          if method == "gptq" else
          {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
           "version": "gemm", "modules_to_not_convert": None})
    if method != "none":
        c = json.loads((path / "config.json").read_text())
        c["quantization_config"] = qc
        (path / "config.json").write_text(json.dumps(c, indent=2))
    make_tokenizer(320).save_pretrained(path)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    H, V, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape):
        return (torch.randn(*shape, device=DEVICE, generator=gen) * 0.02).bfloat16().cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    def proj(t: dict, prefix: str, n: int, k: int) -> None:
        if method == "none":
            t[f"{prefix}.weight"] = rand(n, k)
            return
        t.update({f"{prefix}.{kind}": v for kind, v in quantized(method, bits, n, k, gen).items()})

    weight_map: dict[str, str] = {}

    def shard(file: str, t: dict) -> None:
        save_file(t, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in t})

    head = {"model.embed_tokens.weight": rand(V, H), "model.norm.weight": ones(H)}
    if not cfg.get("tie_word_embeddings"):
        head["lm_head.weight"] = rand(V, H)
    shard("model-embed.safetensors", head)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
             p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H)}
        proj(t, p + "self_attn.q_proj", heads * hd, H)
        proj(t, p + "self_attn.k_proj", kv * hd, H)
        proj(t, p + "self_attn.v_proj", kv * hd, H)
        proj(t, p + "self_attn.o_proj", H, heads * hd)
        if moe:
            inter = cfg["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = rand(cfg["num_experts"], H)
            for e in range(cfg["num_experts"]):
                proj(t, p + f"mlp.experts.{e}.gate_proj", inter, H)
                proj(t, p + f"mlp.experts.{e}.up_proj", inter, H)
                proj(t, p + f"mlp.experts.{e}.down_proj", H, inter)
        else:
            inter = cfg["intermediate_size"]
            proj(t, p + "mlp.gate_proj", inter, H)
            proj(t, p + "mlp.up_proj", inter, H)
            proj(t, p + "mlp.down_proj", H, inter)
        shard(f"model-layer{i:02d}.safetensors", t)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=pathlib.Path)
    p.add_argument("shape", choices=["Qwen3-0.6B", "Qwen3-8B", "Qwen3-30B-A3B"])
    p.add_argument("format", choices=list(FORMATS))
    args = p.parse_args()
    t0 = time.perf_counter()
    write(args.dir, args.shape, args.format)
    size = sum(f.stat().st_size for f in args.dir.glob("*.safetensors")) / 1e9
    print(f"wrote {args.shape} {args.format} to {args.dir}: {size:.2f} GB in "
          f"{time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
