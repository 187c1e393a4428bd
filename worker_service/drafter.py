"""The draft model: a small model sharing the target's tokenizer proposes the tokens the
next verify step checks (speculative decoding's `draft` proposer; DESIGN.md, one
multi-token mechanism: the proposals travel as any other, in the scheduler's next step).

It is a proposer (proposer.py). It lives beside the target on every rank, with a paged KV
cache of its own of the same block count and block size, addressed by the same block
tables and slots. Whatever the target computes the draft computes too (the step pipeline
hands it each committed step: the mirror), so its cache holds every sequence's tokens with little bookkeeping of its
own: prefix-cache hits, preemption, rewinds and restarts need nothing more. The one
shortcut: a verify step's rows that are the drafts of the step before, at the positions
they were drafted at, already have their draft KV (the draft passes wrote it), so the
mirror skips them (`skip_rows`), and the last draft's, written by no pass, is computed in
the next first pass when it was accepted. At batch 1 that saves one draft forward a step.
(Blocks restored from the host tier are the exception: only the target's bytes travel, so
the draft reads stale KV there and proposes worse until those positions are recomputed;
never wrong output.)

The mirror costs a draft forward a step, which pays only while drafts are asked for: the
scheduler proposes nothing in batches over its --speculative max batch (32), where a
mirror cost the 0.6B-for-0.6B launcher 44% of its throughput. So a step of more than
MIRROR_ROWS rows that asks for no drafts is recorded instead (its input ids stay on the
device in a ring, their sequences and positions on the host), and when a sequence is next
mirrored or drafts, its recorded positions are run first, as one chunked prefill of the
draft (`_catch_up`). Sequences that finish under load never cost the draft anything. A
sequence whose records the ring overwrote keeps stale draft KV there: worse drafts, never
wrong output.

After a step whose sequences asked for drafts, `propose` settles each one's proposals by
the scheduler's rule (accepted while equal to the sample before them), then runs k greedy
decode steps of the draft from its newest token, writing the draft's KV at the positions
after it (the scheduler reserved blocks for them). A greedy draft is a point mass, so the
verify rule keeps every output exact, sampled requests included, and a seeded request
draws the tokens it draws without speculation. With `--draft-sampling sampled` a sampled
request's drafts are drawn from the draft's own distribution q (temperature, top-k, top-p,
min-p as the request's), q is kept on the sampling rank, and the next step settles those
rows by the rejection rule (sampler.check_drafts): more drafts accepted where the target
is not near-deterministic, the same distribution, other draws. A constrained request
drafts greedily: its format cuts proposals by their value, which the rule's q cannot
see. The settling needs the step's samples on the host: one sync per drafting step, where
the scheduler waits for the answer anyway.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import replace

import numpy as np
import torch

from models.loader import load_config, load_model
from models.parallel import TPGroup
from models.qwen3 import kv_cache_layers
from nanoserve.proposals import accepted_prefix
from worker_service.cuda_graphs import DecodeGraphs
from worker_service.executors import Eager, Executor, Forward, StepInputs, input_ids, run
from worker_service.kv_binding import KVFormat, bind_kv, unbind_kv
from worker_service.phases import phase
from worker_service.sampler import DraftCheck, SamplingBatch, _mix, distribution
from worker_service.step_plan import DraftPlan, SeqTable, StepPlan
from worker_service.transfers import to_device, to_host

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")
SAMPLING = ("greedy", "sampled")   # --draft-sampling
# Steps of more rows that ask for no drafts are recorded, not mirrored (module docstring)
MIRROR_ROWS = int(os.environ.get("NANOSERVE_DRAFT_MIRROR_ROWS", "32"))
RECORD_TOKENS = 1 << 19   # the ring of recorded input ids (4 MiB of device memory)
CATCH_UP_TOKENS = 4096    # most tokens one catch-up forward takes


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def check_draft(draft_dir: str, target_dir: str, target_vocab: int) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    hf = load_config(draft_dir)
    if hf.vocab_size != target_vocab:
        raise ValueError(f"--draft-model {draft_dir}: a vocabulary of {hf.vocab_size} tokens, "
                         f"the target's has {target_vocab}: a draft must share the target's "
                         "tokenizer")
    for name in TOKENIZER_FILES:
        a, b = os.path.join(draft_dir, name), os.path.join(target_dir, name)
        if os.path.exists(a) and os.path.exists(b) and _digest(a) != _digest(b):
            raise ValueError(f"--draft-model {draft_dir}: its {name} differs from the "
                             "target's: a draft must share the target's tokenizer")


class Drafter:
    """The draft model of one rank (sharded like the target) and its KV cache."""

    def __init__(self, model_dir: str, target_dir: str, target_vocab: int, tp: TPGroup,
                 dtype: torch.dtype | None, device: torch.device, backend, quantization: str,
                 sampling: str = "greedy"):
        check_draft(model_dir, target_dir, target_vocab)
        if sampling not in SAMPLING:
            raise ValueError(f"draft sampling {sampling!r}: one of {', '.join(SAMPLING)}")
        self.model_dir = model_dir
        self.name = os.path.basename(os.path.normpath(model_dir))   # its checkpoint's
        self.device = device
        self.sampled = sampling == "sampled"
        self.rank = tp.rank
        self.model, self.hf_config = load_model(model_dir, tp=tp, dtype=dtype, device=device,
                                                attn_backend=backend, quantization=quantization)
        self.layers = kv_cache_layers(self.model)
        self.feature_layers: tuple[int, ...] = ()
        self.backend = backend
        self.executors: list[Executor] = [Eager(self.model, device)]
        # The last step's drafts: (copy-done event, host [D, w] ids, seq ids, position of
        # each one's first draft's input, drafts made); and, for the step being launched,
        # the sequences whose mirror was skipped -> the positions below which their KV is in
        self.last: tuple | None = None
        self.valid_end: dict[int, int] = {}
        self.skip: np.ndarray | None = None   # match's rows for the mirror to skip
        self.q: tuple | None = None   # sampling rank: ([D, w, V] q of the last drafts, [D]
                                      # which sequences' drafts were sampled)
        # Recorded steps: input ids (device ring, allocated at the first record), and each
        # entry's sequence, position and write count; a sequence behind -> (its first
        # recorded position, the write count then)
        self.rec_ids: torch.Tensor | None = None
        self.rec_seq = np.full(RECORD_TOKENS, -1, np.int64)
        self.rec_pos = np.zeros(RECORD_TOKENS, np.int64)
        self.rec_stamp = np.full(RECORD_TOKENS, -1, np.int64)
        self.written = 0
        self.behind: dict[int, tuple[int, int]] = {}
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None

    def bind_kv(self, num_blocks: int, block_size: int, fmt: KVFormat) -> None:
        self.kv_cache, self.kv_scales = bind_kv(self.layers, num_blocks, block_size, fmt,
                                                self.device)

    def free_kv(self) -> None:
        """The KV cache is freed: the last drafts, their q, every record and the graphs go
        with it."""
        self.kv_cache = self.kv_scales = None
        self.executors = [Eager(self.model, self.device)]
        self.last = self.q = None
        self.behind.clear()
        unbind_kv(self.layers)

    def capture(self, max_batch: int, max_model_len: int, block_size: int,
                phases: dict[str, float]) -> None:
        graphs = DecodeGraphs(self.model, self.backend, max_batch, max_model_len, block_size,
                              self.layers[0].num_kv_heads, self.device)
        with phase(phases, f"{len(graphs.buckets)} draft decode graphs"):
            graphs.capture()
        self.executors = [graphs, Eager(self.model, self.device)]

    def before_forward(self, plan: StepPlan, dropped: list[int]) -> DraftCheck | None:
        self.forget(dropped)
        return self.match(plan)

    def mirror(self, step: StepInputs, table: SeqTable, forward: Forward,
               samples: torch.Tensor | None) -> None:
        """Run the step's rows through the draft model (its KV), but those `match` marked;
        record a big step that asks for no drafts instead."""
        skip, self.skip = self.skip, None
        plan = step.plan
        if plan.drafts is None and len(plan.rows) > MIRROR_ROWS:
            self._record(step)
            return
        if self.behind:
            self._catch_up(table, plan)
        rest = replace(step, logits=False) if skip is None else step.subset(~skip, sampled=False)
        if rest is not None:
            run(self.executors, rest)

    def forget(self, seq_ids) -> None:
        """Sequences dropped or sent afresh: their records no longer apply."""
        for s in seq_ids:
            self.behind.pop(s, None)

    def _record(self, step: StepInputs) -> None:
        """Keep the step's input ids (placeholders filled from the last samples, on the
        device) with their sequences and positions, in place of its mirror."""
        plan = step.plan
        n = len(plan.token_ids)
        if n > RECORD_TOKENS:
            return   # (its sequences' catch-ups find the gap)
        dev = self.device
        if self.rec_ids is None:
            self.rec_ids = torch.zeros(RECORD_TOKENS, dtype=torch.int64, device=dev)
        at = self.written % RECORD_TOKENS
        if at + n > RECORD_TOKENS:   # wrap around (the tail keeps its older entries)
            self.written += RECORD_TOKENS - at
            at = 0
        self.rec_ids[at:at + n] = input_ids(step, dev)
        self.rec_seq[at:at + n] = np.repeat(np.asarray(plan.seq_ids, np.int64), plan.num_tokens)
        self.rec_pos[at:at + n] = plan.positions
        self.rec_stamp[at:at + n] = np.arange(self.written, self.written + n)
        for s, p in zip(plan.seq_ids, plan.start_pos.tolist()):
            self.behind.setdefault(s, (p, self.written))
        self.written += n

    @torch.inference_mode()
    def _catch_up(self, table: SeqTable, plan) -> None:
        """Run the recorded positions of the step's sequences that are behind through the
        draft (chunked prefills over their earlier KV), before the step's rows are."""
        first: dict[int, int] = {}
        for s, p in zip(plan.seq_ids, plan.start_pos.tolist()):
            first.setdefault(s, p)
        todo = []   # (row, first position, entries)
        for s, end in first.items():
            got = self.behind.pop(s, None)
            if got is None:
                continue
            p0, stamp0 = got
            at = np.flatnonzero((self.rec_seq == s) & (self.rec_stamp >= stamp0))
            at = at[np.lexsort((self.rec_stamp[at], self.rec_pos[at]))]
            pos = self.rec_pos[at]
            newest = np.append(pos[1:] != pos[:-1], True)   # a position computed again: its last
            at, pos = at[newest], pos[newest]
            at, pos = at[pos < end], pos[pos < end]
            if not len(at) or pos[0] != p0 or pos[-1] != end - 1 or len(pos) != end - p0:
                continue   # overwritten: stale draft KV there (worse drafts, never wrong output)
            c = CATCH_UP_TOKENS   # a long stretch in pieces, one a forward, in order
            todo.append([(table.row_of[s], p0 + i, at[i:i + c]) for i in range(0, len(at), c)])
        for r in range(max(map(len, todo), default=0)):   # round r: each one's piece r
            pieces = [p[r] for p in todo if len(p) > r]
            while pieces:
                batch, n = [], 0
                while pieces and (not batch or n + len(pieces[-1][2]) <= CATCH_UP_TOKENS):
                    batch.append(pieces.pop())
                    n += len(batch[-1][2])
                self._prefill(table, batch)

    def _prefill(self, table: SeqTable, pieces: list) -> None:
        """One forward of the draft over recorded entries: (row, first position, entries)
        a piece, its KV written at those positions over what precedes them."""
        rows, starts, entries = zip(*pieces)
        chunk = table.chunk_plan(np.array(rows), np.array(starts),
                                 np.array([len(e) for e in entries]))
        ids = self.rec_ids.index_select(0, to_device(np.concatenate(entries), self.device))
        run(self.executors, StepInputs(chunk, ids=ids, logits=False))

    def match(self, plan) -> DraftCheck | None:
        """Find the last step's drafts among `plan`'s rows, before its forward: the rows the
        mirror may skip (self.skip: decode rows of a sequence that drafted in the last step,
        at the positions its drafts' inputs had, holding those inputs: the drafts' KV is
        in) and, on the sampling rank, the sampling rows that settle sampled drafts (the row
        before each such input), with their q."""
        last, self.last = self.last, None
        q, self.q = self.q, None
        self.valid_end = {}
        self.skip = None
        if last is None:
            return None
        event, host, seq_ids, start, k = last
        if event is not None:
            event.synchronize()   # (done: the scheduler read these drafts for this step)
        drafts = host.numpy()
        where = {s: i for i, s in enumerate(seq_ids)}
        skip = np.zeros(len(plan.rows), bool)
        tok = np.cumsum(plan.num_tokens) - 1
        rows_of: dict[int, list[int]] = {}   # seq -> its one-token sampling rows, in order
        for r, seq_id in enumerate(plan.seq_ids):   # (a verify step's rows all sample; a
            if seq_id in where and plan.num_tokens[r] == 1 and plan.sample[r]:   # format's
                rows_of.setdefault(seq_id, []).append(r)                        # forced: not)
        matched: dict[int, int] = {}   # seq -> its rows that hold its drafts' inputs
        checks: list[tuple[int, int, int]] = []   # (row, draft's sequence, draft index)
        for seq_id, rs in rows_of.items():
            i = where[seq_id]
            pos = plan.positions[tok[rs]] - int(start[i])
            m = 0   # rows at the drafts' positions, in order: the newest token, then drafts
            while m < len(rs) and pos[m] == m and m <= k[i]:
                m += 1
            if not m:
                continue
            n = 1 + accepted_prefix(plan.token_ids[tok[rs[1:m]]].tolist(), drafts[i].tolist())
            if q is not None and q[1][i]:
                checks += [(rs[j - 1], i, j - 1) for j in range(1, n)]
            matched[seq_id] = n
            skip[rs[:n]] = True
        # positions start..start+k-1 were written by the passes (the last draft's by none)
        self.valid_end = {s: int(start[where[s]]) + min(n, int(k[where[s]]))
                          for s, n in matched.items()}
        self.skip = skip if skip.any() else None
        if not checks:
            return None
        r, i, j = (np.array(x, np.int64) for x in zip(*checks))
        sample_index = np.cumsum(plan.sample) - 1
        dev = self.device
        return DraftCheck(rows=to_device(sample_index[r], dev),
                          drafts=to_device(drafts[i, j].astype(np.int64), dev),
                          q=q[0][to_device(i, dev), to_device(j, dev)])

    def _decode(self, ids: torch.Tensor, positions: np.ndarray, table: SeqTable,
                rows: np.ndarray) -> torch.Tensor:
        """One decode step of the draft, a token a row (a sequence's rows consecutive, at
        consecutive positions) -> logits [n, vocab]."""
        plan = table.decode_plan(rows, positions, sample=True)
        return run(self.executors, StepInputs(plan, ids=ids)).out

    def _sampled(self, drafts: DraftPlan, table: SeqTable) -> np.ndarray:
        """[D] which sequences draw their drafts from q (the rest: greedy)."""
        if not self.sampled:
            return np.zeros(len(drafts.k), bool)
        return np.array([p.temperature > 0 and not p.constrained
                         for p in (table.params[r] for r in drafts.rows.tolist())], bool)

    def _pick(self, logits: torch.Tensor, live: np.ndarray, j: int, start: np.ndarray,
              drafts: DraftPlan, table: SeqTable, sampled: np.ndarray, step_id: int,
              q_out: torch.Tensor | None) -> torch.Tensor:
        """Pass j's drafts of the `live` sequences: greedy, or drawn from q where sampled
        (q kept in q_out on the sampling rank). Every rank draws the same: the noise is
        keyed by (step, pass), a seeded request's by (seed, the draft's position)."""
        nxt = logits.argmax(-1)
        at = np.flatnonzero(sampled[live])
        if not len(at):
            return nxt
        dev = self.device
        idx = to_device(at, dev)
        params = [table.params[r] for r in drafts.rows[live[at]].tolist()]
        b = SamplingBatch.build(params, (start[live[at]] + j + 1).tolist(),   # (the drafts'
                                logits.shape[1], dev)                          # positions)
        q = distribution(logits.index_select(0, idx), b.temperature,
                         b.top_k if b.need_top_k_or_p else None, b.top_p,
                         b.min_p if b.need_min_p else None)
        q = q / q.sum(-1, keepdim=True)
        gen = torch.Generator(device=dev).manual_seed(_mix(step_id, j + 1))
        noise = torch.empty_like(q).exponential_(generator=gen)
        for a, seed in b.seeded_rows:   # (seed, position) -> a stream of the drafts' own
            g = torch.Generator(device=dev).manual_seed(_mix(seed, 2))
            noise[a] = torch.empty(q.shape[1], device=dev).exponential_(generator=g)
        if q_out is not None:
            q_out[to_device(live[at], dev), j] = q
        return nxt.index_copy(0, idx, (q / noise).argmax(-1))

    @torch.inference_mode()
    def propose(self, drafts: DraftPlan, samples: torch.Tensor, table: SeqTable,
                step_id: int = 0) -> torch.Tensor:
        """The step's drafting sequences' next proposals: [D, max k] int32 in host memory
        (pinned on CUDA, its copy in flight), -1 past where a sequence's blocks or
        max_model_len stop it. `samples` are the step's
        sampled ids on this rank (every rank has them: the runner broadcasts them), `table`
        its SeqTable before the step's commit (positions are the drafts' own), `step_id`
        keys the noise of sampled drafts."""
        newest, start, k = drafts.settle(samples.cpu().numpy(), table)   # (the sync)
        n, width = len(k), int(drafts.k.max())
        dev = self.device
        out = torch.full((n, width), -1, dtype=torch.int64, device=dev)
        sampled = self._sampled(drafts, table)
        q_out = None
        if sampled.any() and self.rank == 0:
            q_out = torch.zeros((n, width, self.hf_config.vocab_size), dtype=torch.float32,
                                device=dev)
        cur = samples.index_select(0, to_device(newest, dev))
        for j in range(int(k.max())):
            live = np.flatnonzero(k > j)
            idx = to_device(live, dev) if len(live) < n else None
            ids = cur if idx is None else cur.index_select(0, idx)
            rows, pos = drafts.rows[live], start[live] + j
            behind = [i for i in live.tolist()   # the token before the newest lacks draft KV
                      if j == 0 and self.valid_end.get(drafts.seq_ids[i], start[i]) < start[i]
                      and start[i] - drafts.position[i] >= 2]   # (it is a proposal)
            if behind:   # its own row, just before the newest one's
                lead = np.isin(live, behind)
                prev = [drafts.proposals[i][start[i] - drafts.position[i] - 2] for i in behind]
                both = torch.cat([ids, to_device(np.array(prev, np.int64), dev)])
                order = np.arange(len(live)) + np.cumsum(lead)   # each newest row's place
                at = np.empty(len(live) + len(behind), np.int64)
                at[order] = np.arange(len(live))
                at[order[lead] - 1] = len(live) + np.arange(len(behind))
                ids = both.index_select(0, to_device(at, dev))
                rows = np.repeat(rows, 1 + lead)
                pos = np.repeat(pos, 1 + lead) - np.concatenate(
                    [[1, 0] if x else [0] for x in lead])
                logits = self._decode(ids, pos, table, rows).index_select(
                    0, to_device(order, dev))
            else:
                logits = self._decode(ids, pos, table, rows)
            nxt = self._pick(logits, live, j, start, drafts, table, sampled, step_id, q_out)
            if idx is None:
                cur = nxt
                out[:, j] = nxt
            else:
                cur = cur.index_copy(0, idx, nxt)
                out[:, j].index_copy_(0, idx, nxt)
        host = to_host(out.to(torch.int32))
        event = None
        if dev.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.last = (event, host, drafts.seq_ids, start, k)
        self.q = (q_out, sampled) if q_out is not None else None
        return host
