"""The fused all-reduce + residual + RMSNorm kernel against its torch reference.

One process plays every rank: each "rank" has an ordinary buffer laid out as the symmetric
one (slots, flags), and the peers' part of the protocol (their rows in their slot, their
flag raised in every buffer) is done by `arrive` before the real kernel runs, so the real
kernel's wait is already satisfied. Real peer memory, two GPUs: tests/gpu/bench_all_reduce.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.all_reduce_norm import FLAGS_BYTES, all_reduce_norm, all_reduce_norm_ref
from kernels.rmsnorm import rms_norm_ref

from triton_device import DEVICE, INTERPRET, needs_triton

pytestmark = needs_triton

SLOT_OFFSET = 256        # where torch's own all-reduce region would end
EXACT = dict(atol=0, rtol=0)
BF16_TWO_ROUNDINGS = dict(atol=2 * 2.0 ** -4, rtol=0)   # 2 ulps of values in [8, 16)


@dataclass
class World:
    """Every rank's buffer and call counters, one process."""
    buffers: list[torch.Tensor]
    bases: torch.Tensor
    counts: list[torch.Tensor]
    slot_bytes: int

    @property
    def flags_offset(self) -> int:
        return SLOT_OFFSET + 2 * self.slot_bytes

    def flags(self, owner: int) -> torch.Tensor:
        """owner's flags [G, world]: (program, rank that raised it)."""
        g, world = self.counts[0].numel(), len(self.buffers)
        raw = self.buffers[owner][self.flags_offset:self.flags_offset + g * world * 4]
        return raw.view(torch.int32).view(g, world)

    def slot(self, owner: int, call: int, like: torch.Tensor) -> torch.Tensor:
        start = SLOT_OFFSET + (call & 1) * self.slot_bytes
        nbytes = like.numel() * like.element_size()
        return self.buffers[owner][start:start + nbytes].view(like.dtype).view(like.shape)

    def arrive(self, peer: int, partial: torch.Tensor, call: int) -> None:
        """What peer's kernel does before this rank's reads: its rows, then its flags."""
        self.slot(peer, call, partial).copy_(partial)
        for owner in range(len(self.buffers)):
            self.flags(owner)[:, peer] += 1

    def run(self, rank: int, partial, residual, weight, eps=1e-6):
        return all_reduce_norm(partial, residual, weight, eps, self.bases, rank,
                               self.counts[rank], SLOT_OFFSET, self.slot_bytes,
                               self.flags_offset)


def make_world(world: int, programs: int, slot_bytes: int) -> World:
    size = SLOT_OFFSET + 2 * slot_bytes + FLAGS_BYTES
    buffers = [torch.zeros(size, dtype=torch.uint8, device=DEVICE) for _ in range(world)]
    bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE)
    counts = [torch.zeros(programs, dtype=torch.int32, device=DEVICE) for _ in range(world)]
    return World(buffers, bases, counts, slot_bytes)


@pytest.mark.parametrize("world,rank", [(2, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_reference_over_calls(world: int, rank: int, dtype: torch.dtype) -> None:
    """Several calls of different row counts (more rows than programs, fewer, one): the
    output equals norm(sum in rank order + residual), the residual is updated in place, the
    slots alternate by call, and each call raises this rank's flag in every buffer once.
    The sums are exact, except bf16 ones in the interpreter, whose float -> bf16 casts do
    not round as CUDA's do: there within one rounding of the sum and one of the add."""
    tol = EXACT if dtype == torch.float32 or not INTERPRET else BF16_TWO_ROUNDINGS
    n, programs = 48, 4
    w = make_world(world, programs, slot_bytes=9 * n * 4)
    g = torch.Generator().manual_seed(world * 10 + rank)
    weight = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    for call, rows in enumerate([9, 3, 1, 6], start=1):
        parts = [torch.randn(rows, n, generator=g).to(dtype).to(DEVICE) for _ in range(world)]
        residual = torch.randn(rows, n, generator=g).to(dtype).to(DEVICE)
        ref_out, ref_res = all_reduce_norm_ref(parts, residual, weight, 1e-6)
        for peer in range(world):
            if peer != rank:
                w.arrive(peer, parts[peer], call)
        out, res = w.run(rank, parts[rank], residual, weight)
        assert res is residual
        torch.testing.assert_close(residual, ref_res, **tol)
        torch.testing.assert_close(out, rms_norm_ref(residual, weight, 1e-6))   # of its sum
        if tol["atol"] == 0:
            torch.testing.assert_close(out, ref_out)
        assert torch.equal(w.slot(rank, call, parts[rank]), parts[rank])
        assert torch.equal(w.counts[rank], torch.full_like(w.counts[rank], call))
        for owner in range(world):
            assert (w.flags(owner)[:, rank] == call).all()


def test_ranks_get_bit_identical_results() -> None:
    """Rank 1 and then rank 0 run the same call for real: equal outputs and residuals,
    bit for bit (each sums the ranks in rank order)."""
    n = 64
    w = make_world(2, 3, slot_bytes=5 * n * 2)
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(5, n, generator=g).bfloat16().to(DEVICE) for _ in range(2)]
    residual = torch.randn(5, n, generator=g).bfloat16().to(DEVICE)
    weight = torch.randn(n, generator=g).bfloat16().to(DEVICE)
    w.arrive(0, parts[0], 1)
    out1, res1 = w.run(1, parts[1], residual.clone(), weight)
    out0, res0 = w.run(0, parts[0], residual.clone(), weight)
    assert torch.equal(out0, out1) and torch.equal(res0, res1)
    _, ref_res = all_reduce_norm_ref(parts, residual, weight, 1e-6)
    torch.testing.assert_close(res0, ref_res, **(BF16_TWO_ROUNDINGS if INTERPRET else EXACT))
    torch.testing.assert_close(out0, rms_norm_ref(res0, weight, 1e-6))


def test_rejects_what_does_not_fit() -> None:
    w = make_world(2, 2, slot_bytes=4 * 32 * 2)
    x = torch.zeros(5, 32, dtype=torch.bfloat16, device=DEVICE)   # 5 rows > the slot's 4
    with pytest.raises(AssertionError):
        w.run(0, x, x.clone(), torch.ones(32, dtype=torch.bfloat16, device=DEVICE))
