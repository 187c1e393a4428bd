"""llguidance's view of a model's tokenizer, for whoever follows grammars over token ids:
the worker's sampling rank (masks) and the scheduler's engine core (fast-forward tokens).
Both must build it alike, or their matchers would disagree about which tokens a grammar
forces."""
from __future__ import annotations

import logging
import os

from llguidance import LLTokenizer

log = logging.getLogger("nanoserve")


def load_tokenizer(model_dir: str, vocab_size: int, eos_token_id: int) -> LLTokenizer | None:
    """llguidance's view of the model's tokenizer.json; None (logged) where the model has
    none or llguidance cannot read it: the worker then says it cannot follow grammars
    (WorkerInfo.structured_output) and the scheduler refuses formats instead of ignoring them."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        log.warning("no tokenizer.json in %s: requests with an output format are refused", model_dir)
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_token_id)
    except ValueError as e:
        log.warning("llguidance cannot read %s (%s): requests with an output format are refused",
                    path, e)
        return None
