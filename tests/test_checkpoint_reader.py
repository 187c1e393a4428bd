"""The grouped safetensors reader (models/checkpoint_reader.py) against safetensors' own.

On a GPU the loader reads each file in groups through pinned memory; here the same code
runs on the CPU (grouped=True) with tiny groups and pieces, so every boundary case is hit:
tensors split over several reads, a tensor larger than a group, a tensor whose bytes are
not aligned for its dtype, zero-size and 0-d tensors, every dtype a checkpoint carries."""
from __future__ import annotations

import functools
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import models.loader
from models.checkpoint_reader import read_header, read_tensors
from models.loader import load_model
from tiny_checkpoint import tiny_qwen3_dir


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(33, 17, generator=g).bfloat16(),
        "b.bool_odd": torch.rand(7, generator=g) > 0.5,    # 7 bytes: what follows is unaligned
        "c.f32": torch.randn(5, 3, generator=g),
        "d.i64": torch.arange(-9, 11, dtype=torch.int64),
        "e.fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "f.empty": torch.empty(0, 4, dtype=torch.float16),
        "g.scalar": torch.tensor(3.5, dtype=torch.float32),
        "h.big": torch.randn(300, 40, generator=g).to(torch.float16),   # 24,000 bytes
        "i.u8": torch.arange(13, dtype=torch.uint8),
    }


NAMES = {torch.bfloat16: "BF16", torch.bool: "BOOL", torch.float32: "F32", torch.int64: "I64",
         torch.float8_e4m3fn: "F8_E4M3", torch.float16: "F16", torch.uint8: "U8"}


def write_in_order(tensors: dict[str, torch.Tensor], path) -> None:
    """A safetensors file with the tensors' bytes back to back in dict order (safetensors'
    own writer orders them by alignment; other writers need not)."""
    header, data = {}, b""
    for name, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("group_bytes, piece_bytes", [(64, 16), (1000, 7), (1 << 20, 1 << 20)])
def test_grouped_reader_gives_what_safetensors_gives(tmp_path, group_bytes, piece_bytes):
    tensors = mixed_tensors()
    for path, write in ((tmp_path / "ordered.safetensors", save_file),
                        (tmp_path / "unaligned.safetensors", write_in_order)):
        write(tensors, path)
        got = {}
        for name, t in read_tensors(str(path), "cpu", grouped=True, group_bytes=group_bytes,
                                    piece_bytes=piece_bytes):
            got[name] = t.clone()   # a view of the group's buffer: valid until the next one
        expected = load_file(path)
        assert got.keys() == expected.keys() == tensors.keys()
        for name, t in tensors.items():
            assert same(got[name], t) and same(expected[name], t), name
    entries = read_header(str(tmp_path / "unaligned.safetensors"))
    assert any(e.begin % e.dtype.itemsize for e in entries)   # the unaligned case ran


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(mixed_tensors(), path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="do not fit it or the file"):
        list(read_tensors(str(path), "cpu", grouped=True))
    path.write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(str(path))
    path.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(str(path))


def test_unsupported_dtype_is_named(tmp_path):
    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 8)
    with pytest.raises(ValueError, match="tensor x has unsupported dtype 'C64'"):
        read_header(str(path))


def test_model_loaded_through_groups_equals_the_memory_mapped_load(tmp_path_factory, monkeypatch):
    """The loader's GPU path (grouped) on the CPU: every parameter bit-identical, TP rank 1
    of 2 included (shards cut from views of a group's buffer)."""
    from models.parallel import TPGroup
    path = str(tiny_qwen3_dir(tmp_path_factory))
    for tp in (TPGroup(), TPGroup(rank=1, size=2)):
        reference, _ = load_model(path, tp=tp)
        monkeypatch.setattr(models.loader, "read_tensors", functools.partial(
            read_tensors, grouped=True, group_bytes=4096, piece_bytes=1000))
        grouped, _ = load_model(path, tp=tp)
        monkeypatch.undo()
        ref = dict(reference.named_parameters())
        for name, p in grouped.named_parameters():
            assert torch.equal(p, ref[name]), name
