"""Tiny random Qwen3 checkpoints (weights + tokenizer) that tests build on the fly.

`make_tiny_qwen3` writes a directory that both Hugging Face (`from_pretrained`,
`AutoTokenizer`) and our loader read: config.json, *.safetensors (optionally sharded,
with the index file), generation_config.json and a byte-level BPE tokenizer with a
Qwen-style chat template. Same arguments -> byte-identical files.

Weights are drawn with a large std (0.2) so logits are spread out: greedy decoding then
has no near-ties, and token-for-token comparisons against Hugging Face are meaningful.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

EOS_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]   # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed training text: English plus multi-byte UTF-8 (accents, CJK, emoji), so that
# multi-byte characters end up split across tokens and detokenizers must handle that.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for testing an inference server.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "The scheduler batches requests; the worker runs the model and samples tokens.",
    "Once upon a time there was a small model that generated random text.",
    "héllo wörld, café, naïve, façade, déjà vu, Ünïcödé.",
    "日本語のテキストも少し含めます。東京、京都、大阪。",
    "中文文本:你好,世界。今天天气很好。",
    "Emoji: 😀 😃 🚀 🎉 ❤️ 👍🏽 — and symbols: € £ ¥ © ™ ∑ ∞ ≈.",
    "Numbers 0123456789, dates 2024-06-01, code: def f(x): return x * 2",
] * 3

MAX_TOKENIZER_VOCAB = 320   # base 256 bytes + 3 specials + up to 61 merges


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per vocab size; returns its tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE with at most vocab_size tokens (>= 259: bytes + specials)."""
    from tokenizers import Tokenizer
    target = min(vocab_size, MAX_TOKENIZER_VOCAB)
    if target < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} too small for a byte-level tokenizer (>= 259)")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(target)),
        eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        extra_special_tokens=[IM_START, IM_END])
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) <= vocab_size, (len(tokenizer), vocab_size)
    return tokenizer


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded, large-std random weights; norm weights around 1 so activations stay sane."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.2
            if "norm" in name:
                noise += 1.0
            param.copy_(noise)


def _save_weights(model: torch.nn.Module, path: Path, shards: int, dtype: torch.dtype) -> None:
    """safetensors in exactly `shards` files (+ index when > 1), tied weights saved once."""
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    names = sorted(state)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    if not 1 < shards <= len(names):
        raise ValueError(f"shards must be in 1..{len(names)}, got {shards}")
    weight_map, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in names[i::shards]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_tiny_qwen3(path: str | os.PathLike, *, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                    intermediate_size: int = 128, vocab_size: int = 389,
                    tie_word_embeddings: bool = False, attention_bias: bool = False,
                    rope_theta: float = 10000.0, seed: int = 0,
                    max_position_embeddings: int = 512,
                    dtype: torch.dtype = torch.float32, shards: int = 1,
                    llama: bool = False, qwen2: bool = False, moe: dict | None = None) -> Path:
    """Write a random Qwen3 (llama=True: Llama; qwen2=True: Qwen2; moe: Qwen3-MoE with these
    config fields, e.g. num_experts, num_experts_per_tok) checkpoint + tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    family = "Llama" if llama else "Qwen2" if qwen2 else "Qwen3Moe" if moe else "Qwen3"
    config_class = getattr(transformers, f"{family}Config")
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        attention_bias=attention_bias, tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None, **(moe or {}))
    config.dtype = dtype
    config.architectures = [f"{family}ForCausalLM"]
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    _init_weights(model, seed)
    if tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    config.save_pretrained(path)
    transformers.GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id,
                                  bos_token_id=None).save_pretrained(path)
    _save_weights(model, path, shards, dtype)
    tokenizer.save_pretrained(path)
    return path


_cache: dict[tuple, Path] = {}


def tiny_qwen3_dir(tmp_path_factory, **kw) -> Path:
    """make_tiny_qwen3 memoized per kwargs within one pytest session (tmp_path_factory)."""
    key = (str(tmp_path_factory.getbasetemp()), tuple(sorted((k, repr(v)) for k, v in kw.items())))
    if key not in _cache:
        _cache[key] = make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), **kw)
    return _cache[key]
