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
    return FastAllReduce("g", torch.empty(nbytes, dtype=torch.uint8))


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
    fast = Recorder("g", torch.empty(1 << 20, dtype=torch.uint8))
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
