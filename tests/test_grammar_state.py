"""worker_service/grammar.py on its own: matchers per sequence, masks against llguidance's
single-matcher fill, state rebuilt from resent output, drops, roots dealt over threads."""
from __future__ import annotations

import json

import numpy as np
import pytest
from llguidance import LLMatcher

from nanoserve.v1 import worker_pb2
from scheduler_service.constraints import grammar_for
from tiny_checkpoint import tiny_qwen3_dir
from worker_service.grammar import GrammarState, load_tokenizer

VOCAB, EOS = 389, 0
SCHEMA = json.dumps({"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB)), VOCAB, EOS)


def send(state: GrammarState, seqs: dict[int, list[int]], grammar: str, drop=()) -> None:
    req = worker_pb2.StepRequest(drop_seq_ids=list(drop))
    for seq_id, output in seqs.items():
        w = req.seqs.add(seq_id=seq_id, reset_block_table=True)
        w.sampling.grammar = grammar
        w.output_ids_i32 = np.array(output, "<i4").tobytes()
    state.update(req)


def allowed(mask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def test_masks_match_a_lone_matcher_and_follow_sampled_ids(tokenizer):
    grammar = grammar_for("json_schema", SCHEMA)
    state = GrammarState(tokenizer, VOCAB, EOS, threads=3)
    prefixes = {i: tokenizer.tokenize_str(p) for i, p in enumerate(['["a', '[', '["ab", "c', '["x"]'])}
    send(state, prefixes, grammar)
    assert sorted({m.root for m in state.matchers.values()}) == [0, 1, 2]   # 4 seqs, 3 roots
    rng = np.random.default_rng(0)
    refs = {i: LLMatcher(tokenizer, grammar) for i in prefixes}
    for i, ids in prefixes.items():
        refs[i].consume_tokens(ids)
    for _ in range(6):
        rows = state.rows([3, 0, 2, 1, 99])   # 99: an unconstrained row
        assert [i for i, _ in rows] == [0, 1, 2, 3]
        masks = np.zeros((4, state.words), np.int32)
        state.fill(rows, masks)
        picks = []
        for j, seq_id in enumerate([3, 0, 2, 1]):
            ref = np.zeros((1, state.words), np.int32)
            refs[seq_id].unsafe_compute_mask_ptr(ref.ctypes.data, state.words * 4)
            assert allowed(masks[j]) == allowed(ref[0])
            pick = int(rng.choice(sorted(allowed(masks[j]))))
            refs[seq_id].consume_token(pick)
            picks.append(pick)
        state.sampled(rows, lambda picks=picks: np.array(picks + [7]))
        state.catch_up()


def test_resent_sequence_is_rebuilt_and_drops_forget(tokenizer):
    grammar = grammar_for("choice", json.dumps(["alpha", "beta"]))
    state = GrammarState(tokenizer, VOCAB, EOS, threads=1)
    send(state, {5: tokenizer.tokenize_str("al")}, grammar)
    masks = np.zeros((1, state.words), np.int32)
    state.fill(state.rows([5]), masks)
    ref = LLMatcher(tokenizer, grammar)
    ref.consume_tokens(tokenizer.tokenize_str("al"))
    expect = np.zeros((1, state.words), np.int32)
    ref.unsafe_compute_mask_ptr(expect.ctypes.data, state.words * 4)
    assert allowed(masks[0]) == allowed(expect[0]) and EOS not in allowed(masks[0])
    send(state, {}, grammar, drop=[5])
    assert not state and state.rows([5]) == []


def test_a_matcher_in_error_allows_only_eos(tokenizer):
    state = GrammarState(tokenizer, VOCAB, EOS, threads=1)
    send(state, {1: []}, grammar_for("regex", "ab"))
    bad = tokenizer.tokenize_str("z")[0]
    state.sampled(state.rows([1]), lambda: np.array([bad]))
    state.catch_up()
    masks = np.zeros((1, state.words), np.int32)
    state.fill(state.rows([1]), masks)
    assert allowed(masks[0]) == {EOS}
