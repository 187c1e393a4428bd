"""Which all-reduces go through peer memory (models/fast_all_reduce.py) and which stay on
the process group. The kernels themselves need NVLink'd GPUs: tests/gpu/bench_all_reduce.py
checks their sums against NCCL's and tests/gpu/test_tp_gpu.py runs the model with them."""
from __future__ import annotations

import torch
import torch.distributed as dist

from models import fast_all_reduce
from models.fast_all_reduce import FastAllReduce
from models.parallel import TPGroup


def buffer_of(nbytes: int) -> FastAllReduce:
    return FastAllReduce("g", torch.empty(fast_all_reduce.buffer_bytes(nbytes), dtype=torch.uint8),
                         size=nbytes)


def test_decode_sized_float_tensors_are_handled():
    fast = buffer_of(1 << 20)
    assert fast.handles(torch.zeros(131, 1024, dtype=torch.bfloat16))
    assert fast.handles(torch.zeros(8, dtype=torch.float32))
    assert fast.handles(torch.zeros(256, 1024, dtype=torch.float16))


def test_what_the_kernels_cannot_take_stays_on_nccl():
    fast = buffer_of(1 << 20)
    assert not fast.handles(torch.zeros(513, 1024, dtype=torch.bfloat16))      # over the buffer
    assert not fast.handles(torch.zeros(4, 3, dtype=torch.bfloat16))           # 24 B: not 16-aligned
    assert not fast.handles(torch.zeros(64, 64, dtype=torch.bfloat16).T)       # not contiguous
    assert not fast.handles(torch.zeros(64, dtype=torch.int32))                # not a float sum
    assert not fast.handles(torch.zeros(0, dtype=torch.bfloat16))
    big = buffer_of(64 << 20)
    assert not big.handles(torch.zeros(fast_all_reduce.TWO_SHOT_MAX // 2 + 8, dtype=torch.bfloat16))
    assert big.handles(torch.zeros(fast_all_reduce.TWO_SHOT_MAX // 2, dtype=torch.bfloat16))


class Recorder(FastAllReduce):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape)
        return x * 2


def test_tp_group_routes_by_the_fast_path_and_uses_its_result(monkeypatch):
    fast = Recorder("g", torch.empty(fast_all_reduce.buffer_bytes(1 << 20), dtype=torch.uint8),
                    size=1 << 20)
    fast.calls = []
    nccl = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: nccl.append(x.shape))
    tp = TPGroup(rank=0, size=2, fast=fast)
    small = torch.ones(4, 1024, dtype=torch.bfloat16)
    assert torch.equal(tp.all_reduce(small), small * 2)      # the returned tensor is the sum
    large = torch.ones(1024, 1024, dtype=torch.bfloat16)       # 2 MiB > the 1 MiB buffer
    assert tp.all_reduce(large) is large
    assert fast.calls == [small.shape] and nccl == [large.shape]
    assert TPGroup(rank=0, size=1, fast=fast).all_reduce(small) is small and len(fast.calls) == 1


def test_no_peer_memory_on_cpu():
    assert fast_all_reduce.create(torch.device("cpu")) is None


def test_fused_norm_takes_decode_sized_rows_only_when_set_up():
    fast = buffer_of(1 << 20)
    x = torch.zeros(131, 4096, dtype=torch.bfloat16)
    assert not fast.fuses(x, x.clone())                       # no fused state: torch's kernels
    fast.fused = fast_all_reduce.Fused(torch.zeros(2, dtype=torch.int64), 0,
                                       torch.zeros(4, dtype=torch.int32))
    assert fast.fuses(x, x.clone())
    rows = fast_all_reduce.NORM_MAX // (4096 * 2)
    assert fast.fuses(torch.zeros(rows, 4096, dtype=torch.bfloat16),
                      torch.zeros(rows, 4096, dtype=torch.bfloat16))
    assert not fast.fuses(torch.zeros(rows + 1, 4096, dtype=torch.bfloat16),
                          torch.zeros(rows + 1, 4096, dtype=torch.bfloat16))   # over the slot
    assert not fast.fuses(x, x.clone().float())                # residual of another dtype
    assert not fast.fuses(x, torch.zeros(130, 4096, dtype=torch.bfloat16))
    assert not fast.fuses(x.view(131, 32, 128), x.clone().view(131, 32, 128))   # not [T, H]
    assert not fast.fuses(x[:, :2048], x[:, :2048].clone())   # not contiguous


def test_norm_after_a_partial_sum_reduces_it(monkeypatch):
    """Under TP a norm with a residual sums x first (the row-parallel layers before it no
    longer do): through the fused kernel where it fuses, else all_reduce then the norm."""
    from models.layernorm import RMSNorm
    calls = []

    class Fake(FastAllReduce):
        def __call__(self, x):
            calls.append("all_reduce")
            return x * 2

        def all_reduce_norm(self, x, residual, weight, eps):
            calls.append("fused")
            return RMSNorm(x.shape[-1], eps)(x * 2, residual)

    fast = Fake("g", torch.empty(fast_all_reduce.buffer_bytes(1 << 20), dtype=torch.uint8),
                size=1 << 20)
    norm = RMSNorm(64, tp=TPGroup(rank=0, size=2, fast=fast))
    x, res = torch.randn(4, 64), torch.randn(4, 64)
    want = RMSNorm(64)(x * 2, res.clone())
    for fused in (None, fast_all_reduce.Fused(torch.zeros(2, dtype=torch.int64), 0,
                                              torch.zeros(4, dtype=torch.int32))):
        fast.fused = fused
        out, new_res = norm(x, res.clone())
        torch.testing.assert_close(out, want[0])
        torch.testing.assert_close(new_res, want[1])
    assert calls == ["all_reduce", "fused"]
    assert torch.equal(norm(x), RMSNorm(64)(x))               # no residual: x is whole already
    assert calls == ["all_reduce", "fused"]


def test_unreduced_row_parallel_outputs_sum_to_the_whole_with_the_bias_once():
    """reduce=False: each rank returns its partial sum (no collective), rank 0 adding the
    bias; the partials sum to the unsharded layer's output."""
    from models.linear import RowParallelLinear
    torch.manual_seed(0)
    whole = RowParallelLinear(8, 4, bias=True)
    whole.weight.data.normal_()
    whole.bias.data.normal_()
    x = torch.randn(3, 8)
    parts = []
    for rank in range(2):
        part = RowParallelLinear(8, 4, bias=True, tp=TPGroup(rank=rank, size=2), reduce=False)
        part.weight_loader(part.weight, whole.weight.data)
        part.bias.weight_loader(part.bias, whole.bias.data)
        parts.append(part(x[:, 4 * rank:4 * rank + 4]))
    torch.testing.assert_close(parts[0] + parts[1], whole(x))
