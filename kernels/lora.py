"""Multi-LoRA for batched adapters (punica / vLLM v1 style): every token row of a step may
use a different adapter, held in one of `num_slots` slots of stacked weights
(a [num_slots, R, K], b [num_slots, N, R], scale [num_slots]). A LoRA linear layer adds
    y[t] += scale[s] * b[s] @ (a[s] @ x[t]),   s = slot[t]  (slot -1: no adapter)
in two launches: `lora_shrink` (x [T, K] -> h [T, R] float32) and `lora_expand`
(h -> y[:, offset:offset+N], added in place; `offset` lets h feed a slice of a wider
output). A merged layer (q/k/v of qkv_proj, gate/up of gate_up_proj: up to 3 parts) runs
one shrink over its parts' stacked A (h [T, P*R]) and ONE expand over all its parts:
b [num_slots, N_0 + .. + N_{P-1}, R] holds the parts' B stacked along N at their output
columns, and output columns of part p take h's columns p*R..(p+1)*R (`part_sizes`).

Rows are grouped by slot once per step (`lora_rows`, shared by every layer), so that a
program works on up to BLOCK_M rows of one slot and reads each adapter tile once per row
tile, not once per row. Grid, both kernels: (column tiles: K splits for shrink, N tiles
for expand) x (row tiles). Row tiles are numbered compactly over the slots: slot s owns
cdiv(count[s], BLOCK_M) consecutive tile ids, and each program finds its slot with a
cumsum over `count` (<= 64 ints, in registers). The grid's row axis is a bound computed on
the host from T and num_slots only, cdiv(T, BLOCK_M) + min(T, num_slots) (each slot wastes
at most one partial tile), and programs past the real tile count exit at once. That is
vLLM's grid (row tiles x column tiles x slot, with early exit) flattened: vLLM launches
cdiv(T, BLOCK_M) row tiles for every slot, num_slots times more programs than needed
(64 slots x 8192 rows of prefill: ~0.8M mostly-empty programs for one expand).
Expand's N tiles are numbered part by part (part p owns cdiv(N_p, BLOCK_N) consecutive
tile ids), so no tile straddles a part boundary whatever the part sizes; a program finds
its part from its tile id with <= 2 scalar compares against the parts' first tile ids.

Shrink: the whole rank (R <= 64 per part, padded to a power of two >= 16 by masks) is one
tile; with few row tiles (decode) K is split across programs that atomically add float32
partial sums into h, which must then start at zero in the rows of adapters. Without a K
split the programs store h, and nothing zeroes it: rows of slot -1 keep whatever h held
(the expand never reads them: its row tiles cover slot rows only). So that a K-split
shrink needs no memset launch of its own, it can zero another buffer's slot rows on the
way (`clear`): models/lora.py alternates two zeroed h buffers per step, each shrink
clearing the one the next layer's shrink accumulates into (one memset per step, not per
layer).
Expand: each program owns distinct (row, column) elements of y, so it loads y, adds
scale * (h @ b^T) in float32 and rounds once, no atomics.

No host synchronisation anywhere (grids come from shapes), so these functions can be
captured in a CUDA graph.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.interpret import INTERPRET_ENV, cast, dot


@dataclass
class LoraRows:
    """Per-step row grouping, built once per step and shared by every LoRA layer.
    Rows with slot -1 come after all slots' rows in `order` (no slot's range covers them).
    T = slot.shape[0] and num_slots = count.shape[0] are the host-side bounds the grids use."""
    slot: torch.Tensor          # [T] int32, adapter slot of each token row, -1 = no adapter
    order: torch.Tensor         # [T] int32, row indices grouped by slot (stable)
    count: torch.Tensor         # [num_slots] int32, rows per slot
    start: torch.Tensor         # [num_slots] int32, offset of each slot's rows in `order`

    @property
    def num_rows(self) -> int:
        return self.slot.shape[0]

    @property
    def num_slots(self) -> int:
        return self.count.shape[0]


def lora_rows(slot: torch.Tensor, num_slots: int) -> LoraRows:
    """slot [T] (any integer dtype; values in [-1, num_slots)) -> LoraRows, on slot's
    device, by a stable sort and two binary searches (torch.sort, torch.searchsorted): no
    host synchronisation, capturable in a CUDA graph (bincount is avoided on purpose: its
    output size depends on the data, a host sync)."""
    slot = slot.reshape(-1).to(torch.int32)
    key = torch.where(slot < 0, torch.full_like(slot, num_slots), slot)   # -1 rows last
    sorted_key, order = torch.sort(key, stable=True)
    ids = torch.arange(num_slots, dtype=torch.int32, device=slot.device)
    start = torch.searchsorted(sorted_key, ids, out_int32=True)
    end = torch.searchsorted(sorted_key, ids, right=True, out_int32=True)
    return LoraRows(slot=slot, order=order.to(torch.int32), count=end - start, start=start)


# --- torch references ---------------------------------------------------------------------

def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    """x [T, K] (bf16/fp16/fp32), a [num_slots, R, K] -> h [T, R] float32,
    h[t] = a[slot[t]] @ x[t] in float32; rows with slot -1 are 0. One matmul per slot
    (boolean indexing: host syncs, a reference only)."""
    T, K = x.shape
    S, R, Ka = a.shape
    assert Ka == K and rows.num_rows == T
    h = torch.zeros(T, R, dtype=torch.float32, device=x.device)
    slot = rows.slot.long()
    for s in range(S):
        m = slot == s
        if bool(m.any()):
            h[m] = x[m].float() @ a[s].float().T
    return h


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rows: LoraRows,
                    y: torch.Tensor, offset: int = 0,
                    part_sizes: tuple[int, ...] | None = None) -> None:
    """h [T, P*R] float32, b [num_slots, N, R], scale [num_slots] float32, y [T, Ny],
    part_sizes (N_0, .., N_{P-1}) summing to N (default (N,)): for the columns n of part p,
    y[t, offset+n] = (y.float() + scale[s] * (b[s, n] @ h[t, p*R:(p+1)*R])).to(y.dtype),
    s = slot[t], in place (y may be a strided view); rows with slot -1 untouched (h's are
    not read)."""
    T = h.shape[0]
    S, N, R = b.shape
    parts = (N,) if part_sizes is None else tuple(int(n) for n in part_sizes)
    assert sum(parts) == N and h.shape == (T, len(parts) * R), (h.shape, b.shape, parts)
    assert rows.num_rows == T and y.shape[0] == T and offset + N <= y.shape[1]
    slot = rows.slot.long()
    col = offset
    for p, n in enumerate(parts):
        hp = h[:, p * R:(p + 1) * R]
        bp = b[:, col - offset:col - offset + n]
        yv = y[:, col:col + n]
        for s in range(S):
            m = slot == s
            if bool(m.any()):
                delta = scale[s].float() * (hp[m].float() @ bp[s].float().T)
                yv[m] = (yv[m].float() + delta).to(y.dtype)
        col += n


# --- Triton kernels -----------------------------------------------------------------------

@triton.jit
def _slot_tile(pid_m, Count, num_slots, BLOCK_M: tl.constexpr, SLOTS_P2: tl.constexpr):
    """Compact row-tile id -> (number of real tiles, its slot, its tile index within the
    slot's rows). Slot s owns tile ids [sum_{s'<s} tiles[s'], sum_{s'<=s} tiles[s'])."""
    s = tl.arange(0, SLOTS_P2)
    cnt = tl.load(Count + s, mask=s < num_slots, other=0)
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    slot = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
    first = tl.sum(tl.where(s == slot, ends - tiles, 0), axis=0)
    return total, slot, pid_m - first


@triton.jit
def _shrink_kernel(X, A, H, C, Order, Count, Start, num_slots, R, K, k_per_split, WC,
                   stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ht, stride_hr,
                   stride_ct, stride_cc,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_C: tl.constexpr, SLOTS_P2: tl.constexpr, SPLIT_K: tl.constexpr,
                   CLEAR: tl.constexpr, PRECISION: tl.constexpr):
    """h[rows, :R] (+)= x[rows, k-range] @ a[slot, :R, k-range]^T for one row tile of one
    slot and one K split (axis 0). SPLIT_K > 1: float32 atomic adds into h (zero there on
    entry). CLEAR: the K split 0 programs also zero c[rows, :WC] (another buffer)."""
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    total, slot, tile = _slot_tile(pid_m, Count, num_slots, BLOCK_M, SLOTS_P2)
    if pid_m >= total:
        return
    m_begin = tl.load(Start + slot) + tile * BLOCK_M
    m_end = tl.load(Start + slot) + tl.load(Count + slot)
    offs_m = m_begin + tl.arange(0, BLOCK_M)
    m_mask = offs_m < m_end
    rows = tl.load(Order + offs_m, mask=m_mask, other=0).to(tl.int64)
    if CLEAR:
        if pid_k == 0:
            offs_c = tl.arange(0, BLOCK_C)
            tl.store(C + rows[:, None] * stride_ct + offs_c[None, :] * stride_cc,
                     tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32),
                     mask=m_mask[:, None] & (offs_c < WC)[None, :])
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_k * k_per_split
    k_end = tl.minimum(K, k0 + k_per_split)
    x_ptrs = X + rows[:, None] * stride_xt + (k0 + offs_k)[None, :] * stride_xk
    # The adapter tile is read transposed, [BLOCK_K, BLOCK_R], the dot's right operand.
    a_ptrs = (A + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
              + (k0 + offs_k)[:, None] * stride_ak)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for kk in range(k0, k_end, BLOCK_K):
        k_mask = offs_k < k_end - kk
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = dot(x, w, acc, PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    h_ptrs = H + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr
    h_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc, mask=h_mask)
    else:
        tl.atomic_add(h_ptrs, acc, mask=h_mask)


@triton.jit
def _expand_kernel(H, B, Scale, Y, Order, Count, Start, num_slots, R, E0, T1, O1, E1, T2, O2, E2,
                   stride_ht, stride_hr, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   SLOTS_P2: tl.constexpr, NUM_PARTS: tl.constexpr, SPLIT_H: tl.constexpr,
                   PRECISION: tl.constexpr, RNE_BF16: tl.constexpr):
    """y[rows, n-tile] = round(y + scale[slot] * h[rows, p*R:(p+1)*R] @ b[slot, n-tile, :R]^T)
    for one row tile of one slot (axis 1) and one N tile (axis 0) of part p; the product
    in float32. Part p (p = 1, 2) owns tile ids from Tp on and columns [Op, Ep); part 0
    columns [0, E0)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    total, slot, tile = _slot_tile(pid_m, Count, num_slots, BLOCK_M, SLOTS_P2)
    if pid_m >= total:
        return
    # The tile's part: its first column, the part's end column and its h columns.
    n0 = pid_n * BLOCK_N
    n_end = E0
    h0 = pid_n * 0
    if NUM_PARTS > 1:
        in1 = pid_n >= T1
        n0 = tl.where(in1, O1 + (pid_n - T1) * BLOCK_N, n0)
        n_end = tl.where(in1, E1, n_end)
        h0 = tl.where(in1, R, h0)
    if NUM_PARTS > 2:
        in2 = pid_n >= T2
        n0 = tl.where(in2, O2 + (pid_n - T2) * BLOCK_N, n0)
        n_end = tl.where(in2, E2, n_end)
        h0 = tl.where(in2, 2 * R, h0)
    m_begin = tl.load(Start + slot) + tile * BLOCK_M
    m_end = tl.load(Start + slot) + tl.load(Count + slot)
    offs_m = m_begin + tl.arange(0, BLOCK_M)
    m_mask = offs_m < m_end
    rows = tl.load(Order + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_end
    h = tl.load(H + rows[:, None] * stride_ht + (h0 + offs_r)[None, :] * stride_hr,
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    w = tl.load(B + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
                + offs_r[:, None] * stride_br,
                mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SPLIT_H:
        # bf16 b: h = hi + mid + lo, three bf16 parts (~24 bits of h's mantissa), each
        # times b on the bf16 tensor cores into the float32 accumulator, smallest first.
        hi = h.to(tl.bfloat16)
        rest = h - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = dot(lo, w, acc, PRECISION)
        acc = dot(mid, w, acc, PRECISION)
        acc = dot(hi, w, acc, PRECISION)
    else:
        acc = dot(h, w.to(tl.float32), acc, PRECISION)
    acc = acc * tl.load(Scale + slot)
    y_ptrs = Y + rows[:, None] * stride_yt + offs_n[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, cast(y + acc, Y.dtype.element_ty, RNE_BF16), mask=y_mask)


# --- launchers ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4        # the interpreter: a handful, so that the tests' small K still splits


def lora_block_m(rows: int) -> int:
    """Rows per tile: tl.dot's minimum (16) at decode sizes, where a slot has few rows;
    taller tiles (fewer re-reads of each adapter tile) as T grows."""
    if rows <= 512:         # decode: up to 64 slots of a few rows each
        return 16
    return 32 if rows <= 2048 else 64


def _row_tiles(T: int, num_slots: int, block_m: int) -> int:
    """Upper bound on the real row tiles, from host-known sizes only (CUDA graphs): each
    slot with rows wastes at most one partial tile."""
    return triton.cdiv(T, block_m) + min(T, num_slots)


def lora_max_split_k(num_rows: int, num_slots: int, device: torch.device,
                     block_m: int | None = None) -> int:
    """The K split lora_shrink picks by default at most (less where K has fewer BLOCK_K
    chunks): enough programs for two per SM over the row tiles' bound. > 1: the shrink
    accumulates with atomics (h must start at zero in the rows of adapters); 1: it stores."""
    tiles = _row_tiles(num_rows, num_slots, block_m or lora_block_m(num_rows))
    return max(1, (2 * _num_sms(device)) // max(1, tiles))


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _check_rows(rows: LoraRows, T: int, num_slots: int) -> None:
    assert rows.num_rows == T, (rows.num_rows, T)
    assert rows.num_slots == num_slots, (rows.num_slots, num_slots)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: LoraRows, *,
                out: torch.Tensor | None = None, clear: torch.Tensor | None = None,
                block_m: int | None = None, block_k: int | None = None,
                split_k: int | None = None, num_warps: int = 4,
                num_stages: int = 3) -> torch.Tensor:
    """lora_shrink_ref's values in the rows of adapters, in one Triton launch: x [T, K]
    (bf16/fp16/fp32, any strides), a [num_slots, R, K] in x's dtype -> h [T, R] float32.
    split_k (default: min(K's BLOCK_K chunks, lora_max_split_k)) > 1 accumulates with
    atomics into h, so the float32 sums' order (not their precision) varies run to run,
    and h must hold zeros in the rows of adapters first; split_k == 1 stores them. Rows of
    slot -1 are not written: without `out` they are 0 where K is split (h from
    torch.zeros) and undefined otherwise (torch.empty: no memset launch); lora_expand never
    reads them.
    out: h to write (float32 [T, R], any strides), zero in the rows of adapters wherever
    the call splits K (pass split_k=1 for a buffer that is not).
    clear: float32 [T, W] (any strides, disjoint from out): zeroed in the rows of adapters
    by the same launch (the next call's `out`: see models/lora.py).
    The remaining keyword arguments are tuning overrides."""
    T, K = x.shape
    S, R, Ka = a.shape
    assert Ka == K, (a.shape, x.shape)
    assert a.dtype == x.dtype, (a.dtype, x.dtype)
    _check_rows(rows, T, S)
    bm = block_m or lora_block_m(T)
    bk = block_k or (64 if bm >= 64 else 128)
    k_chunks = triton.cdiv(K, bk)
    if split_k is None:
        split_k = lora_max_split_k(T, S, x.device, bm)
    split_k = max(1, min(split_k, k_chunks))
    k_per_split = triton.cdiv(k_chunks, split_k) * bk
    split_k = max(1, triton.cdiv(K, k_per_split))      # no empty splits
    if out is None:
        h = (torch.zeros if split_k > 1 else torch.empty)(T, R, dtype=torch.float32,
                                                          device=x.device)
    else:
        assert out.shape == (T, R) and out.dtype == torch.float32, (out.shape, out.dtype)
        h = out
    if clear is not None:
        assert clear.dim() == 2 and clear.shape[0] == T and clear.dtype == torch.float32
    if T == 0 or S == 0:
        return h
    if R == 0 or K == 0:        # degenerate: nothing to launch for
        if K == 0:
            h.zero_()
        if clear is not None:
            clear.zero_()
        return h
    c = h if clear is None else clear
    _shrink_kernel[(split_k, _row_tiles(T, S, bm))](
        x, a, h, c, rows.order, rows.count, rows.start, S, R, K, k_per_split, c.shape[1],
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        h.stride(0), h.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=bm, BLOCK_R=_block_r(R), BLOCK_K=bk,
        BLOCK_C=_block_r(c.shape[1]) if clear is not None else 16,
        SLOTS_P2=triton.next_power_of_2(S), SPLIT_K=split_k,
        CLEAR=clear is not None and clear.shape[1] > 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    return h


@functools.lru_cache(maxsize=1024)
def _part_layout(parts: tuple[int, ...], block_n: int) -> tuple[int, tuple[int, ...]]:
    """Part sizes -> (N tiles in all, (E0, T1, O1, E1, T2, O2, E2)): part p's first tile id
    Tp, first column Op and end column Ep (unused parts: past the last tile)."""
    tiles = [triton.cdiv(n, block_n) for n in parts]
    total = sum(tiles)
    first_tile = [sum(tiles[:p]) for p in range(len(parts))]
    first_col = [sum(parts[:p]) for p in range(len(parts))]
    args = [parts[0]]
    for p in (1, 2):
        if p < len(parts):
            args += [first_tile[p], first_col[p], first_col[p] + parts[p]]
        else:
            args += [total, 0, 0]
    return total, tuple(args)


def lora_expand(h: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rows: LoraRows,
                y: torch.Tensor, offset: int = 0, part_sizes: tuple[int, ...] | None = None,
                *, block_m: int | None = None, block_n: int | None = None,
                num_warps: int = 4, num_stages: int = 2, precision: str | None = None) -> None:
    """lora_expand_ref in one Triton launch: h [T, P*R] float32 (any strides, e.g. a
    column slice of a wider buffer), b [num_slots, N, R] (any float dtype) holding P <= 3
    parts' B stacked along N (part_sizes, summing to N; default (N,)), scale [num_slots]
    float32, y [T, Ny] (bf16/fp16/fp32, any strides, e.g. a column slice of a wider
    output): y[:, offset+n] += scale * (b[:, n] @ h[:, p*R:(p+1)*R]) for the columns n of
    part p, in place, rounded once; rows with slot -1 untouched, and their h not read. The
    product keeps float32 accuracy: IEEE for fp32 y; for 16-bit y h is split into three
    bf16 parts multiplied by a bf16 b on the tensor cores ("bf16x3", exact products,
    float32 sums), or tf32x3 for an fp16 b. Plain tf32 (h rounded to 2^-11) is not enough
    where y + delta cancels: the rounded sum then misses the reference by more than y's
    ulp. The keyword arguments are tuning overrides (precision: "bf16x3", "tf32x3", "tf32"
    or "ieee")."""
    T = h.shape[0]
    S, N, R = b.shape
    parts = (N,) if part_sizes is None else tuple(int(n) for n in part_sizes)
    assert 1 <= len(parts) <= 3 and min(parts) >= 0 and sum(parts) == N, (parts, b.shape)
    assert h.dim() == 2 and h.shape[1] == len(parts) * R, (h.shape, b.shape, parts)
    assert h.dtype == torch.float32 and scale.dtype == torch.float32 and scale.numel() == S
    assert y.dim() == 2 and y.shape[0] == T and 0 <= offset and offset + N <= y.shape[1], \
        (y.shape, offset, N)
    _check_rows(rows, T, S)
    if T == 0 or N == 0 or S == 0:
        return
    yv = y[:, offset:offset + N] if offset or N != y.shape[1] else y
    bm = block_m or lora_block_m(T)
    bn = block_n or 128                 # H100 sweep: best or within 5% at T = 1..8192
    n_tiles, part_args = _part_layout(parts, bn)
    grid = (n_tiles, _row_tiles(T, S, bm))
    if precision is None:
        split_h = b.dtype == torch.bfloat16 and y.dtype != torch.float32
        precision = "ieee" if y.dtype == torch.float32 else "tf32x3"
    else:                               # tuning override: one float32 dot at that precision
        split_h = precision == "bf16x3"
        precision = "tf32" if split_h else precision
    _expand_kernel[grid](
        h, b, scale.reshape(-1), yv, rows.order, rows.count, rows.start, S, R, *part_args,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2),
        yv.stride(0), yv.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=_block_r(R), SLOTS_P2=triton.next_power_of_2(S),
        NUM_PARTS=len(parts), SPLIT_H=split_h, PRECISION=precision,
        RNE_BF16=INTERPRET_ENV and y.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages)
