"""BlockManager unit tests: placement at block boundaries, prefix-cache hits, commit rules."""
import struct

import pytest
import xxhash

from scheduler_service import block_manager as bm_module
from scheduler_service.block_manager import BlockManager, compute_hash
from scheduler_service.sequence import SamplingOptions, Sequence, SequenceStatus

_ids = iter(range(10**9))


def make_seq(tokens) -> Sequence:
    return Sequence(next(_ids), list(tokens))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What a step does to the KV: every token computed, then the scheduler commits."""
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


# ---- Sequence ---------------------------------------------------------------------


def test_sequence_basics():
    prompt = [5, 6, 7]
    seq = Sequence(3, prompt)
    seq.append_token(8, -0.5)
    seq.append_token(9)
    assert prompt == [5, 6, 7]  # the caller's list is copied, not appended to
    assert seq.num_prompt_tokens == 3 and seq.num_tokens == 5
    assert seq.num_completion_tokens == 2 and seq.completion_token_ids == [8, 9]
    assert seq.last_token == 9 and seq.logprobs == [-0.5]
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert seq.sampling == SamplingOptions()
    assert Sequence(1, [1]) != Sequence(1, [1])  # identity, not value, equality


@pytest.mark.parametrize("n, bs, blocks", [(1, 1, 1), (3, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2),
                                           (9, 4, 3), (7, 1, 7), (16, 16, 1), (17, 16, 2)])
def test_sequence_num_blocks(n, bs, blocks):
    seq = make_seq(range(n))
    assert seq.num_blocks(bs) == blocks
    assert [t for i in range(blocks) for t in seq.block_tokens(i, bs)] == list(range(n))
    assert seq.block_tokens(blocks - 1, bs) == list(range((blocks - 1) * bs, n))


# ---- hashing ----------------------------------------------------------------------


def test_hash_is_chained_xxhash64_over_le_bytes():
    first = xxhash.xxh64(struct.pack("<4i", 1, 2, 3, 4)).intdigest()
    assert compute_hash((1, 2, 3, 4), None) == first
    second = xxhash.xxh64(first.to_bytes(8, "little") + struct.pack("<2i", 5, 70000)).intdigest()
    assert compute_hash((5, 70000), first) == second
    assert compute_hash((5, 70000), None) != second  # the prefix is part of the key


# ---- allocate / can_allocate ------------------------------------------------------


def test_init_and_bad_args():
    bm = BlockManager(5, 3)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 0)
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


@pytest.mark.parametrize("n, expected_blocks", [(1, 1), (3, 1), (4, 1), (5, 2), (7, 2), (8, 2), (9, 3)])
def test_allocate_block_boundaries(n, expected_blocks):
    bm = BlockManager(10, 4)
    seq = make_seq(range(n))
    bm.allocate(seq)
    assert seq.block_table == list(range(expected_blocks))  # FIFO: lowest ids first
    assert (seq.num_cached_tokens, seq.num_computed_tokens, seq.num_hashed_blocks) == (0, 0, 0)
    assert bm.num_used_blocks == expected_blocks
    assert bm.num_free_blocks == 10 - expected_blocks
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert bm.hash_to_block == {}  # nothing computed yet, nothing registered


@pytest.mark.parametrize("n, free_needed", [(7, 2), (8, 2), (9, 3)])
def test_can_allocate_exact(n, free_needed):
    bm = BlockManager(free_needed + 1, 4)
    bm.allocate(make_seq([99]))  # leave exactly `free_needed` free
    assert bm.can_allocate(make_seq(range(n)))
    bm.allocate(make_seq([98]))
    assert not bm.can_allocate(make_seq(range(n)))


def test_allocate_twice_is_a_bug():
    bm = BlockManager(4, 2)
    seq = make_seq([1, 2, 3])
    bm.allocate(seq)
    with pytest.raises(AssertionError):
        bm.allocate(seq)


# ---- can_append / may_append ------------------------------------------------------


@pytest.mark.parametrize("prompt_len, needs_block", [(3, False), (4, True), (5, False), (7, False),
                                                     (8, True), (9, False)])
def test_append_block_boundaries(prompt_len, needs_block):
    """After sampling, the new token at position prompt_len needs a block iff prompt_len % bs == 0."""
    bs = 4
    total = (prompt_len + bs - 1) // bs
    bm = BlockManager(total, bs)  # exactly enough for the prompt: no free block left
    seq = make_seq(range(prompt_len))
    bm.allocate(seq)
    compute_all(bm, seq)
    seq.append_token(100)
    assert bm.can_append(seq) == (not needs_block)

    bm2 = BlockManager(total + 1, bs)  # one spare block
    seq2 = make_seq(range(prompt_len))
    bm2.allocate(seq2)
    compute_all(bm2, seq2)
    seq2.append_token(100)
    assert bm2.can_append(seq2)
    bm2.may_append(seq2)
    assert len(seq2.block_table) == total + needs_block == seq2.num_blocks(bs)
    assert bm2.num_free_blocks == 1 - needs_block
    bm2.may_append(seq2)  # idempotent: the token already has its block
    assert len(seq2.block_table) == total + needs_block


def test_block_size_one():
    bm = BlockManager(6, 1)
    seq = make_seq([7, 8])
    bm.allocate(seq)
    assert seq.block_table == [0, 1]
    compute_all(bm, seq)
    seq.append_token(9)
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert seq.block_table == [0, 1, 2]
    other = make_seq([7, 8, 9, 1])
    bm.allocate(other)  # hits [7], [8]; [9] is not computed yet; [1] is the last token
    assert other.block_table == [0, 1, 3, 4] and other.num_cached_tokens == 2
    assert bm.num_free_blocks == 1


# ---- prefix caching ---------------------------------------------------------------


def test_shared_prefix_hits_and_ref_counts():
    bm = BlockManager(10, 4)
    a = make_seq(range(10))  # blocks [0..3] [4..7] [8, 9]
    bm.allocate(a)
    compute_all(bm, a)
    assert a.num_hashed_blocks == 2 and len(bm.hash_to_block) == 2
    b = make_seq(list(range(8)) + [100, 101])
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert (b.num_cached_tokens, b.num_computed_tokens, b.num_hashed_blocks) == (8, 8, 2)
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_used_blocks == 4
    c = make_seq(list(range(4)) + [50, 51, 52, 53, 54])  # diverges in block 1
    bm.allocate(c)
    assert c.block_table == [0, 4, 5] and c.num_cached_tokens == 4
    assert bm.blocks[0].ref_count == 3
    bm.deallocate(b)
    assert [bm.blocks[i].ref_count for i in range(6)] == [2, 1, 1, 0, 1, 1]
    assert 3 in bm.free_block_ids and 1 not in bm.free_block_ids


@pytest.mark.parametrize("n, cached", [(4, 0), (5, 4), (7, 4), (8, 4), (9, 8), (12, 8), (13, 12)])
def test_last_token_is_never_cached(n, cached):
    """Only blocks ending at or before num_tokens - 1 may hit, even if all are registered."""
    bm = BlockManager(20, 4)
    a = make_seq(range(16))
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq(range(n))
    bm.allocate(b)
    assert b.num_cached_tokens == b.num_computed_tokens == cached
    assert b.num_hashed_blocks == cached // 4
    assert b.num_computed_tokens < b.num_tokens  # at least one token left to compute


def test_freed_hashed_blocks_are_reused_then_evicted_fifo():
    bm = BlockManager(6, 2)
    a = make_seq([1, 2, 3, 4, 5])  # blocks 0:[1,2] 1:[3,4] 2:[5]
    bm.allocate(a)
    compute_all(bm, a)
    bm.deallocate(a)
    assert a.block_table == [] and (a.num_cached_tokens, a.num_computed_tokens, a.num_hashed_blocks) == (0, 0, 0)
    assert bm.num_free_blocks == 6
    assert list(bm.free_block_ids) == [3, 4, 5, 2, 1, 0]  # never-used first, then a's tail first
    assert len(bm.hash_to_block) == 2  # freed blocks keep their hashes

    b = make_seq([1, 2, 3, 4, 9])
    bm.allocate(b)  # takes 0 and 1 back out of the free list, a fresh block for [9]
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 4
    assert bm.blocks[0].ref_count == bm.blocks[1].ref_count == 1
    assert list(bm.free_block_ids) == [4, 5, 2]
    bm.deallocate(b)  # free: 4 5 2 3 1 0

    filler = make_seq(range(100, 108))  # 4 fresh blocks: 4, 5, 2, 3
    bm.allocate(filler)
    assert filler.block_table == [4, 5, 2, 3]
    assert len(bm.hash_to_block) == 2  # 0 and 1 not reused yet
    filler2 = make_seq([200, 201])
    bm.allocate(filler2)  # reuses block 1 ([3, 4]): its hash is evicted
    assert filler2.block_table == [1]
    assert list(bm.hash_to_block.values()) == [0]
    bm.deallocate(filler)
    c = make_seq([1, 2, 3, 4, 9])
    bm.allocate(c)
    assert c.block_table == [0, 3, 2] and c.num_cached_tokens == 2  # [1,2] hit, [3,4] gone


def test_eviction_leaves_a_twins_entry_alone():
    """Two blocks registered under one hash: reusing the older must not unregister the newer."""
    bm = BlockManager(8, 2)
    a, b = make_seq([1, 2, 3]), make_seq([1, 2, 4])  # both allocated before either computed
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1] and b.block_table == [2, 3] and b.num_cached_tokens == 0
    compute_all(bm, a)
    compute_all(bm, b)
    h = compute_hash((1, 2), None)
    assert bm.hash_to_block == {h: 2}  # the newest registration wins
    assert bm.blocks[0].content_id == bm.blocks[2].content_id  # same KV, same content id
    bm.deallocate(a)
    fresh = make_seq(range(100, 112))  # uses every free block, block 0 included
    bm.allocate(fresh)
    assert 0 in fresh.block_table
    assert bm.hash_to_block == {h: 2}
    c = make_seq([1, 2, 5])
    bm.deallocate(fresh)
    bm.allocate(c)
    assert c.block_table[0] == 2 and bm.blocks[2].ref_count == 2


def test_twins_share_content_so_a_child_of_either_hits():
    """A's tail block was registered under A's copy of the prefix; the table holds B's copy."""
    bm = BlockManager(12, 2)
    a, b = make_seq([1, 2, 3, 4, 5]), make_seq([1, 2, 3, 4, 6])
    bm.allocate(a)
    bm.allocate(b)
    compute_all(bm, a)
    compute_all(bm, b)  # table now points at b's blocks for [1,2] and [3,4]
    for t in (7, 8):
        a.append_token(t)
        bm.may_append(a)
    compute_all(bm, a)  # registers a's [5, 7] (parent: a's [3,4])
    c = make_seq([1, 2, 3, 4, 5, 7, 8, 9])
    bm.allocate(c)
    assert c.block_table[:3] == [b.block_table[0], b.block_table[1], a.block_table[2]]
    assert c.num_cached_tokens == 6


def test_collision_with_different_tokens_is_not_reused(monkeypatch):
    monkeypatch.setattr(bm_module, "compute_hash", lambda tokens, prefix: 42)
    bm = BlockManager(8, 4)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.hash_to_block == {42: 0}
    b = make_seq([9, 9, 9, 9, 5])  # same hash, different tokens
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table == [2, 3]
    assert bm.blocks[0].ref_count == 1
    same = make_seq([1, 2, 3, 4, 6])  # a true match still hits under the constant hash
    bm.allocate(same)
    assert same.block_table[0] == 0 and same.num_cached_tokens == 4


def test_collision_with_same_tokens_but_different_prefix_is_not_reused(monkeypatch):
    """Block [5,6,7,8] computed after [1,2,3,4] holds different KV than [5,6,7,8] at the start."""
    monkeypatch.setattr(bm_module, "compute_hash", lambda tokens, prefix: 42)
    bm = BlockManager(8, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.hash_to_block == {42: 1}  # a's block [5,6,7,8] is the entry
    b = make_seq([5, 6, 7, 8, 0])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and 1 not in b.block_table
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])  # block 0's candidate is a's block 1: wrong parent
    bm.allocate(c)
    assert c.num_cached_tokens == 0


def test_commit_only_after_compute():
    """A chunked prefill's blocks are not hits until their KV is computed."""
    bm = BlockManager(10, 4)
    a = make_seq(range(12))
    bm.allocate(a)
    bm.commit(a)
    assert bm.hash_to_block == {} and a.num_hashed_blocks == 0
    a.num_computed_tokens = 6  # first chunk: block 0 full, block 1 half done
    bm.commit(a)
    assert a.num_hashed_blocks == 1 and list(bm.hash_to_block.values()) == [0]
    b = make_seq(range(13))
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == 0 and 1 not in b.block_table
    a.num_computed_tokens = 12
    bm.commit(a)
    assert a.num_hashed_blocks == 3 and len(bm.hash_to_block) == 3
    bm.commit(a)  # idempotent
    assert a.num_hashed_blocks == 3 and len(bm.hash_to_block) == 3


def test_commit_registers_decoded_blocks():
    bm = BlockManager(6, 2)
    a = make_seq([1, 2, 3])
    bm.allocate(a)
    a.num_computed_tokens = 3
    bm.commit(a)
    assert a.num_hashed_blocks == 1
    a.append_token(4)  # decode: token 3 computed next step fills block 1
    bm.may_append(a)
    a.num_computed_tokens = 4
    bm.commit(a)
    assert a.num_hashed_blocks == 2
    key = compute_hash((3, 4), compute_hash((1, 2), None))
    assert bm.hash_to_block[key] == a.block_table[1]


def test_deallocate_releases_in_reverse_and_keeps_shared_blocks():
    bm = BlockManager(6, 2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq([1, 2, 3, 4, 6])
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    bm.deallocate(a)
    assert bm.blocks[0].ref_count == 1 and bm.blocks[1].ref_count == 1
    assert list(bm.free_block_ids) == [4, 5, 2]
    bm.deallocate(b)
    assert list(bm.free_block_ids) == [4, 5, 2, 3, 1, 0]
    assert bm.num_used_blocks == 0
    assert all(block.ref_count == 0 for block in bm.blocks)
