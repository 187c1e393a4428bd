"""Repetition, presence and frequency penalties, with each sequence's token history kept
on the device.

Why on the device: with overlap scheduling a sequence's next step is launched before its
sampled id reaches the host (the step's input is a placeholder), so the worker counts
the ids it samples from the sampled-id tensor itself, in stream order, with no sync.
Per penalized sequence it keeps a prompt mask [V] (ids of the prompt: repetition) and
output counts [V] (ids generated so far: all three penalties). The scheduler sends the
whole history once, when the sequence is (re)sent in full (worker.proto SeqWork
prompt_ids_i32 / output_ids_i32); a prefill step alone would miss the prefix-cached part.

Only sequences that set a penalty get a slot: a step with none of them costs nothing.
The arithmetic is kernels/penalties.py: one Triton pass on a GPU, its torch reference
elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.penalties import apply_penalties_ref
from nanoserve.v1 import worker_pb2
from worker_service.step_plan import SamplingParams, StepError, verify_drafts


@dataclass
class PenaltyRows:
    """The penalized rows of one step's sampling batch."""
    rows: torch.Tensor        # [P] int64 rows of the logits
    slots: torch.Tensor       # [P] int64 their slots in PenaltyState (past them: scratch rows)
    repetition: torch.Tensor  # [P] float32
    presence: torch.Tensor
    frequency: torch.Tensor
    # Verify steps (speculative decoding): a row after proposed tokens counts them as output.
    # scratch: [S, V] counts of those rows (their slots point past the real ones), own: [P]
    # each row's real slot, and for the rows after proposals (Q of them): their index among
    # the P, the sampling row before them, the token proposed there, and [P] the index of
    # each row's first row: a row's sample is counted only if every proposal before it was.
    scratch: torch.Tensor | None = None
    scratch_mask: torch.Tensor | None = None
    own: torch.Tensor | None = None
    after: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    first: torch.Tensor | None = None


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, fused: bool | None = None):
        self.vocab_size = vocab_size
        self.device = device
        # The Triton kernel (default on CUDA) or the torch reference.
        self.fused = torch.device(device).type == "cuda" if fused is None else fused
        self.slot_of: dict[int, int] = {}   # seq_id -> slot
        self.free: list[int] = []
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.drafts: dict[int, list[int]] = {}   # this step's verify rows: seq_id -> proposals
        if self.fused:
            self._compile()

    def _compile(self) -> None:
        """Run the kernel once on one blank row, with the argument shapes of a real step, so
        Triton compiles it at startup: compiled at the first penalized request instead, the
        whole step (every stream in it) would wait for the compiler."""
        from kernels.penalties import apply_penalties_
        dev, v = self.device, self.vocab_size
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        apply_penalties_(torch.zeros(1, v, device=dev), zero, zero,
                         torch.zeros(1, v, dtype=torch.bool, device=dev),
                         torch.zeros(1, v, dtype=torch.int32, device=dev),
                         torch.ones(1, device=dev), torch.zeros(1, device=dev),
                         torch.zeros(1, device=dev))

    def __bool__(self) -> bool:
        return bool(self.slot_of)

    def update(self, req: worker_pb2.StepRequest) -> None:
        """Follow the step's drops and (re)sent sequences (after SeqTable.plan checked it)."""
        if self.slot_of:
            for seq_id in req.drop_seq_ids:
                self.drop(seq_id)
        for w in req.seqs:
            if not w.reset_block_table:
                continue
            self.drop(w.seq_id)
            if SamplingParams.from_proto(w.sampling, self.vocab_size).has_penalty:
                self.add(w.seq_id, np.frombuffer(w.prompt_ids_i32, "<i4"),
                         np.frombuffer(w.output_ids_i32, "<i4"))
        self.drafts = verify_drafts(req.decode) if self.slot_of else {}

    def drop(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)

    def add(self, seq_id: int, prompt: np.ndarray, output: np.ndarray) -> None:
        for ids in (prompt, output):
            if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise StepError(f"sequence {seq_id}: history token id out of range "
                                f"[0, {self.vocab_size})")
        if not len(prompt):
            raise StepError(f"sequence {seq_id}: a penalty needs its prompt_ids_i32")
        if not self.free:
            n = len(self.counts)
            grow = max(n, 8)
            self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros(
                grow, self.vocab_size, dtype=torch.bool, device=self.device)])
            self.counts = torch.cat([self.counts, torch.zeros(
                grow, self.vocab_size, dtype=torch.int32, device=self.device)])
            self.free = list(range(n + grow - 1, n - 1, -1))
        slot = self.slot_of[seq_id] = self.free.pop()
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, torch.from_numpy(prompt.astype(np.int64)).to(self.device)] = True
        self.counts[slot] = 0
        if len(output):
            out = torch.from_numpy(output.astype(np.int64)).to(self.device)
            self.counts[slot].index_put_((out,), torch.ones_like(out, dtype=torch.int32),
                                         accumulate=True)

    def rows(self, seq_ids: list[int], params: list[SamplingParams]) -> PenaltyRows | None:
        """The penalized rows among one step's sampling rows (seq_ids / params per row)."""
        rows = [i for i, s in enumerate(seq_ids) if s in self.slot_of]
        if not rows:
            return None
        dev = self.device

        def f32(values):
            return torch.tensor(values, dtype=torch.float32).to(dev, non_blocking=True)

        def i64(values):
            return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)

        own = [self.slot_of[seq_ids[i]] for i in rows]
        pr = PenaltyRows(
            rows=i64(rows), slots=i64(own),
            repetition=f32([params[i].repetition_penalty for i in rows]),
            presence=f32([params[i].presence_penalty for i in rows]),
            frequency=f32([params[i].frequency_penalty for i in rows]))
        if self.drafts:
            self._verify_rows(pr, rows, own, seq_ids)
        return pr

    def _verify_rows(self, pr: PenaltyRows, rows: list[int], own: list[int],
                     seq_ids: list[int]) -> None:
        """Scratch counts for rows after proposed tokens (a verify group's rows are
        consecutive: its first samples after the last known token, row i after proposal i)."""
        slots, first, scratch_of, drafts_in = list(own), [], [], []
        after_pos, after_prev, after_tok = [], [], []
        for j, (i, seq_id) in enumerate(zip(rows, (seq_ids[i] for i in rows))):
            k = j - first[j - 1] if j and seq_id in self.drafts and \
                seq_ids[rows[j - 1]] == seq_id and rows[j - 1] == i - 1 else 0
            first.append(j - k)
            if k:
                drafts = self.drafts[seq_id]
                slots[j] = len(self.counts) + len(scratch_of)
                scratch_of.append(own[j])
                drafts_in.append(drafts[:k])
                after_pos.append(j)
                after_prev.append(i - 1)
                after_tok.append(drafts[k - 1])
        if not scratch_of:
            return
        dev = self.device
        src = torch.tensor(scratch_of, dtype=torch.int64, device=dev)
        scratch = self.counts.index_select(0, src)
        r = torch.tensor([q for q, d in enumerate(drafts_in) for _ in d], dtype=torch.int64, device=dev)
        t = torch.tensor([x for d in drafts_in for x in d], dtype=torch.int64, device=dev)
        scratch.index_put_((r, t), torch.ones_like(r, dtype=torch.int32), accumulate=True)
        pr.scratch, pr.scratch_mask = scratch, self.prompt_mask.index_select(0, src)
        pr.own, pr.slots = pr.slots, torch.tensor(slots, dtype=torch.int64, device=dev)
        pr.after = tuple(torch.tensor(v, dtype=torch.int64, device=dev)
                         for v in (after_pos, after_prev, after_tok))
        pr.first = torch.tensor(first, dtype=torch.int64, device=dev)

    def apply(self, logits: torch.Tensor, pr: PenaltyRows) -> torch.Tensor:
        """A float32 copy of logits with the penalized rows penalized."""
        out = logits.to(torch.float32, copy=True)
        mask, counts = self.prompt_mask, self.counts
        if pr.scratch is not None:
            mask, counts = torch.cat([mask, pr.scratch_mask]), torch.cat([counts, pr.scratch])
        if self.fused:
            from kernels.penalties import apply_penalties_
            return apply_penalties_(out, pr.rows, pr.slots, mask, counts,
                                    pr.repetition, pr.presence, pr.frequency)
        sub = apply_penalties_ref(out.index_select(0, pr.rows), mask.index_select(0, pr.slots),
                                  counts.index_select(0, pr.slots), pr.repetition,
                                  pr.presence, pr.frequency)
        return out.index_copy_(0, pr.rows, sub)

    def record(self, pr: PenaltyRows, tokens: torch.Tensor) -> None:
        """Count the ids just sampled (on the device, in stream order); in a verify group
        only the run the scheduler accepts (Scheduler.resolve's rule: each proposal equal
        to the sample before it, then one sample more)."""
        count = torch.ones(len(pr.rows), dtype=torch.int32, device=self.device)
        slots = pr.slots
        if pr.after is not None:
            pos, prev, tok = pr.after
            miss = torch.zeros(len(pr.rows), dtype=torch.int64, device=self.device)
            miss[pos] = (tokens.index_select(0, prev) != tok).to(torch.int64)
            seen = miss.cumsum(0)
            count = (seen == seen.index_select(0, pr.first)).to(torch.int32)
            slots = pr.own
        self.counts.index_put_((slots, tokens.index_select(0, pr.rows)), count, accumulate=True)
