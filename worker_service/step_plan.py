"""The worker's per-sequence state, and one StepRequest turned into the arrays a step needs.

A step travels as a diff (worker.proto): new sequences in full, chunks and decode rows
as ids, blocks only when appended. `SeqTable` holds what the diffs apply to: each
sequence's block table (rows of one growing int32 array, so a batch's tables are one
fancy-index away), how many of its tokens are in the KV cache, and its sampling params.
`SeqTable.plan` checks a request against that state and returns a `StepPlan` (token ids,
positions, KV slots, block tables, which rows sample); `SeqTable.commit` advances the
state once the step is launched. The real ModelRunner and the null worker both run
every step through here, so they accept and reject exactly the same requests.

numpy only: the null worker must not need torch.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from nanoserve.proposals import accepted_prefix
from nanoserve.v1 import worker_pb2

PLACEHOLDER = -1


def verify_drafts(d: worker_pb2.DecodeBatch) -> dict[int, list[int]]:
    """A decode batch's verify rows (speculative decoding): seq_id -> the tokens proposed
    after its last known one (the inputs of its last num_samples - 1 rows). What the
    sampling rank's grammar and penalty state need of a step, checked by SeqTable.plan."""
    if not d.num_samples_i32:
        return {}
    n_samp = np.frombuffer(d.num_samples_i32, "<i4").tolist()
    ends = np.cumsum(np.frombuffer(d.num_tokens_i32, "<i4")).tolist()
    tokens = np.frombuffer(d.token_ids_i32, "<i4")
    return {seq_id: tokens[end - s + 1:end].tolist()
            for seq_id, s, end in zip(np.frombuffer(d.seq_ids_u64, "<u8").tolist(), n_samp, ends)
            if s > 1}


def draft_ids(drafts: np.ndarray, k: np.ndarray) -> bytes:
    """StepResponse.draft_token_ids_i32: each row's first k of [D, max k] drafts."""
    return drafts[np.arange(drafts.shape[1]) < k[:, None]].astype("<i4").tobytes()


class StepError(ValueError):
    """A StepRequest that contradicts the worker's state (bad ids, unknown sequence)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    repetition_penalty: float = 1.0   # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0             # k alternatives to return (0 = off)
    bias_ids: tuple[int, ...] = ()     # logit_bias: ids and what is added to their logits
    biases: tuple[float, ...] = ()
    banned_ids: tuple[int, ...] = ()   # min_tokens: not sampled at context lengths below
    banned_until: int = 0
    constrained: bool = False          # an output format (its grammar lives on the sampling rank)

    @classmethod
    def from_proto(cls, s: worker_pb2.WorkerSampling, vocab_size: int) -> "SamplingParams":
        bias_ids = np.frombuffer(s.logit_bias_ids_i32, "<i4")
        biases = np.frombuffer(s.logit_bias_f32, "<f4")
        if len(bias_ids) != len(biases):
            raise StepError(f"logit_bias: {len(bias_ids)} ids but {len(biases)} biases")
        banned = np.frombuffer(s.banned_ids_i32, "<i4")
        for name, ids in (("logit_bias", bias_ids), ("banned ids", banned)):
            if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
                raise StepError(f"{name}: token id out of range [0, {vocab_size})")
        return cls(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p,
                   seed=s.seed if s.has_seed else None, logprobs=s.logprobs,
                   repetition_penalty=s.repetition_penalty or 1.0,
                   presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                   top_logprobs=s.top_logprobs, bias_ids=tuple(bias_ids.tolist()),
                   biases=tuple(biases.tolist()), banned_ids=tuple(banned.tolist()),
                   banned_until=s.banned_until, constrained=bool(s.grammar))

    @property
    def has_penalty(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class PoolingParams:
    """A pooling row's answer (worker.proto's WorkerPooling): an embedding or a yes/no score."""
    kind: int                  # WorkerPooling.KIND_EMBED or KIND_SCORE
    dimensions: int = 0        # EMBED: first d values (0: all)
    yes_token_id: int = 0      # SCORE: the LM head rows compared
    no_token_id: int = 0

    @classmethod
    def from_proto(cls, p: worker_pb2.WorkerPooling, vocab_size: int, hidden_size: int
                   ) -> "PoolingParams | None":
        if p.kind == worker_pb2.WorkerPooling.KIND_NONE:
            return None
        if p.kind == worker_pb2.WorkerPooling.KIND_SCORE and not (
                p.yes_token_id < vocab_size and p.no_token_id < vocab_size):
            raise StepError(f"score token ids out of range [0, {vocab_size})")
        if hidden_size and p.dimensions > hidden_size:
            raise StepError(f"dimensions {p.dimensions} exceed the hidden size {hidden_size}")
        return cls(p.kind, p.dimensions, p.yes_token_id, p.no_token_id)


TASK_KINDS = {worker_pb2.WorkerPooling.KIND_EMBED: "embed",
              worker_pb2.WorkerPooling.KIND_SCORE: "score"}


@dataclass
class DraftPlan:
    """The sequences of a step that asked for drafts (DecodeBatch.num_drafts_i32), one entry
    each: what the drafter needs to settle their proposals and draft from the newest token."""
    k: np.ndarray              # [D] tokens to propose
    seq_ids: list[int]         # [D]
    rows: np.ndarray           # [D] SeqTable rows
    first_sample: np.ndarray   # [D] index of the sequence's first sample among the step's
    first_token: np.ndarray    # [D] index of its first sampling row among the step's tokens
    num_samples: np.ndarray    # [D] its samples (1 + proposals)
    position: np.ndarray       # [D] position of its first sampling row's input token
    proposals: list[list[int]]  # [D] the proposals this step verifies for it

    def settle(self, samples: np.ndarray, table: "SeqTable"
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where each sequence's drafting starts, given the step's samples (host): (index
        of its newest token among the samples, that token's position, how many drafts fit
        its blocks and max_model_len). Its proposals are accepted while equal to the sample
        before them: the scheduler's rule (Scheduler._resolve_verify), so both agree on the
        newest token."""
        accepted = np.zeros(len(self.k), np.int64)
        for i, proposal in enumerate(self.proposals):
            accepted[i] = accepted_prefix(proposal, samples, int(self.first_sample[i]))
        start = self.position + accepted + 1
        room = np.minimum(table.table_len[self.rows] * table.block_size, table.max_model_len)
        return self.first_sample + accepted, start, np.clip(np.minimum(self.k, room - start), 0, None)


MAX_DRAFTS = 64   # most draft tokens per sequence and step (the scheduler's k is <= 64)


@dataclass
class StepPlan:
    step_id: int
    seq_ids: list[int]              # one per row: prefill rows, then decode rows
    rows: np.ndarray                # [R] their rows in SeqTable's arrays
    num_tokens: np.ndarray          # [R] query tokens per row
    start_pos: np.ndarray           # [R] position of each row's first query token
    token_ids: np.ndarray           # [T] int64, PLACEHOLDER where the last sample goes
    positions: np.ndarray           # [T] int64
    slot_mapping: np.ndarray        # [T] int32
    block_tables: np.ndarray        # [R, W] int32 (W = the longest table in the step)
    sample: np.ndarray              # [R] bool: the row's last token is sampled
    fill: tuple[np.ndarray, np.ndarray] | None   # (indices into token_ids, rows of the
                                                 # previous step's samples) for placeholders
    sampling: list[SamplingParams] = field(default_factory=list)   # per sampling row
    drafts: DraftPlan | None = None   # sequences that asked for drafts after this step
    # Rows whose last token is pooled instead of sampled (embeddings, scores): [R] bool,
    # None where none is; their params in row order. They answer in the sampling rows'
    # order (StepResponse), so `pool_at` says where among the answers they go.
    pool: np.ndarray | None = None
    pooling: list[PoolingParams] = field(default_factory=list)

    @property
    def pool_at(self) -> np.ndarray:
        """Each pooling row's index among the step's answers (sampling and pooling rows)."""
        return np.flatnonzero(self.pool[self.sample | self.pool])

    def pool_token_index(self) -> np.ndarray:
        """Index into token_ids of each pooling row's last token."""
        return (np.cumsum(self.num_tokens) - 1)[self.pool]

    @property
    def context_lens(self) -> np.ndarray:
        return self.start_pos + self.num_tokens

    @property
    def is_decode(self) -> bool:
        return bool((self.num_tokens == 1).all())

    @property
    def prefix_free(self) -> bool:
        return not self.start_pos.any()

    @property
    def num_samples(self) -> int:
        return int(self.sample.sum())

    @property
    def want_logprobs(self) -> bool:
        return any(p.logprobs for p in self.sampling)

    @property
    def top_logprobs(self) -> int:
        """The most alternatives any sampling row asked for (0: none)."""
        return max((p.top_logprobs for p in self.sampling), default=0)

    @property
    def sampling_seq_ids(self) -> list[int]:
        return [s for s, keep in zip(self.seq_ids, self.sample.tolist()) if keep]

    def last_token_index(self) -> np.ndarray:
        """Index into token_ids of each sampling row's last token."""
        return (np.cumsum(self.num_tokens) - 1)[self.sample]

    def subset(self, keep: np.ndarray, sampled: bool = True) -> "StepPlan | None":
        """The plan's forward for the rows `keep` marks, in order (their tokens, slots and
        placeholders); with `sampled` their sampling and pooling too, else nothing sampled
        (what the drafter's mirror runs). None where nothing is left."""
        if not keep.any():
            return None
        tokens = np.repeat(keep, self.num_tokens)
        fill = None
        if self.fill is not None:
            at, src = self.fill
            kept = tokens[at]
            if kept.any():
                fill = ((np.cumsum(tokens) - 1)[at[kept]], src[kept])
        sample, sampling = np.zeros(int(keep.sum()), bool), []
        pool, pooling = None, []
        if sampled:
            sample = self.sample[keep]
            sampling = [p for p, k in zip(self.sampling, keep[self.sample].tolist()) if k]
            if self.pool is not None and self.pool[keep].any():
                pool = self.pool[keep]
                pooling = [p for p, k in zip(self.pooling, keep[self.pool].tolist()) if k]
        return StepPlan(step_id=self.step_id, seq_ids=[s for s, k in zip(self.seq_ids, keep) if k],
                        rows=self.rows[keep], num_tokens=self.num_tokens[keep],
                        start_pos=self.start_pos[keep], token_ids=self.token_ids[tokens],
                        positions=self.positions[tokens], slot_mapping=self.slot_mapping[tokens],
                        block_tables=self.block_tables[keep], sample=sample, fill=fill,
                        sampling=sampling, pool=pool, pooling=pooling)


class SeqTable:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int, max_model_len: int,
                 tasks: tuple[str, ...] = (), hidden_size: int = 0):
        # tasks: what the worker serves (--task: generate, embed, score); a row for another
        # is refused. (): every task (tests, tools)
        self.tasks, self.hidden_size = frozenset(tasks), hidden_size
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.row_of: dict[int, int] = {}
        self.free_rows: list[int] = []
        self.tables = np.zeros((0, self.max_blocks), dtype=np.int32)
        self.table_len = np.zeros(0, dtype=np.int64)     # blocks in each row's table
        self.computed = np.zeros(0, dtype=np.int64)      # tokens of each row in the KV cache
        self.params: list[SamplingParams] = []
        self.adapter = np.zeros(0, dtype=np.int64)       # each row's LoRA adapter id (0: none)
        self.pooling: list[PoolingParams | None] = []    # each row's pooling (None: it samples)
        self.last_rows: dict[int, int] = {}   # seq_id -> its row in the last step's samples

    def __len__(self) -> int:
        return len(self.row_of)

    # ---- state -------------------------------------------------------------------------

    def _new_row(self, seq_id: int) -> int:
        if not self.free_rows:
            n = len(self.computed)
            grow = max(n, 64)
            self.tables = np.concatenate([self.tables, np.zeros((grow, self.max_blocks), np.int32)])
            self.table_len = np.concatenate([self.table_len, np.zeros(grow, np.int64)])
            self.computed = np.concatenate([self.computed, np.zeros(grow, np.int64)])
            self.params.extend([GREEDY] * grow)
            self.pooling.extend([None] * grow)
            self.adapter = np.concatenate([self.adapter, np.zeros(grow, np.int64)])
            self.free_rows = list(range(n + grow - 1, n - 1, -1))
        row = self.free_rows.pop()
        self.row_of[seq_id] = row
        return row

    def drop(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)
            self.last_rows.pop(seq_id, None)

    def _set_table(self, row: int, blocks: np.ndarray, seq_id: int) -> None:
        if len(blocks) > self.max_blocks:
            raise StepError(f"sequence {seq_id}: {len(blocks)} blocks exceed max_model_len")
        self.tables[row, :len(blocks)] = blocks
        self.table_len[row] = len(blocks)

    # ---- one step ----------------------------------------------------------------------

    def plan(self, req: worker_pb2.StepRequest) -> StepPlan:
        """Apply the request's drops and table updates and check it; the arrays of the step.

        A StepError leaves the table half-updated: the scheduler answers it by re-Initing
        the worker (which clears everything) and resending every sequence."""
        for seq_id in req.drop_seq_ids:
            self.drop(seq_id)
        seq_ids: list[int] = []
        rows: list[int] = []
        n_tok: list[int] = []
        starts: list[int] = []
        sample: list[bool] = []
        pool: list[bool] = []   # the row answers its pooled hidden state, not a sample
        for w in req.seqs:
            if w.reset_block_table:
                self.drop(w.seq_id)
                row = self._new_row(w.seq_id)
                self._set_table(row, np.frombuffer(w.block_table_i32, "<i4"), w.seq_id)
                self.params[row] = SamplingParams.from_proto(w.sampling, self.vocab_size)
                self.adapter[row] = w.adapter_id
                self.pooling[row] = self._pooling(w)
            else:
                row = self.row_of.get(w.seq_id)
                if row is None:
                    raise StepError(f"sequence {w.seq_id} unknown to this worker: resend it in full")
            if w.num_tokens == 0:
                raise StepError(f"sequence {w.seq_id}: no tokens to compute")
            seq_ids.append(w.seq_id)
            rows.append(row)
            n_tok.append(w.num_tokens)
            starts.append(w.start_pos)
            pooled = w.sample and self.pooling[row] is not None
            sample.append(w.sample and not pooled)
            pool.append(pooled)
        prefill_tokens = np.frombuffer(req.token_ids_i32, "<i4").astype(np.int64)
        if len(prefill_tokens) != sum(n_tok):
            raise StepError(f"step has {len(prefill_tokens)} token ids for {sum(n_tok)} "
                            "scheduled tokens")

        d = req.decode
        dec_ids = np.frombuffer(d.seq_ids_u64, "<u8")
        nd = len(dec_ids)
        if nd:
            dec_seq_ids = dec_ids.tolist()
            try:
                dec_rows = [self.row_of[s] for s in dec_seq_ids]
            except KeyError as e:
                raise StepError(f"sequence {e.args[0]} unknown to this worker: resend it in full") from None
            pairs = np.frombuffer(d.new_blocks_i32, "<i4").reshape(-1, 2)
            for i, block in pairs.tolist():
                if not 0 <= i < nd:
                    raise StepError(f"new block for decode row {i} of {nd}")
                row = dec_rows[i]
                n = self.table_len[row]
                if n >= self.max_blocks:
                    raise StepError(f"sequence {dec_seq_ids[i]}: more blocks than max_model_len needs")
                self.tables[row, n] = block
                self.table_len[row] = n + 1
            for i, kv_len in np.frombuffer(d.kv_len_i32, "<i4").reshape(-1, 2).tolist():
                if not 0 <= i < nd or not 0 <= kv_len <= self.computed[dec_rows[i]]:
                    raise StepError(f"kv_len {kv_len} for decode row {i} of {nd}: beyond its KV")
                self.computed[dec_rows[i]] = kv_len   # rejected proposals' KV is dead
            listed = seq_ids + dec_seq_ids
            per = np.frombuffer(d.num_tokens_i32, "<i4").astype(np.int64) if d.num_tokens_i32 else None
            if per is not None and (len(per) != nd or (per < 1).any()):
                raise StepError(f"decode num_tokens must hold one count >= 1 for each of {nd} sequences")
            n_samp = np.frombuffer(d.num_samples_i32, "<i4").astype(np.int64) if d.num_samples_i32 else None
            if n_samp is not None and (len(n_samp) != nd or (n_samp < 1).any()
                                       or (n_samp > (per if per is not None else 1)).any()):
                raise StepError(f"decode num_samples must hold one count in [1, num_tokens] for "
                                f"each of {nd} sequences")
            n_dec = nd if per is None else int(per.sum())
            dec_tokens = (np.frombuffer(d.token_ids_i32, "<i4").astype(np.int64) if d.token_ids_i32
                          else np.full(n_dec, PLACEHOLDER, np.int64))
            if len(dec_tokens) != n_dec:
                raise StepError(f"decode batch has {len(dec_tokens)} token ids for {n_dec} tokens")
            drafts = self._drafts(d, nd, dec_ids, dec_rows, per, n_samp, int(sum(sample)),
                                  dec_tokens, len(prefill_tokens))
            dec_offset = np.zeros(n_dec, np.int64)
            dec_sample = [True] * n_dec
            if per is not None:   # fast-forward: each token a decode row, the last one samples
                first = np.repeat(np.cumsum(per) - per, per)
                dec_offset = np.arange(n_dec) - first
                if (dec_tokens[dec_offset > 0] == PLACEHOLDER).any():
                    raise StepError("a placeholder input (-1) must be its sequence's first token")
                dec_seq_ids = np.repeat(dec_ids, per).tolist()
                dec_rows = np.repeat(dec_rows, per).tolist()
                # the last row samples; a verify step's last num_samples rows do
                last = np.repeat(per - (1 if n_samp is None else n_samp), per)
                dec_sample = (dec_offset >= last).tolist()
            seq_ids += dec_seq_ids
            rows += dec_rows
        else:
            listed = seq_ids
            drafts = None
        if len(set(listed)) != len(listed):   # (fast-forward rows repeat one on purpose)
            raise StepError("a sequence appears twice in one step")
        if not rows:
            raise StepError("empty step")

        rows_a = np.array(rows, dtype=np.int64)
        n_dec = len(rows) - len(n_tok)
        if not n_tok:   # a decode step (the usual one): no prefill parts to join
            num_tokens = np.ones(n_dec, dtype=np.int64)
            start_pos = self.computed[rows_a] + dec_offset
            sample_a = np.array(dec_sample, dtype=bool)
            token_ids = dec_tokens
            positions = start_pos.copy()
        else:
            num_tokens = np.array(n_tok + [1] * n_dec, dtype=np.int64)
            start_pos = np.concatenate([np.array(starts, dtype=np.int64),
                                        self.computed[rows_a[len(n_tok):]] + dec_offset if nd
                                        else np.zeros(0, np.int64)])
            sample_a = np.array(sample + (dec_sample if nd else []), dtype=bool)
            token_ids = np.concatenate([prefill_tokens, dec_tokens]) if nd else prefill_tokens
            positions = np.repeat(start_pos - np.cumsum(num_tokens) + num_tokens, num_tokens) \
                + np.arange(len(token_ids))
        table_len = self.table_len[rows_a]
        ctx = start_pos + num_tokens
        if (ctx > table_len * self.block_size).any():
            i = int(np.argmax(ctx > table_len * self.block_size))
            raise StepError(f"sequence {seq_ids[i]}: {start_pos[i]}+{num_tokens[i]} tokens exceed "
                            f"its {table_len[i]} blocks")
        if (ctx > self.max_model_len).any():
            i = int(np.argmax(ctx > self.max_model_len))
            raise StepError(f"sequence {seq_ids[i]}: position {ctx[i]} past max_model_len")
        width = max(int(table_len.max()), 1)
        tables = self.tables[rows_a, :width]
        if (tables >= self.num_blocks).any() or (tables < 0).any():
            raise StepError("block id out of range of the KV cache")
        token_row = np.repeat(np.arange(len(rows_a)), num_tokens)
        slots = self._slots(tables, token_row, positions)
        fill = self._placeholders(token_ids, num_tokens, seq_ids)
        real = (token_ids if fill is None else token_ids[:0] if len(fill[0]) == len(token_ids)
                else np.delete(token_ids, fill[0]))
        if len(real) and (real.min() < 0 or real.max() >= self.vocab_size):
            raise StepError(f"token id out of range [0, {self.vocab_size})")
        pool_a, pooling = None, []
        if any(pool):
            pool_a = np.zeros(len(rows_a), bool)
            pool_a[:len(pool)] = pool
            pooling = [self.pooling[r] for r in rows_a[pool_a].tolist()]
        if self.tasks and "generate" not in self.tasks and sample_a.any():
            raise StepError(f"this worker serves {','.join(sorted(self.tasks))} (--task): "
                            "it does not generate")
        sample_rows = rows_a[sample_a].tolist()
        return StepPlan(step_id=req.step_id, seq_ids=seq_ids, rows=rows_a, num_tokens=num_tokens,
                        start_pos=start_pos, token_ids=token_ids, positions=positions,
                        slot_mapping=slots, block_tables=tables, sample=sample_a, fill=fill,
                        sampling=[self.params[r] for r in sample_rows], drafts=drafts,
                        pool=pool_a, pooling=pooling)

    def _pooling(self, w: worker_pb2.SeqWork) -> PoolingParams | None:
        """A (re)sent sequence's pooling, checked against what this worker serves."""
        p = PoolingParams.from_proto(w.pooling, self.vocab_size, self.hidden_size)
        if p is not None and self.tasks and TASK_KINDS[p.kind] not in self.tasks:
            raise StepError(f"sequence {w.seq_id}: this worker serves "
                            f"{','.join(sorted(self.tasks))} (--task), not {TASK_KINDS[p.kind]}")
        return p

    def _drafts(self, d: worker_pb2.DecodeBatch, nd: int, dec_ids: np.ndarray, dec_rows: list[int],
                per: np.ndarray | None, n_samp: np.ndarray | None, prefill_samples: int,
                dec_tokens: np.ndarray, prefill_tokens: int) -> DraftPlan | None:
        """The decode sequences that asked for drafts (positions before this step's commit)."""
        if not d.num_drafts_i32:
            return None
        k = np.frombuffer(d.num_drafts_i32, "<i4").astype(np.int64)
        if len(k) != nd or (k < 0).any() or (k > MAX_DRAFTS).any():
            raise StepError(f"decode num_drafts must hold one count in [0, {MAX_DRAFTS}] for "
                            f"each of {nd} sequences")
        sel = np.flatnonzero(k)
        if not len(sel):
            return None
        ones = np.ones(nd, np.int64)
        per = ones if per is None else per
        ns = ones if n_samp is None else n_samp
        rows = np.asarray(dec_rows, np.int64)
        first = np.cumsum(ns) - ns + prefill_samples
        pos = self.computed[rows] + per - ns
        ends = np.cumsum(per)   # (the verify rows' inputs are the proposals)
        return DraftPlan(k=k[sel], seq_ids=[int(i) for i in dec_ids[sel]], rows=rows[sel],
                         first_sample=first[sel], num_samples=ns[sel],
                         first_token=(prefill_tokens + ends - ns)[sel],
                         position=pos[sel],
                         proposals=[dec_tokens[ends[i] - ns[i] + 1:ends[i]].tolist()
                                    for i in sel.tolist()])

    def _slots(self, tables: np.ndarray, token_row: np.ndarray, positions: np.ndarray
               ) -> np.ndarray:
        """Each token's KV slot: its row's block at its position, and the offset in it."""
        bs = self.block_size
        return (tables[token_row, positions // bs].astype(np.int64) * bs
                + positions % bs).astype(np.int32)

    def decode_plan(self, rows: np.ndarray, positions: np.ndarray, sample: bool = False
                    ) -> StepPlan:
        """A plan of one token a row at `positions` of these rows, no ids: a drafter's own
        decode passes (worker_service/drafter.py); sample: every row's logits are wanted."""
        plan = self.chunk_plan(rows, positions, np.ones(len(rows), np.int64))
        plan.sample[:] = sample
        return plan

    def chunk_plan(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> StepPlan:
        """A plan of counts[i] tokens of rows[i] at positions starts[i] on (what comes before
        them in the cache), nothing sampled, no ids (a drafter's passes and catch-ups)."""
        n = len(rows)
        width = max(int(self.table_len[rows].max()), 1)
        tables = self.tables[rows, :width]
        starts, counts = starts.astype(np.int64), counts.astype(np.int64)
        token_row = np.repeat(np.arange(n), counts)
        first = np.cumsum(counts) - counts
        positions = np.arange(int(counts.sum()), dtype=np.int64) - first[token_row] + starts[token_row]
        return StepPlan(step_id=0, seq_ids=list(range(n)), rows=rows, num_tokens=counts,
                        start_pos=starts, token_ids=np.zeros(len(positions), np.int64),
                        positions=positions, slot_mapping=self._slots(tables, token_row, positions),
                        block_tables=tables, sample=np.zeros(n, bool), fill=None)

    def _placeholders(self, token_ids: np.ndarray, num_tokens: np.ndarray, seq_ids: list[int]
                      ) -> tuple[np.ndarray, np.ndarray] | None:
        where = np.flatnonzero(token_ids == PLACEHOLDER)
        if not len(where):
            return None
        if len(where) == len(num_tokens) == len(token_ids):   # every row one token, a placeholder
            owner = where
        else:
            ends = np.cumsum(num_tokens) - 1
            owner = np.searchsorted(ends, where)
            if (ends[owner] != where).any():
                bad = seq_ids[int(owner[np.argmax(ends[owner] != where)])]
                raise StepError(f"sequence {bad}: a placeholder input (-1) must be its last token")
        try:
            prev = [self.last_rows[seq_ids[i]] for i in owner.tolist()]
        except KeyError as e:
            raise StepError(f"sequence {e.args[0]}: a placeholder input (-1) must follow a step "
                            "that sampled for it") from None
        return where, np.array(prev, dtype=np.int64)

    def commit(self, plan: StepPlan) -> None:
        """The step is launched: its tokens are in the KV cache and its samples are the
        ones later placeholders refer to."""
        rows, ctx = plan.rows, plan.context_lens
        if len(rows) > 1 and (rows[1:] == rows[:-1]).any():   # fast-forward rows: the last counts
            keep = np.r_[rows[1:] != rows[:-1], True]
            rows, ctx = rows[keep], ctx[keep]
        self.computed[rows] = ctx
        sampled = [s for s, keep in zip(plan.seq_ids, plan.sample.tolist()) if keep]
        if sampled:
            self.last_rows = {s: i for i, s in enumerate(sampled)}
            if len(self.last_rows) < len(sampled):
                # A verify step's sequences: which of their samples comes next is the
                # scheduler's to say, so no placeholder may refer to them.
                for seq_id, n in Counter(sampled).items():
                    if n > 1:
                        del self.last_rows[seq_id]
