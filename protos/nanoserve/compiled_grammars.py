"""Compiled grammars, cached by their text, for whoever follows grammars over token ids:
the engine core (fast-forward tokens) and the worker's sampling rank (masks). Compiling is
the dear part (about a millisecond for a JSON schema, more with bounded strings); a
sequence's matcher is a deep copy of a compiled root.

Deep copies of one root share its lazily built lexer behind one lock, so a caller that
fills masks on several threads asks for up to `roots` roots per grammar: matchers are
dealt over them round robin, and it hands each thread the matchers of one root
(worker_service/grammar.py)."""
from __future__ import annotations

import logging
from collections import OrderedDict

from llguidance import LLMatcher, LLTokenizer

log = logging.getLogger("nanoserve")

CACHED = 64   # grammars kept compiled, least recently used dropped first


class CompiledGrammars:
    def __init__(self, tokenizer: LLTokenizer, roots: int = 1, where: str = ""):
        self.tokenizer = tokenizer
        self.roots = roots
        self.where = where   # for the log: which process failed to compile
        # grammar -> (its compiled roots, matchers started from it so far)
        self._cache: OrderedDict[str, tuple[list[LLMatcher], int]] = OrderedDict()

    def fresh(self, grammar: str) -> tuple[LLMatcher, int]:
        """A new matcher at the grammar's start, and which of its roots it copies. A grammar
        that does not compile (the scheduler checked it, so it should) gives a matcher in
        its error state, logged."""
        roots, started = self._cache.pop(grammar, ([], 0))
        j = started % self.roots
        if j == len(roots):   # another root, until there are `self.roots`
            root = LLMatcher(self.tokenizer, grammar, log_level=0)
            if root.is_error():
                log.warning("grammar does not compile %s: %s", self.where, root.get_error())
            roots.append(root)
        self._cache[grammar] = (roots, started + 1)   # most recently used last
        if len(self._cache) > CACHED:
            self._cache.popitem(last=False)
        return roots[j].deep_copy(), j
