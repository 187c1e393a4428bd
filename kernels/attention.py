"""Paged attention entry point: the metadata a step carries and the backend that runs it.

The KV cache of one layer is two tensors `k_cache`, `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim] (flash-attn's paged layout), stored
head-major (`new_kv_cache`: strides, not shape, differ). A step's
tokens are ragged: sequence i contributes query tokens cu_seqlens_q[i]:cu_seqlens_q[i+1],
at positions context_lens[i] - q_len_i .. context_lens[i] - 1, and attends causally to
every key of its own sequence up to its own position (cached prefix included).

Backends (`select_backend`): `torch` (this file's reference; CPU), `triton` (own kernels in
store_kvcache.py / paged_attention.py), `flash_attn` (flash_attn_backend.py). Every
backend's forward(q, k, v, k_cache, v_cache, meta, scale) first writes this step's k/v at
meta.slot_mapping (unless kv_stored: a fused kernel already did), then attends
q [T, Hq, D] over the paged cache -> [T, Hq, D].
Index tensors (slot_mapping, block_tables, context_lens, cu_seqlens_*) are int32 on q's
device; the caches and q/k/v need only a contiguous last dim.

An fp8 KV cache (`--kv-cache-dtype fp8`) is e4m3 pages plus one float32 scale per slot
for K and for V (k_scale/v_scale [num_blocks, block_size]; kernels/kv_quant.py); the
torch and triton backends read it, flash-attn 2 cannot.
"""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from kernels import backend_choice
from kernels.attention_metadata import AttentionMetadata, decode_runs  # noqa: F401 (re-exported)
from kernels.kv_quant import FP8_DTYPE, quantize_ref


def new_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Every layer's K and V pages: [2, num_layers, num_blocks, block_size, Hkv, D], stored
    head-major (one kv head's slots of a page contiguous). A decode program (one sequence,
    one kv head) then streams whole key tiles instead of one 128- or 256-byte row every
    Hkv rows: on an H100, fp8 decode attention 4-7% faster, bf16 ~1%. Kernels address the
    pages by their strides, so `cache[0, layer]` is a layer's k_cache as any backend reads it.

    On a CPU the pages are zeroed here: memory from torch.empty becomes resident only when
    first written, and the BlockManager hands out free blocks oldest first, so an untouched
    cache made the worker's RSS climb with every batch of requests until all of it had
    been written once (issue 35: +25 MB a round of 200 requests, for 40 rounds at the 1 GiB
    default). Resident from the start, as GPU memory is, the worker's size is what it will
    stay at."""
    alloc = torch.zeros if torch.device(device).type == "cpu" else torch.empty
    return alloc(2, num_layers, num_blocks, num_kv_heads, block_size, head_dim,
                 dtype=dtype, device=device).transpose(3, 4)


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Reference: write k/v [T, Hkv, D] into the caches at slot_mapping (skip -1),
    quantized with per-token scales when the caches are fp8. Caches of any strides."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k, v = k[keep], v[keep]
    if k_cache.dtype == FP8_DTYPE:
        (k, ks), (v, vs) = quantize_ref(k), quantize_ref(v)
        k_scale.view(-1)[slots] = ks
        v_scale.view(-1)[slots] = vs
    page, in_page = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[page, in_page] = k
    v_cache[page, in_page] = v


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: q [T, Hq, D] over the paged caches -> [T, Hq, D]. Slow, exact, any device.
    fp8 caches are dequantized with their per-slot scales."""
    block_size = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    cu_q = meta.cu_seqlens_q.tolist()
    ctx = meta.context_lens.tolist()
    tables = meta.block_tables.tolist()
    for i, ctx_len in enumerate(ctx):
        q_i = q[cu_q[i]:cu_q[i + 1]]                               # [Lq, Hq, D]
        q_len = q_i.shape[0]
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = torch.tensor(tables[i][:n_blocks], dtype=torch.long, device=q.device)
        k_i = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:ctx_len]
        v_i = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:ctx_len]
        k_i = k_i.repeat_interleave(group, dim=1).float()          # [Lk, Hq, D]
        v_i = v_i.repeat_interleave(group, dim=1).float()
        if k_scale is not None:
            k_i = k_i * k_scale[blocks].reshape(-1)[:ctx_len, None, None]
            v_i = v_i * v_scale[blocks].reshape(-1)[:ctx_len, None, None]
        scores = torch.einsum("qhd,khd->hqk", q_i.float(), k_i) * scale
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[cu_q[i]:cu_q[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v_i).to(q.dtype)
    return out


class TorchBackend:
    """Reference backend: runs anywhere, used on CPU."""
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale)


# --deterministic's split length in keys (TritonBackend.invariant): a multiple of the key
# tile; 512 keys give a 4k-token decode row 8 programs per kv head. Unmeasured on a GPU.
INVARIANT_SPLIT_LEN = 512


class TritonBackend:
    """Own Triton kernels: store_kvcache + paged decode / paged prefill (a prefill without
    cached prefixes goes to torch's varlen FlashAttention where available). Default on CUDA
    without flash-attn; also runs on CPU under TRITON_INTERPRET=1 (tests only: slow).

    decode_splits: flash-decoding splits for decode; None = heuristic from the batch shape
    (host ints only, no sync). Under CUDA graphs pass a fixed number: any value is correct
    for any context length, only the speed depends on it.

    invariant (--deterministic, issue 68): every row, decode or prefill, takes paged_prefill
    with splits of a fixed LENGTH (split_len keys from key 0, each reduced alone in key
    tiles from its start, merged in order): a query at position p reduces its keys in the
    same tiles and splits, in the same order, whether it is a decode row, one row of a
    prefill chunk of any length, after a cached prefix or not, beside any other rows. A
    decode step runs its splits as parallel programs (long contexts at small batches keep
    the GPU busy), a prefill walks them in turn; the merge is one arithmetic in both. Not
    a split COUNT (decode_splits, chosen from the batch: it moves every boundary), not the
    decode kernel (its own tiles: a re-prefilled sequence would not reproduce them), not
    varlen FlashAttention (its own tiles either).
    """
    name = "triton"

    def __init__(self, decode_splits: int | None = None, invariant: bool = False) -> None:
        # Imported here, not at module import, so TRITON_INTERPRET can still be set first.
        from kernels.paged_attention import default_num_splits, paged_decode, paged_prefill
        from kernels.store_kvcache import store_kvcache
        from kernels import torch_varlen
        self._store, self._decode, self._prefill = store_kvcache, paged_decode, paged_prefill
        self._varlen = torch_varlen
        self._default_splits = default_num_splits
        self.decode_splits = decode_splits
        self.invariant = invariant
        self.split_len = INVARIANT_SPLIT_LEN

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                kv_stored: bool = False, norm_rotary=None) -> torch.Tensor:
        """norm_rotary (kernels/qk_norm_rotary.NormRotary; decode rows, bf16 / fp16 cache):
        q, k, v are raw heads, normalized, rotated and stored by the decode kernel itself."""
        if norm_rotary is not None:
            assert meta.is_decode and not self.invariant and k_scale is None
        elif not kv_stored:
            self._store(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if self.invariant:
            splits = -(-meta.max_seqlen_k // self.split_len) if meta.is_decode else 0
            return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                 meta.cu_seqlens_q, meta.max_seqlen_q, scale,
                                 k_scale=k_scale, v_scale=v_scale, split_len=self.split_len,
                                 parallel_splits=splits if splits > 1 else 0)
        if meta.is_decode:
            splits = self.decode_splits
            if splits is None:
                splits = self._default_splits(meta.num_seqs, k_cache.shape[2],
                                              meta.max_seqlen_k, q.device)
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                scale, num_splits=splits, k_scale=k_scale, v_scale=v_scale,
                                runs=meta.decode_runs, norm_rotary=norm_rotary)
        # fp8: attention always reads the (quantized) cache, prefill included
        if meta.prefix_free and k_scale is None and self._varlen.usable(q, k, scale):
            return self._varlen.varlen_prefill(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale)
        return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                             meta.cu_seqlens_q, meta.max_seqlen_q, scale,
                             k_scale=k_scale, v_scale=v_scale)


class FlashAttnBackend:
    """flash-attn 2 over the paged cache (needs block_size % 256 == 0, fp16/bf16, CUDA).
    K/V are written by the Triton store kernel (flash-attn's own append path wants
    per-sequence k/v, not our flat slot mapping)."""
    name = "flash_attn"

    def __init__(self) -> None:
        from kernels import flash_attn_backend
        from kernels.store_kvcache import store_kvcache
        self._fa, self._store = flash_attn_backend, store_kvcache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        if k_scale is not None:
            raise ValueError("flash-attn 2 cannot read an fp8 KV cache: use the triton backend")
        self._fa.check_supported(q, k_cache)
        if not kv_stored:
            self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            return self._fa.flash_decode(q, k_cache, v_cache, meta.context_lens,
                                         meta.block_tables, scale)
        return self._fa.flash_prefill(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                      meta.max_seqlen_q, meta.max_seqlen_k, meta.block_tables,
                                      scale)


def _triton_usable(device: torch.device) -> str | None:
    """None if Triton kernels can run on `device`, else the reason they cannot."""
    if importlib.util.find_spec("triton") is None:       # find, don't import: see TritonBackend
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"triton needs a CUDA device (or TRITON_INTERPRET=1 set before import), got {device}"


log = logging.getLogger("nanoserve.attention")


def flash_attn_problem(device: torch.device, block_size: int | None = None,
                       head_dim: int | None = None, dtype: torch.dtype | None = None,
                       kv_fp8: bool = False) -> str | None:
    """None if flash_attn can serve this model on `device`, else the reason it cannot."""
    from kernels import flash_attn_backend as fab
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if kv_fp8:
        return "cannot read an fp8 KV cache (flash-attn 2 has no fp8 path)"
    if not fab.flash_attn_available():
        return ("`import flash_attn` failed (not installed: build it with "
                "`make flash-attn`, see README)")
    if block_size is not None and block_size % 256 != 0:
        return f"needs block_size % 256 == 0, got {block_size}"
    return fab.coverage_problem(fab.build_record(), head_dim, dtype,
                                torch.cuda.get_device_capability(device))


def select_backend(name: str = "auto", device: torch.device | str = "cpu",
                   block_size: int | None = None, head_dim: int | None = None,
                   dtype: torch.dtype | None = None, shapes=None, kv_fp8: bool = False,
                   deterministic: bool = False, prefill_graphs: bool = False):
    """Pick an attention backend: auto|flash_attn|triton|torch.

    auto on CUDA: triton, unless flash_attn can serve the model (installed; block_size %
    256 == 0; its build has kernels for head_dim, dtype and this GPU's arch) and, when the
    layer's `shapes` (backend_choice.AttentionShapes) are given, it also measures faster
    there (backend_choice.time_backends); without shapes a usable flash_attn is taken. On
    CPU: torch. The choice and its reason are logged. Properties passed as None are not
    checked. Asking by name for one that cannot run here raises ValueError saying why.
    kv_fp8 (an fp8 KV cache) rules flash_attn out, and needs sm_89+ for triton.
    deterministic (--deterministic): triton with one kernel for every row (TritonBackend's
    invariant), the only backend whose order is ours to fix: auto takes it, torch (per
    sequence einsums shaped by the chunk) and flash_attn (splits chosen from the batch)
    raise.
    prefill_graphs (the worker will capture prefill CUDA graphs): auto takes triton untimed.
    The graphs need its paged prefill, and what they save outweighs the kernels' difference
    the timing sees: on one H200 (Qwen3-0.6B) a step of two 512-token prompts beside 8
    decode rows took ~47 ms eager with flash_attn (3 ms of kernels, the rest launches)
    against a few ms replayed, and the two backends' timed kernels differ by a few percent.
    """
    device = torch.device(device)
    if deterministic:
        if name not in ("auto", "triton"):
            raise ValueError(f"--deterministic needs the triton attention backend, not {name!r} "
                             "(its reduction order depends on the batch or the chunk)")
        try:
            backend = select_backend("triton", device, kv_fp8=kv_fp8)
        except ValueError as e:
            raise ValueError(f"--deterministic needs the triton attention backend: {e}") from None
        backend.invariant = True
        log.info("attention backend triton, batch-invariant (--deterministic)")
        return backend
    if shapes is not None:
        head_dim, dtype = shapes.head_dim, shapes.dtype
        block_size = block_size or shapes.block_size
    if name == "auto":
        if device.type != "cuda":
            return TorchBackend()
        problem = flash_attn_problem(device, block_size, head_dim, dtype, kv_fp8)
        if problem is not None:
            log.info("attention backend auto -> triton: flash_attn %s", problem)
            return select_backend("triton", device, kv_fp8=kv_fp8)
        if prefill_graphs:
            log.info("attention backend auto -> triton: the prefill CUDA graphs need its paged "
                     "prefill (--attention-backend flash_attn: prefills eager)")
            return select_backend("triton", device, kv_fp8=kv_fp8)
        if shapes is None:
            log.info("attention backend auto -> flash_attn (installed, covers head dim %s, %s; "
                     "not timed: no shapes given)", head_dim, dtype)
            return FlashAttnBackend()
        return _fastest(device, shapes)
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        reason = _triton_usable(device)
        if reason is None and kv_fp8 and device.type == "cuda" \
                and torch.cuda.get_device_capability(device) < (8, 9):
            reason = "an fp8 KV cache needs an sm_89+ GPU (Ada, Hopper or newer)"
        if reason:
            raise ValueError(f"attention backend 'triton' unavailable: {reason}")
        return TritonBackend()
    if name == "flash_attn":
        problem = flash_attn_problem(device, block_size, head_dim, dtype, kv_fp8)
        if problem:
            raise ValueError(f"attention backend 'flash_attn' unavailable: {problem}")
        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}: expected auto|flash_attn|triton|torch")


def _fastest(device: torch.device, shapes) -> FlashAttnBackend | TritonBackend:
    """Time flash_attn and triton at `shapes` on `device`, return the faster (logged)."""
    candidates = {"flash_attn": FlashAttnBackend(), "triton": TritonBackend()}
    try:
        times = backend_choice.time_backends(candidates, shapes, device)
    except Exception as e:                 # a flash_attn build error must not stop the worker
        log.warning("attention backend auto -> triton: timing the backends failed: %s", e)
        return candidates["triton"]
    best = min(times, key=times.get)
    log.info("attention backend auto -> %s (one decode + one prefill step at Hq=%d Hkv=%d "
             "D=%d %s: %s)", best, shapes.num_heads, shapes.num_kv_heads, shapes.head_dim,
             str(shapes.dtype).removeprefix("torch."),
             ", ".join(f"{n} {t * 1e6:.0f} us" for n, t in sorted(times.items())))
    return candidates[best]
