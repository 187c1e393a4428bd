"""IncrementalDetokenizer: deltas add up to the full decode, never a split character,
stop strings cut exactly, special tokens skipped on request.

Tokenizers are trained here with `tokenizers` alone (no transformers needed): a
byte-level BPE (Qwen/GPT-2 style: emoji and CJK split across tokens) and a Metaspace
BPE (SentencePiece/Llama style: decode strips the first token's leading space).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from scheduler_service.detokenizer import IncrementalDetokenizer, StopMatcher
from scheduler_service.tokenizer import Tokenizer

CORPUS = [
    "héllo wörld 日本語 😀 café naïve über straße",
    "中文字符 測試 한국어 テスト emoji 🎉🚀👍🏽 👨‍👩‍👧 привет мир",
    "the quick brown fox jumps over the lazy dog. STOP here ### end",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "héllo wörld 日本語 😀",
    "🎉🚀👍🏽 👨‍👩‍👧 emoji only",
    "中文字符測試한국어テスト",
    "plain ascii text, with punctuation!",
    "  leading and trailing spaces  ",
    "naïve café über straße ñ ü ö",
    "ζ∑∫ ≠ ≤ ≥ → ← ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "mixed<|im_end|>special<|im_start|>tokens",
]


def _train(kind: str) -> Tokenizer:
    if kind == "bytelevel":
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-like: "▁" marks spaces, bytes fall back to <0xNN> tokens
        tok = HFTokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        alphabet = []
    specials = SPECIALS + ([f"<0x{b:02X}>" for b in range(256)] if kind == "metaspace" else [])
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    if kind == "metaspace":  # byte-fallback tokens are ordinary vocab, not special
        tok = HFTokenizer.from_str(tok.to_str().replace('"special":true', '"special":false')
                                   .replace('"<|endoftext|>","single_word":false,"lstrip":false,'
                                            '"rstrip":false,"normalized":false,"special":false',
                                            '"<|endoftext|>","single_word":false,"lstrip":false,'
                                            '"rstrip":false,"normalized":false,"special":true'))
    return Tokenizer(tok, special_tokens={"eos_token": "<|endoftext|>"})


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def tok(request) -> Tokenizer:
    return _train(request.param)


def is_byte_fallback(tok: Tokenizer) -> bool:
    return tok.token_to_id("<0x41>") is not None


def run(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ids in random-sized chunks (1-3 tokens: steps may produce several); return the deltas."""
    deltas, i = [], 0
    while i < len(ids) and not detok.stopped:
        n = rng.choice([1, 1, 1, 2, 3])
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    deltas.append(detok.finish())
    return deltas


def sequences(tok: Tokenizer, rng: random.Random) -> list[list[int]]:
    seqs = [tok.encode(t) for t in TEXTS]
    seqs += [tok.encode("".join(rng.choice(TEXTS)[rng.randrange(10):] for _ in range(3)))
             for _ in range(30)]
    seqs += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(300)]
    return seqs


def test_deltas_concatenate_to_full_decode(tok):
    rng = random.Random(0)
    checked = 0
    for ids in sequences(tok, rng):
        for skip in (False, True):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            deltas = run(detok, ids, rng)
            full = tok.decode(ids, skip_special_tokens=skip)
            if "\ufffd" not in full:
                assert "".join(deltas) == full == detok.text
                assert not any("\ufffd" in d for d in deltas)
                checked += 1
            elif not is_byte_fallback(tok):
                # genuinely invalid bytes (random ids): the same text, minus a broken tail
                assert "".join(deltas) == full.rstrip("\ufffd")
            else:
                # ByteFallback turns a whole run of byte tokens into U+FFFDs when any of it
                # is invalid, so a window can legitimately decode *more* of it than the
                # full decode does; only the never-a-broken-tail rule is comparable.
                assert not "".join(deltas).endswith("\ufffd")
    assert checked > 50


def test_split_characters_are_held_back(tok):
    """An emoji split over several tokens comes out whole, in the delta of its last token."""
    ids = tok.encode("a🦀b")  # not in the training corpus: 4 byte tokens
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(len(ids)))
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids] + [detok.finish()]
    assert "".join(deltas) == "a🦀b"
    assert all("\ufffd" not in d for d in deltas)
    assert "🦀" in deltas and deltas.count("") >= 3  # held back, then sent whole


def test_incomplete_utf8_tail_dropped_on_finish(tok):
    ids = tok.encode("ok 🦀")
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    out = detok.add(ids[:cut]) + detok.finish()
    assert out == tok.decode(ids[:cut]).rstrip("\ufffd") and "\ufffd" not in out


def test_prompt_context(tok):
    """With prompt ids, the output is what decoding prompt+output adds to the prompt's text
    (for Metaspace the first generated word keeps its leading space)."""
    rng = random.Random(3)
    for text in TEXTS:
        ids = tok.encode(text)
        for split in range(1, len(ids)):
            prompt, gen = ids[:split], ids[split:]
            p_text, full = tok.decode(prompt), tok.decode(ids)
            if "\ufffd" in p_text or not full.startswith(p_text):
                continue
            detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
            assert "".join(run(detok, gen, rng)) == full[len(p_text):]


class WindowSpy:
    """The tokenizer, recording the length of every window decoded."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.lengths = tok, []
        self.vocab_size, self.special_token_ids = tok.vocab_size, tok.special_token_ids

    def decode(self, window, skip_special_tokens=False):
        self.lengths.append(len(window))
        return self.tok.decode(window, skip_special_tokens=skip_special_tokens)


def test_window_stays_small(tok):
    """O(new tokens): each add decodes a bounded window, however long the sequence."""
    ids = tok.encode(" ".join(TEXTS * 40))
    spy = WindowSpy(tok)
    detok = IncrementalDetokenizer(spy, prompt_ids=ids[:500])
    for i in ids:
        detok.add([i])
    assert len(ids) > 500 and max(spy.lengths) <= 16
    assert len(detok._ids) < 100  # old ids are dropped


def test_window_stays_small_over_ids_without_text(tok):
    """Ids that decode to nothing (past the tokenizer's vocabulary, as a random-weights
    model samples them; special tokens when skipped) do not widen the window, and the
    deltas are still the full decode."""
    rng = random.Random(5)
    text_ids = tok.encode(" ".join(TEXTS * 4))
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for i in text_ids:   # each text id followed by a run of 0-40 ids without text
        ids.append(i)
        ids += [rng.choice([eos, tok.vocab_size + rng.randrange(10_000)])
                for _ in range(rng.randrange(41))]
    spy = WindowSpy(tok)
    detok = IncrementalDetokenizer(spy, skip_special_tokens=True)
    deltas = run(detok, ids, rng)
    assert len(ids) > 10 * len(text_ids) > 1000
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) \
        == tok.decode(text_ids, skip_special_tokens=True)
    assert max(spy.lengths) <= 16


def test_skip_special_tokens(tok):
    eos = tok.token_to_id("<|endoftext|>")
    ids = tok.encode("héllo") + [eos] + tok.encode(" wörld")
    for skip, want in ((True, "héllo wörld"), (False, "héllo<|endoftext|> wörld")):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        assert "".join(run(detok, ids, random.Random(0))) == want == tok.decode(ids, skip)


# --------------------------------------------------------------------------- stop strings
STOPS = [["STOP"], ["###", "end"], ["ö"], ["😀"], ["日本"], ["a", "ab"], ["lazy dog"],
         ["<|im_end|>"], ["xyz-never"], ["wörld 日本語 😀"]]


def expected_stop_output(full: str, stops: list[str]) -> tuple[str, bool]:
    hits = [full.find(s) for s in stops if s and s in full]
    return (full[:min(hits)], True) if hits else (full, False)


def test_stop_strings_cut_before_first_match(tok):
    rng = random.Random(7)
    texts = TEXTS + CORPUS + ["STOP at start", "ends with STO", "### then end", "ST STOP",
                              "a partial ###"]
    for text in texts:
        ids = tok.encode(text)
        full = tok.decode(ids)
        for stops in STOPS:
            detok = IncrementalDetokenizer(tok, stop=stops)
            deltas = run(detok, ids, rng)
            out = "".join(deltas)
            want, stopped = expected_stop_output(full, stops)
            assert (out, detok.stopped) == (want, stopped), (text, stops)
            assert detok.text == out
            assert not any(s in out for s in stops)
            assert detok.add(ids[:1]) == "" if stopped else True


def test_stop_prefix_held_then_released_on_finish(tok):
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    emitted = "".join(detok.add([i]) for i in tok.encode("the quick STO"))
    assert emitted == "the quick " and not detok.stopped  # "STO" could still become "STOP"
    assert detok.finish() == "STO"
    assert detok.text == "the quick STO"


def test_stop_prefix_released_when_disambiguated(tok):
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    out = "".join(detok.add([i]) for i in tok.encode("ST STOP"))
    assert out == "ST " and detok.stopped
    assert detok.finish() == ""


def test_stop_matcher_directly():
    m = StopMatcher(["abc", "bd", ""])
    assert m.feed("xxa") == "xx"
    assert m.feed("b") == ""           # "ab" could be "abc", "b" could be "bd"
    assert m.feed("x") == "abx"
    assert m.feed("ab") == ""
    assert m.feed("d") == "a" and m.stopped  # "bd" matched first
    assert m.feed("more") == ""
    assert StopMatcher([]).feed("anything") == "anything"
    overlap = StopMatcher(["aab"])
    assert overlap.feed("aaaa") == "aa" and overlap.feed("b") == "" and overlap.stopped
