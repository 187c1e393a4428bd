"""worker_service/grammar.py on its own: matchers per sequence, masks against llguidance's
single-matcher fill, state rebuilt from resent output, drops, roots dealt over threads."""
from __future__ import annotations

import json

import numpy as np
import pytest
from llguidance import LLMatcher

from nanoserve.grammar_tokenizer import load_tokenizer
from nanoserve.v1 import worker_pb2
from scheduler_service.constraints import grammar_for
from tiny_checkpoint import tiny_qwen3_dir
from worker_service.grammar import GrammarState

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


def test_fast_forward_samples_the_forced_token_and_takes_in_forced_rows(tokenizer):
    """A fast-forward matcher where its grammar forces bytes allows only the first forced
    token (what the scheduler expects); the decode rows after a sequence's first are
    forced tokens its matcher takes in before its next mask. A plain matcher's mask is
    llguidance's own."""
    grammar = grammar_for("json_schema", json.dumps(
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}},
         "required": ["name"], "additionalProperties": False}))
    state = GrammarState(tokenizer, VOCAB, EOS, threads=1)
    req = worker_pb2.StepRequest()
    for seq_id, ff in ((1, True), (2, False)):
        w = req.seqs.add(seq_id=seq_id, reset_block_table=True)
        w.sampling.grammar, w.sampling.fast_forward = grammar, ff
    state.update(req)
    ref = LLMatcher(tokenizer, grammar)
    forced = ref.compute_ff_tokens()                  # '{"name": "' in canonical tokens
    assert len(forced) >= 2
    masks = np.zeros((2, state.words), np.int32)
    state.fill(state.rows([1, 2]), masks)
    plain = np.zeros((1, state.words), np.int32)
    ref.unsafe_compute_mask_ptr(plain.ctypes.data, state.words * 4)
    assert allowed(masks[0]) == {forced[0]}
    assert allowed(masks[1]) == allowed(plain[0])     # (llguidance itself mostly allows
    # only the canonical token where bytes are forced: the two often agree)
    state.sampled(state.rows([1, 2]), lambda: np.array([forced[0], forced[0]]))
    state.catch_up()
    # The next step runs seq 1's sample and the rest of the forced tokens as decode rows.
    step = worker_pb2.StepRequest()
    step.decode.seq_ids_u64 = np.array([1], "<u8").tobytes()
    step.decode.num_tokens_i32 = np.array([len(forced)], "<i4").tobytes()
    step.decode.token_ids_i32 = np.array([-1, *forced[1:]], "<i4").tobytes()
    state.update(step)
    state.fill(state.rows([1]), masks[:1])
    ref.consume_tokens(forced)
    expect = np.zeros((1, state.words), np.int32)
    ref.unsafe_compute_mask_ptr(expect.ctypes.data, state.words * 4)
    assert allowed(masks[0]) == allowed(expect[0]) and len(allowed(masks[0])) > 1
