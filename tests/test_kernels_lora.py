"""Multi-LoRA shrink / expand Triton kernels (kernels/lora.py) vs their torch references, the
references vs a float64 per-row loop, and the per-step row grouping (lora_rows), on CPU via
the interpreter.

Slots are mixed per row, with rows of slot -1 (no adapter) and a slot that has no rows;
T in {0, 1, 7, 33}, R in {8, 16, 24} (24: rank padded to 32 by masks), K and N not
multiples of the tiles, so every tile kind is partial somewhere. Each slot's scale and
weights differ, so a row computed with a neighbour's slot shows (the mutation tests).
The shrink's h is compared in the rows of adapters only (rows of slot -1 are left
unwritten without a K split); NaN there shows that the expand never reads them.
Merged layers: one expand over parts of unequal sizes, h's per-part columns read in
place, and models/lora.py's LoraSlots on the kernels (its per-step h workspace) against
its reference path.
"""
from __future__ import annotations

import itertools
import pytest
import torch

from kernels.lora import (LoraRows, lora_expand, lora_expand_ref, lora_max_split_k, lora_rows,
                          lora_shrink, lora_shrink_ref)

from triton_device import DEVICE, INTERPRET, needs_triton

pytestmark = needs_triton

K, N, S = 200, 144, 5          # slot S - 1 never gets rows


def make_slots(t: int, num_slots: int = S, seed: int = 0) -> torch.Tensor:
    """Slots in [-1, num_slots - 2] (the last slot stays empty), at least one -1 row and
    neighbouring rows of different slots whenever t allows."""
    g = torch.Generator().manual_seed(seed)
    slot = torch.randint(-1, num_slots - 1, (t,), generator=g, dtype=torch.int32)
    if t >= 3:
        slot[0], slot[1], slot[2] = 0, -1, 1
    return slot.to(DEVICE)


def make_weights(r: int, dtype: torch.dtype, k: int = K, n: int = N, num_slots: int = S,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [S, R, K] ~ 1/sqrt(K) (h is O(1)), b [S, N, R] ~ 1/sqrt(R), scale [S] in [0.5, 2]:
    the LoRA delta is O(1), like y."""
    g = torch.Generator().manual_seed(1000 + seed)
    a = (torch.randn(num_slots, r, k, generator=g) / k ** 0.5).to(dtype)
    b = (torch.randn(num_slots, n, r, generator=g) / r ** 0.5).to(dtype)
    scale = torch.linspace(0.5, 2.0, num_slots)
    return a.to(DEVICE), b.to(DEVICE), scale.to(DEVICE)


def assert_h_close(h: torch.Tensor, ref: torch.Tensor, slot: torch.Tensor | None = None) -> None:
    """h is float32 either way; only the summation order differs (tensor-core bf16
    products are exact in float32). slot: compare the rows of adapters only (the shrink
    leaves rows of slot -1 unwritten unless it splits K)."""
    assert h.shape == ref.shape and h.dtype == torch.float32
    if slot is not None:
        h, ref = h[slot >= 0], ref[slot >= 0]
    torch.testing.assert_close(h, ref, rtol=1e-4, atol=1e-4)


def assert_y_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: tight. bf16/fp16: each side rounds its float32 sum once, so at most one ulp
    (<= 2^-7 relative for bf16) apart where the sums straddle a rounding boundary."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-5)


# --- lora_rows ----------------------------------------------------------------------------

@pytest.mark.parametrize("t", [0, 1, 7, 33, 40])
def test_lora_rows_groups_stably(t: int) -> None:
    slot = make_slots(t, seed=t)
    rows = lora_rows(slot, S)
    assert isinstance(rows, LoraRows)
    for f in (rows.slot, rows.order, rows.count, rows.start):
        assert f.dtype == torch.int32 and f.device == slot.device
    assert rows.order.shape == (t,) and rows.count.shape == (S,) and rows.start.shape == (S,)
    order, count, start = rows.order.long().cpu(), rows.count.long().cpu(), rows.start.long().cpu()
    s = slot.long().cpu()
    assert sorted(order.tolist()) == list(range(t))                  # a permutation
    valid = s[s >= 0]
    assert count.tolist() == torch.bincount(valid, minlength=S)[:S].tolist()
    assert start.tolist() == (torch.cumsum(count, 0) - count).tolist()
    for j in range(S):                                                 # each slot's range
        idx = order[start[j]:start[j] + count[j]].tolist()
        assert all(s[i] == j for i in idx) and idx == sorted(idx)      # stable
    rest = order[int(count.sum()):].tolist()                           # slot -1 rows last
    assert all(s[i] == -1 for i in rest) and rest == sorted(rest)
    assert int(count[S - 1]) == 0


def test_lora_rows_all_none_and_int64_input() -> None:
    rows = lora_rows(torch.full((6,), -1, dtype=torch.int64, device=DEVICE), 3)
    assert rows.slot.dtype == torch.int32
    assert rows.count.tolist() == [0, 0, 0] and rows.start.tolist() == [0, 0, 0]
    assert rows.order.tolist() == list(range(6))


# --- references vs a float64 per-row loop -------------------------------------------------

def loop_f64(x, a, b, scale, slot, y, offset):
    """h and the new y, one row at a time in float64 (y rounded once at the end)."""
    t_rows, r = x.shape[0], a.shape[1]
    h = torch.zeros(t_rows, r, dtype=torch.float64)
    y_new = y.double().cpu().clone()
    for t in range(t_rows):
        s = int(slot[t])
        if s < 0:
            continue
        h[t] = a[s].double().cpu() @ x[t].double().cpu()
        delta = float(scale[s]) * (b[s].double().cpu() @ h[t])
        y_new[t, offset:offset + b.shape[1]] += delta
    return h, y_new.to(y.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_refs_match_float64_loop(dtype: torch.dtype) -> None:
    t, r, offset = 33, 24, 9
    slot = make_slots(t, seed=1)
    rows = lora_rows(slot, S)
    a, b, scale = make_weights(r, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, K, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(t, N + 20, generator=g).to(dtype).to(DEVICE)
    h64, y64 = loop_f64(x, a, b, scale, slot.cpu(), y, offset)
    h = lora_shrink_ref(x, a, rows)
    torch.testing.assert_close(h.cpu().double(), h64, rtol=1e-5, atol=1e-5)
    y_ref = y.clone()
    lora_expand_ref(h, b, scale, rows, y_ref, offset)
    assert_y_close(y_ref.cpu(), y64)
    none = (slot < 0).cpu()
    assert bool(none.any()) and (h.cpu()[none] == 0).all()
    assert torch.equal(y_ref.cpu()[none], y.cpu()[none])               # untouched


# --- kernels vs references ----------------------------------------------------------------

CASES = list(itertools.product([0, 1, 7, 33], [8, 16, 24]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, r", CASES)
def test_shrink_matches_ref(t: int, r: int, dtype: torch.dtype) -> None:
    slot = make_slots(t, seed=t + r)
    rows = lora_rows(slot, S)
    a, _, _ = make_weights(r, dtype, seed=r)
    x = torch.randn(t, K, generator=torch.Generator().manual_seed(t)).to(dtype).to(DEVICE)
    ref = lora_shrink_ref(x, a, rows)
    for split_k in (None, 1):                 # the default splits K (atomics) on few rows
        h = lora_shrink(x, a, rows, split_k=split_k)
        assert_h_close(h, ref, slot)
        if split_k is None and t and lora_max_split_k(t, S, x.device) > 1:
            assert (h[slot < 0] == 0).all()   # split: h came from torch.zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, r", CASES)
def test_expand_matches_ref(t: int, r: int, dtype: torch.dtype) -> None:
    """y is a non-contiguous column slice of a wider buffer, and the adapter's N columns
    sit at an offset inside it: nothing outside them (nor slot -1 rows) may change."""
    slot = make_slots(t, seed=t + r)
    rows = lora_rows(slot, S)
    _, b, scale = make_weights(r, dtype, seed=r)
    g = torch.Generator().manual_seed(t + 7)
    h = torch.randn(t, r, generator=g).to(DEVICE)
    h[slot < 0] = 0
    base = torch.randn(t, N + 64, generator=g).to(dtype).to(DEVICE)
    base_ref = base.clone()
    y, y_ref = base[:, 16:16 + N + 40], base_ref[:, 16:16 + N + 40]
    assert t <= 1 or not y.is_contiguous()
    lora_expand(h, b, scale, rows, y, offset=24)
    lora_expand_ref(h, b, scale, rows, y_ref, offset=24)
    assert_y_close(base, base_ref)
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[:, 40:40 + N] = slot[:, None] < 0
    assert torch.equal(base[untouched], base_ref[untouched])


def test_shrink_expand_fp16_end_to_end() -> None:
    t, r = 33, 16
    slot = make_slots(t, seed=5)
    rows = lora_rows(slot, S)
    a, b, scale = make_weights(r, torch.float16, seed=5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, K, generator=g).half().to(DEVICE)
    y = torch.randn(t, N, generator=g).half().to(DEVICE)
    y_ref = y.clone()
    h = lora_shrink(x, a, rows)
    assert_h_close(h, lora_shrink_ref(x, a, rows), slot)
    lora_expand(h, b, scale, rows, y)
    lora_expand_ref(lora_shrink_ref(x, a, rows), b, scale, rows, y_ref)
    assert_y_close(y, y_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_tiles_per_slot_and_many_slots(dtype: torch.dtype) -> None:
    """16-row tiles over 40 rows that are mostly one slot (three tiles of it), 20 slots
    (the in-kernel slot lookup spans 32 lanes), K split 3 ways in 32-wide chunks, and a
    transposed (column-major) x."""
    t, r, num_slots = 40, 24, 20
    slot = torch.full((t,), 11, dtype=torch.int32)
    slot[::7] = torch.tensor([0, 19, -1, 3, 11, 18], dtype=torch.int32)
    slot = slot.to(DEVICE)
    rows = lora_rows(slot, num_slots)
    a, b, scale = make_weights(r, dtype, num_slots=num_slots, seed=9)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(K, t, generator=g).to(dtype).to(DEVICE).T       # strides (1, t)
    ref = lora_shrink_ref(x, a, rows)
    for split_k in (1, 3):
        assert_h_close(lora_shrink(x, a, rows, block_m=16, block_k=32, split_k=split_k), ref,
                       slot)
    y = torch.randn(t, N, generator=g).to(dtype).to(DEVICE)
    y_ref = y.clone()
    lora_expand(ref, b, scale, rows, y, block_m=16, block_n=32)
    lora_expand_ref(ref, b, scale, rows, y_ref)
    assert_y_close(y, y_ref)


# --- mutation: a neighbour's slot must show -----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_neighbour_slot_is_detected(dtype: torch.dtype) -> None:
    """Rows grouped from the slot array shifted by one row (each row takes its neighbour's
    adapter) give outputs that fail the comparison both kernels pass with the right rows."""
    t, r = 33, 16
    slot = make_slots(t, seed=3)
    rows = lora_rows(slot, S)
    shifted = lora_rows(torch.roll(slot, 1), S)
    assert not torch.equal(shifted.slot, rows.slot)
    a, b, scale = make_weights(r, dtype, seed=3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, K, generator=g).to(dtype).to(DEVICE)
    y0 = torch.randn(t, N, generator=g).to(dtype).to(DEVICE)
    h_ref = lora_shrink_ref(x, a, rows)
    y_ref = y0.clone()
    lora_expand_ref(h_ref, b, scale, rows, y_ref)

    assert_h_close(lora_shrink(x, a, rows), h_ref, slot)
    with pytest.raises(AssertionError):
        assert_h_close(lora_shrink(x, a, shifted), h_ref, slot)

    y = y0.clone()
    lora_expand(h_ref, b, scale, rows, y)
    assert_y_close(y, y_ref)
    y_bad = y0.clone()
    lora_expand(h_ref, b, scale, shifted, y_bad)
    with pytest.raises(AssertionError):
        assert_y_close(y_bad, y_ref)


def test_shape_checks() -> None:
    slot = make_slots(7)
    rows = lora_rows(slot, S)
    a, b, scale = make_weights(8, torch.float32)
    x = torch.randn(7, K, device=DEVICE)
    with pytest.raises(AssertionError):
        lora_shrink(x[:6], a, rows)                      # rows built for another T
    with pytest.raises(AssertionError):
        lora_shrink(x.bfloat16(), a, rows)               # adapter dtype != x dtype
    with pytest.raises(AssertionError):
        lora_expand(torch.zeros(7, 8, device=DEVICE), b, scale, rows,
                    torch.zeros(7, N, device=DEVICE), offset=1)     # N columns past y's end


# --- shrink into a given buffer, clearing another ------------------------------------------

@pytest.mark.parametrize("t", [1, 7, 33])
def test_shrink_out_and_clear(t: int) -> None:
    """out: split_k 1 stores the rows of adapters and leaves the others (NaN) alone; a K
    split adds into a zeroed out. clear (a wider, strided buffer) is zeroed in the rows of
    adapters by the same launch, its other rows and columns untouched."""
    r = 16
    slot = make_slots(t, seed=20 + t)
    rows = lora_rows(slot, S)
    a, _, _ = make_weights(r, torch.float32, seed=20)
    x = torch.randn(t, K, generator=torch.Generator().manual_seed(20)).to(DEVICE)
    ref = lora_shrink_ref(x, a, rows)
    none = slot < 0
    for split_k in (1, 2):
        wide = torch.full((t, r + 8), float("nan"), device=DEVICE)
        out = wide[:, 4:4 + r]                                     # strided
        if split_k > 1:
            out[slot >= 0] = 0
        cbuf = torch.full((t, 40), 7.0, device=DEVICE)
        clear = cbuf[:, 2:2 + 35]
        h = lora_shrink(x, a, rows, out=out, clear=clear, block_k=64, split_k=split_k)
        assert h.data_ptr() == out.data_ptr()
        assert_h_close(h, ref, slot)
        assert torch.isnan(wide[none]).all() and torch.isnan(wide[:, :4]).all()
        assert (cbuf[slot >= 0][:, 2:37] == 0).all()
        assert (cbuf[none] == 7).all() and (cbuf[:, :2] == 7).all() and (cbuf[:, 37:] == 7).all()


# --- one expand over a merged layer's parts -------------------------------------------------

PARTS = [(64, 32, 32), (96, 96), (40, 24, 72), (48, 0, 40)]


def expand_per_part(h, b, scale, rows, y, offset, parts):
    """The former way: one single-part reference expand per part, on a contiguous copy of
    the part's h columns."""
    r, col = b.shape[2], 0
    for p, n in enumerate(parts):
        lora_expand_ref(h[:, p * r:(p + 1) * r].contiguous(), b[:, col:col + n].contiguous(),
                        scale, rows, y, offset + col)
        col += n


@pytest.mark.parametrize("block_n", [None, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, r", [(1, 8), (7, 24), (33, 16)])
@pytest.mark.parametrize("parts", PARTS)
def test_expand_parts_matches_ref(parts, t: int, r: int, dtype: torch.dtype, block_n) -> None:
    """b [S, sum(parts), R], h [T, P*R] a strided column slice with NaN in the rows of
    slot -1 (never read), y a non-contiguous slice with the layer at an offset. Part
    boundaries fall inside a 128 (and a 32) column tile: (96, 96), (40, ..)."""
    n, p = sum(parts), len(parts)
    slot = make_slots(t, seed=30 + t)
    rows = lora_rows(slot, S)
    _, b, scale = make_weights(r, dtype, n=n, seed=30 + r)
    g = torch.Generator().manual_seed(31 + t)
    hbuf = torch.randn(t, p * r + 8, generator=g).to(DEVICE)
    hbuf[slot < 0] = float("nan")
    h = hbuf[:, 3:3 + p * r]
    base = torch.randn(t, n + 64, generator=g).to(dtype).to(DEVICE)
    base_ref, base_old = base.clone(), base.clone()
    sl = slice(16, 16 + n + 40)
    y, y_ref, y_old = base[:, sl], base_ref[:, sl], base_old[:, sl]
    assert t <= 1 or not y.is_contiguous()
    lora_expand(h, b, scale, rows, y, 24, parts, block_n=block_n)
    lora_expand_ref(h, b, scale, rows, y_ref, 24, parts)
    expand_per_part(h, b, scale, rows, y_old, 24, parts)
    assert_y_close(base_ref, base_old)
    assert_y_close(base, base_ref)
    assert not torch.isnan(base.float()).any()
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[:, 40:40 + n] = slot[:, None] < 0
    assert torch.equal(base[untouched], base_ref[untouched])


def test_expand_parts_use_their_own_h_columns() -> None:
    """Two parts' h columns swapped: the result must differ (each part reads its own)."""
    t, r, parts = 33, 16, (96, 96)
    slot = make_slots(t, seed=40)
    rows = lora_rows(slot, S)
    _, b, scale = make_weights(r, torch.float32, n=192, seed=40)
    h = torch.randn(t, 2 * r, generator=torch.Generator().manual_seed(40)).to(DEVICE)
    y0 = torch.randn(t, 192, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    y_ref, y, y_bad = y0.clone(), y0.clone(), y0.clone()
    lora_expand_ref(h, b, scale, rows, y_ref, 0, parts)
    lora_expand(h, b, scale, rows, y, 0, parts)
    assert_y_close(y, y_ref)
    lora_expand(torch.cat([h[:, r:], h[:, :r]], 1), b, scale, rows, y_bad, 0, parts)
    with pytest.raises(AssertionError):
        assert_y_close(y_bad, y_ref)


def test_expand_parts_shape_checks() -> None:
    rows = lora_rows(make_slots(7), S)
    _, b, scale = make_weights(8, torch.float32, n=96)
    y = torch.zeros(7, 96, device=DEVICE)
    with pytest.raises(AssertionError):
        lora_expand(torch.zeros(7, 16, device=DEVICE), b, scale, rows, y, 0, (64, 16))  # sum
    with pytest.raises(AssertionError):
        lora_expand(torch.zeros(7, 16, device=DEVICE), b, scale, rows, y, 0, (64, 16, 16))
    with pytest.raises(AssertionError):
        lora_expand(torch.zeros(7, 32, device=DEVICE), b, scale, rows, y, 0, (24,) * 4)


# --- models/lora.py on the kernels ------------------------------------------------------------

def _fake_layer(n_out: int, n_in: int, dtype: torch.dtype):
    from types import SimpleNamespace
    return SimpleNamespace(weight=torch.empty(n_out, n_in, dtype=dtype, device=DEVICE),
                           tp=SimpleNamespace(size=1, rank=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_slots_kernels_match_reference(dtype: torch.dtype, monkeypatch) -> None:
    """A decoder layer's four LoRA layers (qkv: 3 parts, o, gate_up: 2 parts, down) in
    launch order on the kernels, against LoraSlots' reference path: one shrink and one
    expand per layer; steps whose shrinks split K (the two zeroed h buffers in turn, each
    shrink clearing the next one's: four layers reuse each buffer twice, at different
    widths) and steps that do not (one unzeroed buffer), each run twice over the same rows
    (the ping-pong carries on) before a new step's rows."""
    import models.lora as ml
    r, num_slots = 16, 3
    ctx = ml.LoraContext()
    shapes = [([64, 32, 32], 200, False), ([80], 136, True), ([96, 96], 144, False),
              ([144], 272, True)]                         # (parts, in, row-parallel)
    layers = [ml.LoraSlots(_fake_layer(sum(p), k, dtype), p, rp, num_slots, r, ctx)
              for p, k, rp in shapes]
    assert ctx.width == 3 * r and all(ls.b.shape == (num_slots, sum(ls.parts), r)
                                      for ls in layers)
    g = torch.Generator().manual_seed(50)
    for s, rank in enumerate((8, 16)):                    # slot 2 stays empty
        for i, ls in enumerate(layers):
            k = ls.in_local
            parts = {p: (torch.randn(rank, k, generator=g) / k ** 0.5,
                         torch.randn(n, rank, generator=g) / rank ** 0.5)
                     for p, n in enumerate(ls.parts)
                     if len(ls.parts) == 1 or (p + s + i) % 3 != 2}   # some left out
            ls.load(s, {p: (a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE))
                        for p, (a, b) in parts.items()}, 0.5 + s)
    calls = {"shrink": 0, "expand": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(ml, "lora_shrink", counted("shrink", ml.lora_shrink))
    monkeypatch.setattr(ml, "lora_expand", counted("expand", ml.lora_expand))
    seen = set()
    for step, t in enumerate([1, 2, 7, 33, 1]):
        slot = torch.tensor([(i % num_slots) - 1 for i in range(t)], dtype=torch.int32)
        if t <= 2:
            slot[0] = step % 2                            # a row of an adapter
        ctx.rows = lora_rows(slot.to(DEVICE), num_slots)
        split = lora_max_split_k(t, num_slots, torch.device(DEVICE)) > 1
        seen.add(split)
        for rep in range(2):
            for ls in layers:
                x = torch.randn(t, ls.in_local, generator=g).to(dtype).to(DEVICE)
                y0 = torch.randn(t, sum(ls.parts), generator=g).to(dtype).to(DEVICE)
                y, y_ref = y0.clone(), y0.clone()
                before = dict(calls)
                monkeypatch.setattr(ml.LoraSlots, "use_kernels", True)
                ls.apply(x, y)
                monkeypatch.setattr(ml.LoraSlots, "use_kernels", False)
                ls.apply(x, y_ref)
                assert calls == {"shrink": before["shrink"] + 1, "expand": before["expand"] + 1}
                assert_y_close(y, y_ref)
                assert not torch.equal(y[slot >= 0], y0[slot >= 0])
            assert ctx._ws.split == split and ctx._ws.bufs.shape[0] == (2 if split else 1)
    assert seen == ({True, False} if INTERPRET else seen)   # a GPU's SMs split K at all t
