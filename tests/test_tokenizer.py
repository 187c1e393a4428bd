"""scheduler_service.tokenizer against transformers AutoTokenizer on the same directory.

The tokenizer directories are built here (a byte-level BPE trained on multi-byte text,
saved by transformers save_pretrained) so this file needs no model weights.
transformers is imported only here, in tests: the scheduler never imports it.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from scheduler_service.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "héllo wörld 日本語 😀 café naïve über straße ñandú",
    "中文字符 測試 한국어 テスト emoji 🎉🚀👍🏽 👨‍👩‍👧 привет мир Ελληνικά",
    "the quick brown fox jumps over the lazy dog. 1234567890 !@#$%^&*()",
    "def f(x):\n    return x * 2  # code\n\ttabs and  double  spaces",
]

# A Qwen2.5/Qwen3-style template: system default, tojson, loop controls, raise_exception.
QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
{%- if meta is defined %}{{ meta | tojson }}{% endif %}
"""

# Exercises trim_blocks / lstrip_blocks (no "-" whitespace control) and the special-token
# variables transformers passes (bos_token, eos_token).
PLAIN_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'user' %}
[INST] {{ m['content'] }} [/INST]
    {% else %}
{{ m['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]


def train_byte_level_bpe(vocab_size: int = 600) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def save_tokenizer_dir(path: Path, *, template: str = QWEN_TEMPLATE, llama_style: bool = False,
                       generation_eos: list[int] | None = None) -> Path:
    """Save a tokenizer dir the way transformers does (tokenizer.json,
    tokenizer_config.json, chat_template.jinja)."""
    from transformers import PreTrainedTokenizerFast

    kwargs = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if llama_style:
        kwargs = dict(bos_token="<s>", eos_token="</s>", add_bos_token=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=train_byte_level_bpe(), **kwargs)
    fast.chat_template = template
    fast.save_pretrained(str(path))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return save_tokenizer_dir(tmp_path_factory.mktemp("qwen_tok"), generation_eos=[2, 0])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_tokenizer_dir(tmp_path_factory.mktemp("llama_tok"), template=PLAIN_TEMPLATE,
                              llama_style=True)


def random_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pieces = [c for line in CORPUS for c in line] + list(" \n\t") + SPECIALS + ["\u00a0", "\u200b"]
    out = ["", " ", "  leading", "trailing  ", "\n\n", "<|im_end|><|im_start|>"]
    for _ in range(n):
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))))
    out += [CORPUS[0][: rng.randint(0, len(CORPUS[0]))] for _ in range(10)]
    return out


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_encode_decode_match_transformers(which, qwen_dir, llama_dir):
    path = qwen_dir if which == "qwen" else llama_dir
    ours = Tokenizer.from_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    for text in random_strings(300, seed=hash(which) % 1000):
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    rng = random.Random(1)
    for _ in range(200):  # arbitrary id sequences, including broken UTF-8
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(0, 12))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def test_llama_style_adds_bos(llama_dir):
    tok = Tokenizer.from_dir(llama_dir)
    assert tok.bos_token_id is not None
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.bos_token_id not in tok.encode("hi", add_special_tokens=False)


def test_special_tokens_and_sizes(qwen_dir):
    ours = Tokenizer.from_dir(qwen_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen_dir))
    assert ours.vocab_size == len(ref)
    # Every added special token (here also <s>, </s>, which transformers' all_special_ids
    # leaves out because no named attribute points at them) is dropped by skip_special_tokens.
    assert ours.special_token_ids >= set(ref.all_special_ids)
    assert ours.special_token_ids == {i for i in range(len(ref))
                                      if ref.decode([i], skip_special_tokens=True) == ""}
    assert ours.eos_token_id == ref.eos_token_id == ours.token_to_id("<|endoftext|>")
    # generation_config.json lists [2, 0]: both end generation.
    assert ours.eos_token_ids == {0, 2}
    assert ours.id_to_token(ours.eos_token_id) == "<|endoftext|>"
    # special tokens stay whole when encoding
    assert ours.encode("<|im_start|>") == [ours.token_to_id("<|im_start|>")]


CHATS = [
    [{"role": "user", "content": "héllo 😀"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "日本語?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "  spaced\n\nlines  "}],
    [{"role": "user", "content": "none content next"}, {"role": "assistant", "content": None}],
]


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_chat_template_matches_transformers(which, qwen_dir, llama_dir):
    path = qwen_dir if which == "qwen" else llama_dir
    ours = Tokenizer.from_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    for chat in CHATS:
        for gen in (True, False):
            try:
                want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            except Exception:  # the template rejects it (content=None): so must we
                with pytest.raises(ValueError):
                    ours.apply_chat_template(chat, add_generation_prompt=gen)
                continue
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want
        if chat[-1]["content"] is not None:
            want_ids = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                               return_dict=False)
            assert ours.encode_chat(chat) == list(want_ids)
    kw = dict(meta={"k": "é<>&"})
    assert (ours.apply_chat_template(CHATS[0], **kw)
            == ref.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True, **kw))


def test_chat_template_errors(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    with pytest.raises(ValueError, match="unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError):
        tok.apply_chat_template([])
    with pytest.raises(ValueError):
        tok.apply_chat_template(["not a dict"])  # type: ignore[list-item]


def test_inline_chat_template_in_config(qwen_dir, tmp_path):
    """Older checkpoints keep the template inside tokenizer_config.json."""
    d = tmp_path / "inline"
    shutil.copytree(qwen_dir, d)
    template = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).apply_chat_template(CHATS[1]) == \
        Tokenizer.from_dir(qwen_dir).apply_chat_template(CHATS[1])


def test_no_template_and_missing_files(tmp_path, qwen_dir):
    d = tmp_path / "notemplate"
    shutil.copytree(qwen_dir, d)
    (d / "chat_template.jinja").unlink()
    tok = Tokenizer.from_dir(d)
    assert tok.encode("hi")  # still a working tokenizer
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHATS[0])
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "empty")


def test_eos_from_model_config_when_tokenizer_has_none(qwen_dir, tmp_path):
    d = tmp_path / "noeos"
    shutil.copytree(qwen_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("eos_token")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").unlink()
    (d / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_id == 3 and tok.eos_token_ids == {3}


def test_tiny_checkpoint_tokenizer_matches_transformers(tmp_path):
    """The tokenizer the shared tiny Qwen3 checkpoints carry (tests/tiny_checkpoint.py)."""
    tiny = pytest.importorskip("tiny_checkpoint")
    tiny.make_tokenizer(320).save_pretrained(str(tmp_path))
    ours = Tokenizer.from_dir(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.eos_token_id == ref.eos_token_id and ours.vocab_size == len(ref)
    for text in tiny.CORPUS[:10] + random_strings(100, seed=5):
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    for chat in CHATS[:3]:
        assert ours.apply_chat_template(chat) == ref.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True)
