"""All-reduce of decode-sized tensors over NVLink through peer memory; NCCL for the rest.

Why: a TP decode step all-reduces two tensors per layer of a few hundred KB to a few MB
(batch x hidden x 2 bytes). At those sizes NCCL's ring costs its latency, not NVLink's
bandwidth. With every rank's buffer mapped into every other rank's address space (torch
symmetric memory: CUDA VMM allocations exchanged once at start), one kernel per rank copies
its tensor into its own buffer, meets the peers at a barrier on the buffers' signal pads,
and sums all ranks' buffers straight out of peer memory ("one shot"). Two-shot (each rank
reduces 1/N of the tensor, then gathers the other parts) moves fewer bytes per link and
wins for larger tensors. Both kernels are torch's (`torch.ops.symm_mem`), capturable in
CUDA graphs. Beyond `two_shot_max` bytes, NCCL's ring is the better algorithm and is kept.

Every rank sums the ranks' values in rank order, so all ranks get bit-identical results,
as TP requires (each rank continues from its own copy of the sum).

Past torch's region the buffer holds two slots and barrier flags for our own kernel,
kernels/all_reduce_norm.py: the decoder layers' all-reduce fused with the residual add and
RMSNorm that follow it (`all_reduce_norm`), up to NORM_MAX bytes.

NVLink multicast (the `multimem` kernels) is not used: the lent GPU hosts keep it off.
"""
from __future__ import annotations

import logging
import socket
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.all_reduce_norm import FLAGS_BYTES, MAX_PROGRAMS, MAX_WORLD, all_reduce_norm

log = logging.getLogger("nanoserve.worker")

# Measured on 2x H200 (tests/gpu/bench_all_reduce.py, tests/gpu/RESULTS.md): one-shot is
# fastest up to ONE_SHOT_MAX bytes, two-shot beyond (1.1-1.6x NCCL up to 8 MiB, near it at
# 16 MiB); NCCL above TWO_SHOT_MAX, where its ring is built for the job.
ONE_SHOT_MAX = 256 << 10
TWO_SHOT_MAX = 8 << 20
NORM_MAX = 2 << 20     # all_reduce_norm's slot: a decode step's hidden states, batch 256 at 8B
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def buffer_bytes(size: int = TWO_SHOT_MAX) -> int:
    """Torch's region of `size` bytes, then all_reduce_norm's two slots and flags."""
    return size + 2 * NORM_MAX + FLAGS_BYTES


@dataclass
class Fused:
    """What all_reduce_norm needs besides the tensors: every rank's buffer address in this
    process, this rank, and its per-program call counts (the grid: the same on every rank)."""
    bases: torch.Tensor     # int64 [world]
    rank: int
    counts: torch.Tensor    # int32 [G]


@dataclass
class FastAllReduce:
    """A symmetric buffer shared by every rank of `group_name`: torch's region of `size`
    bytes, then the fused kernel's (`fused`: None where it cannot run)."""
    group_name: str
    buffer: torch.Tensor            # uint8 [buffer_bytes(size)], symmetric
    size: int = TWO_SHOT_MAX
    fused: Fused | None = None
    one_shot_max: int = ONE_SHOT_MAX
    two_shot_max: int = TWO_SHOT_MAX

    def _summable(self, x: torch.Tensor, max_bytes: int) -> bool:
        """x is a float tensor on this buffer's GPU, contiguous, of 1 to max_bytes bytes."""
        return (x.device == self.buffer.device and x.dtype in DTYPES and x.is_contiguous()
                and 0 < x.numel() * x.element_size() <= max_bytes)

    def handles(self, x: torch.Tensor) -> bool:
        """Whether x goes through peer memory (else: NCCL)."""
        return (self._summable(x, min(self.two_shot_max, self.size))
                and x.numel() * x.element_size() % 16 == 0)

    def fuses(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether all_reduce_norm takes x (a [T, H] partial sum) and its residual."""
        return (self.fused is not None and x.dim() == 2 and self._summable(x, NORM_MAX)  # a slot
                and residual.is_contiguous() and residual.shape == x.shape
                and residual.dtype == x.dtype)

    def all_reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(sum of x over ranks + residual), that sum, written into residual)."""
        f = self.fused
        return all_reduce_norm(x, residual, weight, eps, f.bases, f.rank, f.counts,
                               slot_offset=self.size, slot_bytes=NORM_MAX,
                               flags_offset=self.size + 2 * NORM_MAX)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, as a new tensor (x is left as it was)."""
        nbytes = x.numel() * x.element_size()
        staged = self.buffer[:nbytes].view(x.dtype)
        if nbytes <= self.one_shot_max:
            out = torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x.view(-1), "sum",
                                                              self.group_name)
            return out.view(x.shape)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        return staged.view(x.shape).clone()


def allocate(device: torch.device, size: int = TWO_SHOT_MAX) -> torch.Tensor | None:
    """This rank's symmetric buffer (None where there is none: CPU, or the allocation fails).

    Local, no collective: the first symmetric allocation of a process sets up torch's
    symmetric memory, 2-3 s on 2x H100, so a worker runs this in a thread beside NCCL's
    set-up and the weights load and hands the buffer to `create`."""
    if device.type != "cuda":
        return None
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        torch.cuda.set_device(device)
        return symm_mem.empty(buffer_bytes(size), dtype=torch.uint8, device=device)
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        log.warning("peer memory unavailable (%s)", e)
        return None


def create(device: torch.device, group: dist.ProcessGroup | None = None,
           size: int = TWO_SHOT_MAX, buffer: torch.Tensor | None = None,
           fused: bool = True) -> FastAllReduce | None:
    """Set up peer buffers for every rank of `group` (default: the world); a collective.
    `buffer`: this rank's, from `allocate(device, size)` (else allocated here). fused: also
    the all-reduce + RMSNorm kernel (False: torch's kernels only, to compare).

    Returns None, on every rank alike, where peer memory cannot work: CPU or gloo; ranks on
    different hosts; a process that cannot see its peers' GPUs (one GPU visible per
    container, as docker-compose deploys workers); a driver without VMM peer access. Each
    stage's outcome is agreed on over the group before the next, so a failure on one rank
    cannot leave the others waiting in a rendezvous."""
    if device.type != "cuda":
        return None
    if buffer is not None and buffer.numel() != buffer_bytes(size):
        raise ValueError(f"peer buffer of {buffer.numel()} bytes; allocate(device, {size}) "
                         f"makes {buffer_bytes(size)}")
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    # Where every rank is: (host, GPU index as this process numbers them).
    mine = device.index if device.index is not None else torch.cuda.current_device()
    here = torch.tensor([zlib.crc32(socket.gethostname().encode()), mine],
                        dtype=torch.int64, device=device)
    everyone = [torch.empty_like(here) for _ in range(world)]
    dist.all_gather(everyone, here, group=group)
    hosts = {int(t[0]) for t in everyone}
    gpus = [int(t[1]) for t in everyone]
    reachable = (len(hosts) == 1 and len(set(gpus)) == world
                 and max(gpus) < torch.cuda.device_count()
                 and all(g == mine or torch.cuda.can_device_access_peer(mine, g) for g in gpus))
    if not _all_agree(reachable, device, group):
        buffer = None
    elif buffer is None:
        buffer = allocate(device, size)
    if not _all_agree(buffer is not None, device, group):
        log.info("all-reduce: NCCL for all sizes (no peer memory between these ranks)")
        return None
    handle = None
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        handle = symm_mem.rendezvous(buffer, group.group_name)
    except Exception as e:  # noqa: BLE001
        log.warning("peer-memory rendezvous failed (%s)", e)
    if not _all_agree(handle is not None, device, group):
        return None
    fast = FastAllReduce(group.group_name, buffer, size)
    if fused:
        fast.fused = _fused_state(handle, buffer, size, device, group)
    return fast


def _fused_state(handle, buffer: torch.Tensor, size: int, device: torch.device,
                 group: dist.ProcessGroup) -> Fused | None:
    """all_reduce_norm's state, agreed over the group: one grid size for every rank (at
    most the SMs, so all its programs are resident at once), and the flags zeroed on every
    rank before any rank can raise a peer's (the agreeing all-reduce orders the zeroing)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    offset = buffer.data_ptr() - int(handle.buffer_ptrs[rank])   # where the tensor starts
    ptrs = [int(p) + offset for p in handle.buffer_ptrs]          # (the same on every rank)
    buffer[size:].zero_()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    usable = world <= MAX_WORLD and offset >= 0 and all(p % 16 == 0 for p in ptrs)  # aligned
    grid = torch.tensor([min(MAX_PROGRAMS, sms) if usable else 0], dtype=torch.int32,
                        device=device)
    dist.all_reduce(grid, op=dist.ReduceOp.MIN, group=group)
    g = int(grid.item())
    if g == 0:
        log.info("all-reduce: no fused all-reduce + RMSNorm (a rank cannot run it)")
        return None
    return Fused(torch.tensor(ptrs, dtype=torch.int64, device=device), rank,
                 torch.zeros(g, dtype=torch.int32, device=device))


def _all_agree(ok: bool, device: torch.device, group: dist.ProcessGroup) -> bool:
    """True on every rank if ok is true on every rank (one NCCL all-reduce)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
