"""Random LoRA adapters in PEFT's format for a checkpoint (the GPU benchmarks' fine-tunes).

    python tests/gpu/make_adapters.py MODEL_DIR OUT_DIR N [RANK]

Writes OUT_DIR/a0 .. a{N-1}: adapter_config.json + adapter_model.safetensors, rank RANK
(16) on all seven projections of every layer, A and B random (B non-zero, scaled so the
adapter moves the logits without drowning the base). Prints the --lora-modules argument.
"""
from __future__ import annotations

import json
import pathlib
import sys

import torch
from safetensors.torch import save_file

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def main() -> None:
    model, out, n = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    r = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    cfg = json.loads((model / "config.json").read_text())
    dims = shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    names = []
    for k in range(n):
        d = out / f"a{k}"
        d.mkdir(parents=True, exist_ok=True)
        weights = {}
        for layer in range(cfg["num_hidden_layers"]):
            for m in MODULES:
                part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{m}"
                n_in, n_out = dims[m]
                weights[f"{key}.lora_A.weight"] = (torch.randn(r, n_in, generator=gen)
                                                   / n_in ** 0.5).to(torch.bfloat16)
                weights[f"{key}.lora_B.weight"] = (torch.randn(n_out, r, generator=gen)
                                                   * 0.01).to(torch.bfloat16)
        save_file(weights, d / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": list(MODULES),
            "bias": "none", "base_model_name_or_path": str(model)}))
        names.append(f"a{k}={d}")
    print(" ".join(names))


if __name__ == "__main__":
    main()
