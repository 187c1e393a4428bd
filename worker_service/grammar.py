"""Grammar state on the sampling rank: one llguidance matcher per constrained sequence.

Why here (the README's architecture notes have the numbers): with two steps in flight the
scheduler learns token N only after step N+1 has left, so masks built there would cost a
constrained sequence a step per token. The sampling rank (TP rank 0) sees token N first:
it launches step N+1's forward, then, while the GPU runs it, waits for step N's samples to
reach pinned host memory (they were sampled before the forward began), advances each
matcher by its token and fills step N+1's masks on llguidance's threads (it releases the
GIL). The masks go to the GPU in one copy and one kernel applies them before sampling.
A step without constrained rows does none of this.

A sequence (re)sent in full carries its output so far (SeqWork.output_ids_i32): its
matcher is rebuilt from the grammar and those ids, so the state survives preemption and
a worker restart; ranks other than 0 keep no state. Compiled grammars are cached by text
(a fresh matcher per sequence is a deep copy). numpy only: the null worker uses it too.

Deep copies of one compiled matcher share its lazily built lexer behind one lock, so
llguidance fills their masks one after another however many threads it has (measured:
128 masks took as long on 2 threads as on 1; from 2 compiled roots, half as long). A
grammar is therefore compiled once per mask thread, lazily (one more root per new
sequence until there are as many as threads), sequences are dealt over the roots, and a
step's masks are handed to the threads grouped by root.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from nanoserve.compiled_grammars import CompiledGrammars
from nanoserve.proposals import accepted_prefix
from nanoserve.v1 import worker_pb2
from worker_service.step_plan import verify_drafts


def mask_threads() -> int:
    """llguidance's own default: 80% of the CPUs, at most 32."""
    return max(1, min(32, int(0.8 * (os.cpu_count() or 1))))


@dataclass
class Awaiting:
    """Samples of a launched step that matchers still have to consume."""
    tokens: Callable[[], np.ndarray]          # waits for the step's ids on the host
    rows: list[tuple[int, "Matcher"]]         # (sampling row, matcher) pairs
    drafts: dict["Matcher", list[int]]        # verify steps: the tokens proposed for a matcher


@dataclass(eq=False)
class Matcher:
    """One sequence's matcher, which compiled root it was copied from, and whether it
    samples fast-forward tokens (WorkerSampling.fast_forward)."""
    m: LLMatcher
    root: int
    fast_forward: bool = False


class GrammarState:
    def __init__(self, tokenizer: LLTokenizer, vocab_size: int, eos_token_id: int,
                 threads: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.words = (vocab_size + 31) // 32   # int32 words per mask row
        self.eos_only = np.zeros(self.words, np.int32)
        self.eos_only.view(np.uint32)[eos_token_id // 32] = 1 << (eos_token_id % 32)
        self.threads = threads or mask_threads()
        self.executor = LLExecutor(self.threads)
        self.grammars = CompiledGrammars(tokenizer, self.threads, "on the worker")   # root/thread
        self.matchers: dict[int, Matcher] = {}   # seq_id -> matcher
        self.awaiting: list[Awaiting] = []
        self.forced: list[tuple[Matcher, list[int]]] = []   # fast-forward tokens to take in
        # This step's verify rows (speculative decoding): the tokens proposed after the
        # sequence's last known one; its rows sample after each (DecodeBatch.num_samples_i32).
        self.drafts: dict[Matcher, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def update(self, req: worker_pb2.StepRequest) -> None:
        """Follow the step's drops and (re)sent sequences (after SeqTable.plan checked it)."""
        if self.matchers:
            for seq_id in req.drop_seq_ids:
                self.matchers.pop(seq_id, None)
        for w in req.seqs:
            if not w.reset_block_table:
                continue
            self.matchers.pop(w.seq_id, None)
            if w.sampling.grammar:
                m = Matcher(*self.grammars.fresh(w.sampling.grammar), w.sampling.fast_forward)
                output = np.frombuffer(w.output_ids_i32, "<i4").tolist()
                if output:
                    m.m.consume_tokens(output)
                self.matchers[w.seq_id] = m
        d = req.decode
        self.drafts = {}
        if d.num_tokens_i32 and self.matchers:   # rows after the first: forced, then proposed
            drafts = verify_drafts(d)
            per = np.frombuffer(d.num_tokens_i32, "<i4")
            tokens = np.frombuffer(d.token_ids_i32, "<i4")
            ends = np.cumsum(per)
            for seq_id, n, end in zip(np.frombuffer(d.seq_ids_u64, "<u8").tolist(), per.tolist(),
                                      ends.tolist()):
                if n > 1 and (m := self.matchers.get(seq_id)) is not None:
                    proposed = drafts.get(seq_id, [])
                    if n > len(proposed) + 1:
                        self.forced.append((m, tokens[end - n + 1:end - len(proposed)].tolist()))
                    if proposed:
                        self.drafts[m] = proposed

    def rows(self, sampling_seq_ids: list[int]) -> list[tuple[int, Matcher]]:
        """(sampling row, matcher) of the step's constrained rows."""
        if not self.matchers:
            return []
        get = self.matchers.get
        return [(i, m) for i, s in enumerate(sampling_seq_ids) if (m := get(s)) is not None]

    def catch_up(self) -> None:
        """Advance every matcher by the ids its earlier steps sampled (waits for them). A
        verify step's matcher takes the run the scheduler accepts: the proposals equal to
        the sample before them, then one sample more (Scheduler.resolve's rule)."""
        for a in self.awaiting:
            tokens = a.tokens().tolist()
            if a.drafts:
                first = {}
                for i, m in a.rows:
                    first.setdefault(m, i)
                for m, drafts in a.drafts.items():
                    row = first[m]
                    j = accepted_prefix(drafts, tokens, row)
                    m.m.consume_tokens(tokens[row:row + j + 1])
            rest = [(m.m, tokens[i]) for i, m in sorted(a.rows, key=lambda r: r[1].root)
                    if m not in a.drafts]
            if rest:
                self.executor.consume_token_par(rest)
        self.awaiting.clear()

    def fill(self, rows: list[tuple[int, Matcher]], out: np.ndarray) -> None:
        """Masks of `rows` into out [len(rows), words] int32, in parallel (grouped by root,
        see the module docstring), after the matchers took in the step's fast-forward
        tokens (they follow every sampled id, which catch_up gave them). A matcher in an
        error state (it cannot be, unless its grammar failed on the worker) allows only the
        end-of-sequence token, so the sequence ends instead of producing garbage; a
        fast-forward matcher where its grammar forces a continuation allows only the first
        forced token, the one the scheduler expects."""
        for m, tokens in self.forced:
            m.m.consume_tokens(tokens)
        self.forced.clear()
        work = []
        verify = []   # (matcher, index of its first row, drafts): a mask per row, in order
        for j, (_, m) in enumerate(rows):
            if m in self.drafts:
                if j == 0 or rows[j - 1][1] is not m:
                    verify.append((m.m, j, self.drafts[m]))
                    out[j:j + len(self.drafts[m]) + 1] = self.eos_only   # past an invalid draft
            elif m.m.is_error():
                out[j] = self.eos_only
            elif m.fast_forward and (forced := m.m.compute_ff_tokens()):
                out[j] = 0   # (no llguidance mask: that costs far more than asking)
                out[j].view(np.uint32)[forced[0] // 32] = 1 << (forced[0] % 32)
            else:
                work.append((m.m, j))
        if work:
            work.sort(key=lambda t: rows[t[1]][1].root)
            self.executor.unsafe_compute_mask_ptr(work, out.ctypes.data, self.words * 4, len(rows))
            for m, j in work:
                if m.is_error():
                    out[j] = self.eos_only
        if verify:   # llguidance advances each matcher through its drafts and rolls it back
            self.executor.unsafe_compute_mask_ptr_with_draft_token(
                verify, out.ctypes.data, self.words * 4, len(rows))

    def sampled(self, rows: list[tuple[int, Matcher]], tokens: Callable[[], np.ndarray]) -> None:
        """The step that masked `rows` is launched; `tokens()` will give its sampled ids."""
        self.awaiting.append(Awaiting(tokens, rows, self.drafts))
