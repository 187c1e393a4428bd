"""Incremental detokenization of one sequence, with stop strings.

Why incremental: decoding all of a sequence's ids on every step costs O(length) per
token, O(length^2) per request. Instead (the vLLM/TGI "prefix offset / read offset"
technique) we decode only a small window each time:

    ids:   ... | prefix_offset ... read_offset | new ids ...
    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

Decoding from a few tokens *before* the new ones keeps context-dependent decoding
right (SentencePiece strips the leading space of the first token it decodes). When
new_text ends in U+FFFD, the last token stops in the middle of a UTF-8 character (byte
level BPE splits emoji and CJK across tokens): we hold everything back until a later
token completes it, so a split character is never sent as U+FFFD.

Ids that decoding ignores (past the tokenizer's vocabulary, special tokens when they are
skipped) are dropped before they reach the window: they add no text, so the window would
not advance and each add would decode all of them again, O(length) per token. The GPU
benchmark's random checkpoint (a 151,936-id model, a 320-id tokenizer) samples such ids
almost every step.

Stop strings: the emitted text must end right before the first stop string, and a
stop string can straddle deltas. So any tail of the text that could still grow into a
stop string is held back until the next tokens decide it; `finish()` releases it when
the sequence ends for another reason (eos, max_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Context tokens decoded before the first new token (vLLM uses 5 as well).
INITIAL_PREFIX_TOKENS = 5
# How much further back into the prompt we may look for a clean start (see below).
MAX_EXTRA_PREFIX_TOKENS = 8
# How far back from the prompt's end to look for those (ids decoding ignores are skipped).
PROMPT_SCAN_TOKENS = 256


class Decoder(Protocol):
    vocab_size: int                 # ids >= this decode to nothing
    special_token_ids: set[int]     # what skip_special_tokens drops

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


@dataclass
class StopMatcher:
    """Cuts text before the first stop string, holding back possible stop-string starts."""

    stops: list[str]
    pending: str = ""        # text received but not yet emitted (a possible stop start)
    stopped: bool = False

    def __post_init__(self) -> None:
        self.stops = [s for s in dict.fromkeys(self.stops) if s]  # "" would match at once

    def feed(self, text: str, final: bool = False) -> str:
        """Add text; return what is safe to emit. `final`: no more text comes."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.pending += text
        # A stop string can only start inside `pending`: any earlier possible start
        # was held back, so `pending` is all we search.
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        hold = 0 if final else self._possible_stop_start()
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def _possible_stop_start(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(s[:n]):
                    best = n
                    break
        return best


@dataclass
class IncrementalDetokenizer:
    """Turns a sequence's generated ids into text deltas, O(new tokens) per call."""

    tokenizer: Decoder
    prompt_ids: Sequence[int] = ()
    skip_special_tokens: bool = False
    stop: list[str] = field(default_factory=list)

    finished: bool = field(init=False, default=False)
    # Only ids[prefix_offset:] are ever decoded again, so only they are kept
    # (offsets are relative to this window, which is trimmed as it advances).
    _ids: list[int] = field(init=False)
    _prefix_offset: int = field(init=False)
    _read_offset: int = field(init=False)
    _stop: StopMatcher = field(init=False)
    _pieces: list[str] = field(init=False, default_factory=list)  # emitted deltas

    def __post_init__(self) -> None:
        self._vocab_size = self.tokenizer.vocab_size
        self._skipped = self.tokenizer.special_token_ids if self.skip_special_tokens else ()
        # The prompt's last few tokens give the first generated token its context
        # (e.g. its leading space); none of the prompt text is emitted.
        tail = self._decodable(self.prompt_ids[-PROMPT_SCAN_TOKENS:])
        tail = tail[-(INITIAL_PREFIX_TOKENS + MAX_EXTRA_PREFIX_TOKENS):]
        self._ids, self._read_offset = tail, len(tail)
        self._prefix_offset = self._clean_prefix_offset()
        self._stop = StopMatcher(list(self.stop))

    def _clean_prefix_offset(self) -> int:
        """Where to start decoding the prompt's tail. A window that starts inside a
        multi-byte character decodes to U+FFFD (with SentencePiece byte fallback, the
        whole run of byte tokens does), and would hold back all later text; so look a
        little further back, or closer, for a start on a character boundary."""
        r = self._read_offset
        first = max(r - INITIAL_PREFIX_TOKENS, 0)
        for p in [*range(first, -1, -1), *range(first + 1, r + 1)]:
            if REPLACEMENT_CHAR not in self._decode(self._ids[p:r]):
                return p
        return r

    @property
    def text(self) -> str:
        """Everything emitted so far (joined on demand: appending stays O(delta))."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stopped(self) -> bool:
        """True once a stop string appeared: the sequence should finish with reason "stop"."""
        return self._stop.stopped

    def add(self, token_ids: Sequence[int]) -> str:
        """Append newly generated ids; return the new text that is safe to send."""
        if self.stopped or self.finished:
            return ""
        token_ids = self._decodable(token_ids)
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing new yet, or a character is still split: wait for the next token.
            return ""
        delta = new_text[len(prefix_text):]
        self._advance(self._read_offset, len(self._ids))
        return self._emit(self._stop.feed(delta))

    def finish(self) -> str:
        """The sequence ended (not by a stop string): flush what was held back. A
        trailing incomplete UTF-8 character is dropped, never sent as U+FFFD."""
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:]).rstrip(REPLACEMENT_CHAR)
        delta = new_text[len(prefix_text):]
        return self._emit(self._stop.feed(delta, final=True))

    # ------------------------------------------------------------------ internals
    def _decodable(self, ids: Sequence[int]) -> list[int]:
        """ids without those decoding ignores (the same text, a smaller window)."""
        vocab, skipped = self._vocab_size, self._skipped
        return [t for t in ids if t < vocab and t not in skipped]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, prefix_offset: int, read_offset: int) -> None:
        self._prefix_offset, self._read_offset = prefix_offset, read_offset
        if self._prefix_offset > 64:  # drop ids that are never decoded again
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta
