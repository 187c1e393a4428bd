"""Tokenizer: text <-> token ids and chat templating, read from a Hugging Face model dir.

Why not `transformers.AutoTokenizer`: the scheduler service never imports torch, and
transformers may pull it in. Everything a Hugging Face tokenizer does at serve time is
spread over a few files, so we read them directly:

* tokenizer.json          the `tokenizers` pipeline (normalizer, pre-tokenizer, model,
                          post-processor, decoder, added tokens): encode/decode.
* tokenizer_config.json   named special tokens (eos/bos/...), add_bos_token/add_eos_token,
                          an inline chat template (older checkpoints).
* chat_template.jinja     the chat template (transformers >= 4.5x / 5 save it here).
* generation_config.json  the eos id(s) generation stops on (may be a list),
  config.json             falling back to the model config.

Results match transformers `tokenizer(text)["input_ids"]`, `tokenizer.decode(ids)` and
`tokenizer.apply_chat_template(messages, tokenize=False)` for tokenizer.json-backed
tokenizers (tests/test_tokenizer.py checks this). Not reproduced: transformers'
`clean_up_tokenization_spaces` (it skips it for BPE models anyway, and it is meant for
WordPiece), multi-template dicts other than "default", documents in templates.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as HFTokenizer

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_chat_template(value: Any) -> str | None:
    """Inline templates are a string, or a list of {"name", "template"} (pick "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return None


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile like transformers does: sandboxed, trim/lstrip blocks, its helper globals."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token and chat-template facts around it."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: list[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        # Named special tokens as strings ("eos_token": "<|im_end|>"), given to chat templates.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.chat_template = chat_template
        eos = self.special_tokens.get("eos_token")
        eos_id = self._tok.token_to_id(eos) if eos is not None else None
        ids = list(eos_token_ids or [])
        # Primary eos: the tokenizer's own eos token, else the model config's first one.
        self.eos_token_id: int | None = eos_id if eos_id is not None else (ids[0] if ids else None)
        # Every id that ends generation (generation_config may list several, e.g. Qwen3's
        # <|im_end|> and <|endoftext|>): what the scheduler's eos check should use.
        self.eos_token_ids: frozenset[int] = frozenset(
            ids + ([self.eos_token_id] if self.eos_token_id is not None else []))
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = self._tok.token_to_id(bos) if bos is not None else None

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a Hugging Face model directory (needs tokenizer.json)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(
                f"{path} has no tokenizer.json: nanoserve needs a 'fast' (tokenizers) "
                "tokenizer; convert it once with transformers "
                "(AutoTokenizer.from_pretrained(dir).save_pretrained(dir)).")
        tok = HFTokenizer.from_file(str(tokenizer_file))
        cfg = _read_json(path / "tokenizer_config.json")

        special = {name: s for name in NAMED_SPECIAL_TOKENS
                   if (s := _token_str(cfg.get(name))) is not None}
        # Tokens the config names as special must be special in the pipeline too
        # (transformers adds them if tokenizer.json lacks them), so that encode keeps
        # them whole and decode(skip_special_tokens=True) drops them.
        extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        extra = extra.values() if isinstance(extra, dict) else extra
        to_mark = list(special.values()) + [s for e in extra if (s := _token_str(e))]
        for added in (cfg.get("added_tokens_decoder") or {}).values():
            if isinstance(added, dict) and added.get("special") and _token_str(added):
                to_mark.append(_token_str(added))
        known = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        missing = [AddedToken(s, special=True, normalized=False)
                   for s in dict.fromkeys(to_mark) if s not in known]
        if missing:
            tok.add_special_tokens(missing)

        # transformers rebuilds the post-processor when the config sets add_bos_token /
        # add_eos_token explicitly, or when tokenizer.json has none.
        if "add_bos_token" in cfg or "add_eos_token" in cfg or tok.post_processor is None:
            cls._set_bos_eos_post_processor(tok, special, bool(cfg.get("add_bos_token")),
                                            bool(cfg.get("add_eos_token")))

        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_chat_template(cfg.get("chat_template"))

        gen_cfg = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")
        text_cfg = model_cfg.get("text_config") if isinstance(model_cfg.get("text_config"), dict) else {}
        eos_ids = (_as_id_list(gen_cfg.get("eos_token_id")) or _as_id_list(model_cfg.get("eos_token_id"))
                   or _as_id_list(text_cfg.get("eos_token_id")))
        return cls(tok, special_tokens=special, eos_token_ids=eos_ids, chat_template=chat_template)

    @staticmethod
    def _set_bos_eos_post_processor(tok: HFTokenizer, special: dict[str, str],
                                    add_bos: bool, add_eos: bool) -> None:
        bos, eos = special.get("bos_token"), special.get("eos_token")
        bos_id = tok.token_to_id(bos) if bos is not None else None
        eos_id = tok.token_to_id(eos) if eos is not None else None
        add_bos = add_bos and bos_id is not None
        add_eos = add_eos and eos_id is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        pieces = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=pieces)

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Like transformers `tokenizer(text)["input_ids"]`: the post-processor's bos/eos
        are added by default (Qwen adds none, Llama adds bos)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (transformers' `len(tokenizer)`).
        The model's embedding (config.json vocab_size) may be larger (padded)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def special_token_ids(self) -> set[int]:
        """Ids that decode(skip_special_tokens=True) drops."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    # ------------------------------------------------------------------ chat
    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this model has no chat template (chat_template.jinja or "
                             "tokenizer_config.json 'chat_template'); send a text prompt instead")
        return _compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages into the prompt text, as transformers
        `apply_chat_template(messages, tokenize=False)`. Raises ValueError on bad input."""
        if not messages:
            raise ValueError("a chat needs at least one message")
        clean: list[dict[str, Any]] = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"a chat message must be a dict with a 'role', got {m!r}")
            # transformers drops None values (OpenAI-style content=None) before rendering.
            clean.append({k: v for k, v in m.items() if v is not None})
        context = {**self.special_tokens, **kwargs}
        try:
            return self._compiled_template.render(messages=clean,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **context)
        except jinja2.exceptions.TemplateError as e:  # raise_exception() in the template, syntax
            raise ValueError(f"chat template error: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of a rendered chat. The template writes bos itself, so no special tokens
        are added (as transformers `apply_chat_template(tokenize=True)`)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)
