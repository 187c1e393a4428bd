"""Paged KV placement with prefix caching: which physical block holds which tokens' KV.

The KV cache (owned by the workers) is cut into `num_blocks` blocks of `block_size`
token slots. A sequence's block table maps its logical blocks to physical ones. Full
blocks whose KV has been computed are registered under a chained hash of their tokens,
so a later sequence with the same prefix reuses them instead of recomputing.

Rules that keep reuse correct:
  * Only full blocks that end before a sequence's last token may hit: the last token is
    always computed, so the step produces logits to sample from.
  * A block is registered only after its KV is computed (`commit`), so a chunked
    prefill's still-empty blocks are never served to someone else.
  * A hit is verified exactly, never trusted to the hash alone (see `_lookup`).
  * A sequence's block hashes are computed once (`block_hash`, kept on the sequence) and
    shared by allocate, commit, the host tier and the scheduler's same-step check.

Host tier (`num_host_blocks` > 0: the workers' --host-kv-cache-gb): a registered block
is copied to a host slot when its last user frees it, and the host index (hash -> slot,
LRU) remembers what it held; a prefix that misses the GPU tier but hits the host tier gets
fresh blocks whose KV is copied back. The copies are `transfers`, (kind, source,
destination) in the order they were decided, which the engine sends with the next step.
Workers run a step's copies on a copy stream, in order, after the steps before it and
beside its own forward (off the critical path); the next step's forward waits for them.
So the rules here:
  * a block being saved is not handed out until the step carrying its copy was built
    (`take_transfers`): its own step never writes it. Where no other block is free, it is
    handed out anyway and the step is marked synchronous (its forward waits for the copies);
  * a sequence whose blocks come back from the host tier waits a step (`restoring`): the
    scheduler runs it in a later step, or in the same one marked synchronous when there is
    nothing else to run;
  * a host slot is read before it is reused: restores are decided in `allocate`, saves in
    `deallocate`, each appended in order, and the copy stream keeps that order (a save that
    evicts a slot's entry comes before any restore could look it up).

KV events (`events` not None, kv_events.py): what enters and leaves each tier's hash table
is recorded in vLLM's terms, BlockStored when a hash becomes findable (commit, a restore,
a save to the host), BlockRemoved when it stops being (a block handed out fresh, a host
slot reused), AllBlocksCleared when both tiers are dropped (`clear`).
"""
from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

import xxhash

from scheduler_service.kv_events import (
    MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent)
from scheduler_service.sequence import Sequence


def compute_hash(token_ids: tuple[int, ...], prefix_hash: int | None) -> int:
    """xxhash64 over (previous block's hash as 8 LE bytes, if any) + tokens as LE int32.

    Chained, so equal hashes mean equal prefixes up to and including this block
    (barring collisions, which `BlockManager._lookup` also rules out).
    """
    h = xxhash.xxh64()
    if prefix_hash is not None:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.intdigest()


def _root(seq: Sequence) -> tuple[int | None, int | None]:
    """(hash, content_id) standing before a sequence's block 0: none for the base model,
    and for a LoRA adapter its id as both (content ids are never negative): KV computed
    through one adapter is not another's, so their blocks never match, even on a hash
    collision (adapter ids are never reused)."""
    a = seq.sampling.adapter_id
    return (None, None) if not a else (a, -a)


@dataclass
class Block:
    """One physical KV block. The fields below `ref_count` describe its contents once
    registered; they are cleared when the block is handed out fresh."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None          # its key in the hash table (None: never registered)
    token_ids: tuple[int, ...] = ()  # the tokens whose KV it holds
    # content_id names the exact token prefix (this block and all before it) whose KV
    # the block holds: blocks share one iff they hold KV of the same prefix. Checking
    # tokens + the parent's content_id on a hit makes reuse exact at any depth of the
    # chain even if the hash collides, without storing whole prefixes.
    content_id: int | None = None
    parent_content_id: int | None = None  # the previous block's content_id (None: block 0)
    parent_hash: int | None = None        # the previous block's hash (KV events name it)

    def reset(self) -> None:
        self.hash = None
        self.token_ids = ()
        self.content_id = None
        self.parent_content_id = None
        self.parent_hash = None


OFFLOAD, RESTORE = 0, 1   # transfers: (OFFLOAD, GPU block, host slot), (RESTORE, slot, block)


@dataclass
class HostBlock:
    """A host slot's contents: the registered block it was copied from."""
    slot: int
    hash: int
    token_ids: tuple[int, ...]
    content_id: int
    parent_content_id: int | None
    parent_hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.events: list[KVEvent] | None = None   # KV events since drained (None: off)
        self._init(num_blocks, block_size, num_host_blocks)

    def clear(self) -> None:
        """Forget every block and host slot (the workers' KV is gone); KV events go on."""
        self._init(self.num_blocks, self.block_size, self.num_host_blocks)
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _init(self, num_blocks: int, block_size: int, num_host_blocks: int) -> None:
        self.num_host_blocks = num_host_blocks
        self.host: OrderedDict[int, HostBlock] = OrderedDict()   # hash -> contents, LRU first
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.transfers: list[tuple[int, int, int]] = []   # for the next step (see above)
        self._saving: dict[int, int] = {}   # freed blocks being saved -> their host slot
        self._sync = False   # a saving block was handed out: the step waits for its copies
        self.restoring: set[int] = set()    # seq ids whose restores are in `transfers`
        self.num_offloaded = self.num_restored = 0        # blocks copied, each way
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # Free list as an ordered set: FIFO (freed blocks go to the back, fresh ones come
        # from the front, so recently freed, still-hashed blocks survive longest), and
        # O(1) removal from the middle when a freed block is hit again.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._content_ids = count()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self._saving)   # saving ones: see _take_saving

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # ---- allocation ---------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        """Conservative: ignores prefix hits (a hit on a free block still takes one)."""
        return seq.num_blocks(self.block_size) <= self.num_free_blocks

    def block_hash(self, seq: Sequence, i: int) -> int:
        """The chained hash of seq's full block i: the key its KV is (or would be) cached
        under. Computed once per sequence and block, kept in `seq.block_hashes` (filled in
        order; the blocks before i first): allocate, commit, the host tier and the
        scheduler's same-step check all read it there. Valid for good, because a block is
        hashed only once its tokens are known (never over an in-flight placeholder) and
        known tokens never change."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(compute_hash(tuple(seq.block_tokens(j, self.block_size)),
                                       hashes[-1] if j else _root(seq)[0]))
        return hashes[i]

    def first_miss(self, seq: Sequence) -> tuple[int, int] | None:
        """(i, hash) of seq's first full block (of those ending before its last token, the
        ones allocate looks up) that the GPU tier does not hold, or None when it holds them
        all: where seq's computing would start. Not verified like a hit (a collision only
        misjudges this guess; allocate verifies)."""
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = self.block_hash(seq, i)
            if h not in self.hash_to_block:
                return i, h
        return None

    def hashes_to_commit(self, seq: Sequence, num_tokens: int, start: int, stop: int) -> list[int]:
        """The hashes of seq's blocks start..stop-1 that are not registered yet and whose KV
        is computed once seq's first num_tokens tokens are (full blocks): those of them
        commit registers after a step that computes up to there."""
        return [self.block_hash(seq, i) for i in range(max(seq.num_hashed_blocks, start),
                                                       min(num_tokens // self.block_size, stop))]

    def allocate(self, seq: Sequence) -> None:
        """Build seq's block table over all its tokens, reusing cached leading blocks."""
        assert not seq.block_table, f"seq {seq.seq_id} already has blocks"
        bs = self.block_size
        parent: Block | None = None
        root = _root(seq)
        num_hits = 0
        for i in range((seq.num_tokens - 1) // bs):  # full blocks ending before the last token
            block = self._lookup(self.block_hash(seq, i), tuple(seq.block_tokens(i, bs)),
                                 parent.content_id if parent else root[1])
            if block is None:
                break  # chained: after one miss nothing further can match
            if block.ref_count == 0 and block.block_id in self._saving:
                del self._saving[block.block_id]   # being saved, and reused as it is
            elif block.ref_count == 0:
                del self.free_block_ids[block.block_id]  # freed but still holding its KV
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            parent = block
            num_hits += 1
        restored = 0
        if self.host:   # the host tier takes over where the GPU tier missed
            for held in self._host_chain(seq, num_hits, parent, root):
                block = self._restore(held)
                seq.block_table.append(block.block_id)
                num_hits += 1
                restored += 1
                self.restoring.add(seq.seq_id)
        for _ in range(num_hits, seq.num_blocks(bs)):
            seq.block_table.append(self._take_fresh_block())
        seq.num_cached_tokens = num_hits * bs
        seq.num_host_cached_tokens = restored * bs
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.num_hashed_blocks = num_hits

    def can_append(self, seq: Sequence) -> bool:
        return len(seq.block_table) * self.block_size >= len(seq.token_ids) or bool(self.num_free_blocks)

    def may_append(self, seq: Sequence) -> int | None:
        """Give the last token (about to be computed by a decode step) a block if it has
        none; returns the block appended, if any."""
        if len(seq.block_table) * self.block_size < len(seq.token_ids):
            return self.append_block(seq)
        return None

    def append_block(self, seq: Sequence) -> int:
        """One more (fresh) block at the end of seq's table; the caller checked there is a
        free one and that seq needs it."""
        block_id = self._take_fresh_block()
        seq.block_table.append(block_id)
        return block_id

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks whose KV is now computed, so others can hit them.

        A block holding an in-flight placeholder token waits: its ids are not known yet."""
        bs = self.block_size
        known = min(seq.num_computed_tokens, seq.num_tokens - seq.num_pending_tokens)
        root = _root(seq)
        while seq.num_hashed_blocks < known // bs:
            i = seq.num_hashed_blocks
            parent = self.blocks[seq.block_table[i - 1]] if i > 0 else None
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.block_tokens(i, bs))
            block.hash = self.block_hash(seq, i)
            block.parent_content_id = parent.content_id if parent else root[1]
            twin = self._lookup(block.hash, tokens, block.parent_content_id)  # same prefix's KV
            block.token_ids = tokens
            block.content_id = twin.content_id if twin else next(self._content_ids)
            block.parent_hash = parent.hash if parent else None
            if self.events is not None and block.hash not in self.hash_to_block:
                self._stored(block.hash, block.parent_hash, tokens, root[0], MEDIUM_GPU)
            self.hash_to_block[block.hash] = block.block_id  # newest wins; twins are equal
            seq.num_hashed_blocks += 1

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's references, last block first so its tail is evicted first.

        Freed blocks keep their hash and contents until handed out fresh: a later
        request (or this one, resumed) may still hit them.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released twice"
            if block.ref_count == 0:
                if not (self.num_host_blocks and block.hash is not None and self._offload(block)):
                    self.free_block_ids[block_id] = None   # else: free once its copy is sent
        seq.block_table.clear()
        self.restoring.discard(seq.seq_id)
        seq.num_cached_tokens = 0
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    # ---- host tier ----------------------------------------------------------------

    def take_transfers(self) -> tuple[list[tuple[int, int, int]], bool]:
        """The copies the step being built carries, and whether its forward must wait for
        them (a block being saved was handed out to it); forgets them: the blocks they save
        are free from now on, the sequences they restore may run from the next step."""
        out, sync, self.transfers, self._sync = self.transfers, self._sync, [], False
        for block_id in self._saving:
            self.free_block_ids[block_id] = None
        self._saving.clear()
        self.restoring.clear()
        return out, sync

    def _take_saving(self) -> int:
        """No free block is left but blocks being saved: the oldest, its copy kept, and the
        step synchronous (its forward overwrites the block only after the copy)."""
        block_id = next(iter(self._saving))
        del self._saving[block_id]
        self._sync = True
        return block_id

    def _offload(self, block: Block) -> bool:
        """Save a freed registered block's KV to a host slot (the least recently used one
        when none is free), unless the host tier already holds the same contents. True
        when a copy was queued (the block waits for its step, see take_transfers)."""
        held = self.host.get(block.hash)
        if held is not None and held.content_id == block.content_id:
            self.host.move_to_end(block.hash)
            return False
        if held is not None:   # same hash, other contents (a collision): replace it
            del self.host[block.hash]
            self.host_free.append(held.slot)
            if self.events is not None:
                self.events.append(BlockRemoved([block.hash], MEDIUM_CPU))
        if self.host_free:
            slot = self.host_free.pop()
        else:   # the least recently used slot (a restore from it earlier in the list reads first)
            _, gone = self.host.popitem(last=False)
            slot = gone.slot
            if self.events is not None:
                self._removed(gone.hash, MEDIUM_CPU)
        self.host[block.hash] = HostBlock(slot, block.hash, block.token_ids, block.content_id,
                                          block.parent_content_id, block.parent_hash)
        if self.events is not None:
            self._stored(block.hash, block.parent_hash, block.token_ids, None, MEDIUM_CPU)
        self.transfers.append((OFFLOAD, block.block_id, slot))
        self._saving[block.block_id] = slot
        self.num_offloaded += 1
        return True

    def _host_chain(self, seq: Sequence, start: int, parent: Block | None,
                    root: tuple[int | None, int | None]) -> list[HostBlock]:
        """The host tier's blocks continuing seq's prefix from its block `start` (after
        `parent`), verified like GPU hits (tokens + the parent's content), each made the
        most recently used."""
        content = parent.content_id if parent else root[1]
        chain = []
        for i in range(start, (seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.block_tokens(i, self.block_size))
            h = self.block_hash(seq, i)
            held = self.host.get(h)
            if held is None or held.token_ids != tokens or held.parent_content_id != content:
                break
            self.host.move_to_end(h)
            chain.append(held)
            content = held.content_id
        return chain

    def _restore(self, held: HostBlock) -> Block:
        """A fresh block that holds (once the step's transfers ran) a host slot's KV,
        registered as a hit."""
        block = self.blocks[self._take_fresh_block()]
        block.hash, block.token_ids = held.hash, held.token_ids
        block.content_id, block.parent_content_id = held.content_id, held.parent_content_id
        block.parent_hash = held.parent_hash
        if self.events is not None and held.hash not in self.hash_to_block:
            self._stored(held.hash, held.parent_hash, held.token_ids, None, MEDIUM_GPU)
        self.hash_to_block[held.hash] = block.block_id
        self.transfers.append((RESTORE, held.slot, block.block_id))
        self.num_restored += 1
        return block

    # ---- internals ----------------------------------------------------------------

    def _lookup(self, h: int, tokens: tuple[int, ...],
                parent_content_id: int | None) -> Block | None:
        """The registered block holding KV of exactly the prefix that ends in `tokens` and
        hashes to `h` (block_hash), or None; `parent_content_id`: the previous block's
        content_id (block 0: _root's).

        The hash finds a candidate; its stored tokens and its parent's content_id prove it.
        """
        block_id = self.hash_to_block.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tokens or block.parent_content_id != parent_content_id:
            return None  # hash collision
        return block

    def _take_fresh_block(self) -> int:
        """Pop the oldest free block and forget what it held: it is about to be overwritten
        (with a host tier, its KV was saved when it was freed)."""
        if not self.free_block_ids and self._saving:
            block_id = self._take_saving()
        else:
            block_id, _ = self.free_block_ids.popitem(last=False)  # KeyError if none: caller checks
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
            if self.events is not None:
                self._removed(block.hash, MEDIUM_GPU)
        block.reset()
        block.ref_count = 1
        return block_id

    # ---- KV events ----------------------------------------------------------------

    def _stored(self, h: int, parent: int | None, tokens: tuple[int, ...], lora_id: int | None,
                medium: str) -> None:
        """BlockStored for one block, merged into the previous event when it continues its
        chain on the same medium (vLLM sends a prefill's new blocks as one event)."""
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStored) and last.medium == medium and parent is not None
                and last.block_hashes[-1] == parent):
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
            return
        self.events.append(BlockStored([h], parent, list(tokens), self.block_size, lora_id,
                                       medium))

    def _removed(self, h: int, medium: str) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(h)
        else:
            self.events.append(BlockRemoved([h], medium))
