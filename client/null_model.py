"""A model directory for the null worker: Qwen3-0.6B's limits, a small real tokenizer, no weights.

The control plane reads a model directory for its tokenizer and chat template; the null
worker reads its config.json for vocab size, context length and eos id. This writes one
that both accept, in milliseconds and without torch, so a control-plane benchmark needs
no checkpoint: `write_null_model(path)`.

The tokenizer is a byte-level BPE trained on a few sentences (ids < ~600); the null
worker samples over the whole 151,936-id vocabulary like random weights do, so most ids
decode to nothing, as on the GPU benchmark's random checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = [
    "The scheduler batches requests; the worker runs the model and samples tokens.",
    "Paged attention stores keys and values in fixed-size blocks of the cache.",
    "Once upon a time there was a server that answered every request on time.",
] * 4


def write_null_model(path: str | Path, vocab_size: int = 151936,
                     max_position_embeddings: int = 40960, tokenizer_dir: str | None = None) -> Path:
    """tokenizer_dir: use that model's tokenizer.json / tokenizer_config.json instead (e.g.
    Qwen3's, so grammar masks cost what they cost on the real vocabulary)."""
    from tokenizers import Tokenizer
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    eos = _train_tokenizer(path) if tokenizer_dir is None else _copy_tokenizer(Path(tokenizer_dir), path)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "eos_token_id": Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(eos)}, indent=1))
    return path


def _train_tokenizer(path: Path) -> str:
    """The tiny byte-level BPE and its chat template into path; its eos token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "pad_token": EOS, "chat_template": CHAT_TEMPLATE}))
    return EOS


def _copy_tokenizer(src: Path, path: Path) -> str:
    """src's tokenizer files into path; its eos token."""
    import shutil
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, path / name)
    eos = json.loads((src / "tokenizer_config.json").read_text()).get("eos_token", EOS)
    return eos["content"] if isinstance(eos, dict) else eos
