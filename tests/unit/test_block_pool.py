"""BlockPool: exact block ids on a 10-block pool (vLLM style) and a Hypothesis state machine.

Every scenario ends with ``check_invariants()`` (STYLE.md rule 7).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block_pool import BlockEvent, BlockEventKind, BlockPool

STORED, REMOVED = BlockEventKind.STORED, BlockEventKind.REMOVED


def h(i: int) -> bytes:
    """A fake 16-byte block hash."""
    return i.to_bytes(16, "little")


@pytest.fixture
def pool():
    pool = BlockPool(10)
    yield pool
    pool.check_invariants()


def free_all(pool: BlockPool, *requests: list[int]) -> None:
    for blocks in requests:
        pool.free(reversed(blocks))
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


# ---- allocation and free order --------------------------------------------------------------
def test_fresh_pool_is_all_free(pool):
    assert pool.num_free_blocks == 10
    assert pool.usage == 0.0
    assert [pool.ref_count(b) for b in range(10)] == [0] * 10
    assert pool.take_events() == []


def test_allocation_order_is_ascending_from_a_fresh_pool(pool):
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(0.5)
    free_all(pool, [0, 1, 2], [3, 4])


def test_freed_blocks_go_to_the_tail_in_the_order_given(pool):
    a = pool.allocate(3)  # [0, 1, 2]
    pool.free(reversed(a))  # tail first: 2, 1, 0
    assert pool.allocate(10) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    free_all(pool, list(range(10)))


def test_allocate_zero_and_too_many(pool):
    assert pool.allocate(0) == []
    with pytest.raises(RuntimeError, match="free blocks"):
        pool.allocate(11)
    blocks = pool.allocate(10)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    assert pool.num_free_blocks == 0
    free_all(pool, blocks)


def test_double_free_raises_and_leaves_the_pool_consistent(pool):
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([b])
    assert pool.ref_count(b) == 0
    assert pool.num_free_blocks == 10


def test_free_of_never_allocated_block_raises(pool):
    with pytest.raises(RuntimeError, match="double free of block 7"):
        pool.free([7])


def test_invalid_pool_size():
    with pytest.raises(ValueError):
        BlockPool(0)


# ---- prefix cache ---------------------------------------------------------------------------
def test_commit_and_lookup(pool):
    blocks = pool.allocate(3)  # [0, 1, 2]
    assert pool.commit(0, h(10)) is True
    assert pool.commit(1, h(11)) is True
    assert pool.lookup(h(10)) == 0
    assert pool.lookup(h(11)) == 1
    assert pool.lookup(h(12)) is None
    assert pool.block_hash(0) == h(10) and pool.block_hash(2) is None
    assert pool.longest_cached_prefix([h(10), h(11), h(12)]) == [0, 1]
    assert pool.longest_cached_prefix([h(10), h(12), h(11)]) == [0]  # a gap ends the prefix
    assert pool.longest_cached_prefix([h(12), h(10)]) == []
    assert pool.take_events() == [BlockEvent(STORED, h(10), 0), BlockEvent(STORED, h(11), 1)]
    assert pool.take_events() == []  # taking drains
    free_all(pool, blocks)


def test_duplicate_hash_commit_is_refused(pool):
    blocks = pool.allocate(2)
    assert pool.commit(0, h(1)) is True
    assert pool.commit(1, h(1)) is False  # hash already held by block 0
    assert pool.commit(0, h(2)) is False  # block 0 already carries a hash
    assert pool.lookup(h(1)) == 0 and pool.lookup(h(2)) is None
    assert pool.block_hash(1) is None
    assert pool.take_events() == [BlockEvent(STORED, h(1), 0)]
    free_all(pool, blocks)


def test_commit_refused_when_caching_is_off():
    pool = BlockPool(10, enable_caching=False)
    blocks = pool.allocate(1)
    assert pool.commit(blocks[0], h(1)) is False
    assert pool.lookup(h(1)) is None
    assert pool.take_events() == []
    free_all(pool, blocks)


def test_freed_cached_blocks_become_evictable_and_plain_blocks_are_used_first(pool):
    a = pool.allocate(3)  # [0, 1, 2]
    pool.commit(0, h(0))
    pool.commit(1, h(1))
    pool.free(reversed(a))  # 2 -> plain free tail; 1, 0 -> evictable (LRU order 1, 0)
    assert pool.num_free_blocks == 10
    assert pool.lookup(h(0)) == 0 and pool.lookup(h(1)) == 1  # still cached while evictable
    pool.take_events()
    b = pool.allocate(8)  # plain free blocks first: 3..9 then the freed 2
    assert b == [3, 4, 5, 6, 7, 8, 9, 2]
    assert pool.take_events() == []  # nothing evicted yet
    c = pool.allocate(1)  # evicts the LRU cached block: the request's tail (1) before its head (0)
    assert c == [1]
    assert pool.take_events() == [BlockEvent(REMOVED, h(1), 1)]
    assert pool.lookup(h(1)) is None and pool.lookup(h(0)) == 0
    assert pool.block_hash(1) is None
    d = pool.allocate(1)
    assert d == [0]
    assert pool.take_events() == [BlockEvent(REMOVED, h(0), 0)]
    free_all(pool, b, c, d)


def test_evictable_lru_reuse_order(pool):
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(3)  # [3, 4, 5]
    for block_id in a + b:
        pool.commit(block_id, h(block_id))
    rest = pool.allocate(4)  # [6, 7, 8, 9]: the plain free queue is now empty
    pool.free(reversed(b))  # evictable: 5, 4, 3
    pool.free(reversed(a))  # evictable: 5, 4, 3, 2, 1, 0
    pool.take_events()
    assert pool.allocate(6) == [5, 4, 3, 2, 1, 0]
    assert pool.take_events() == [BlockEvent(REMOVED, h(i), i) for i in (5, 4, 3, 2, 1, 0)]
    free_all(pool, rest, [5, 4, 3, 2, 1, 0])


def test_touch_of_an_evictable_block_revives_it_and_refreshes_its_lru_position(pool):
    a = pool.allocate(3)  # [0, 1, 2]
    rest = pool.allocate(7)  # [3..9]
    for block_id in a:
        pool.commit(block_id, h(block_id))
    pool.free(reversed(a))  # evictable LRU order: 2, 1, 0
    assert pool.num_free_blocks == 3
    pool.touch([2])  # a prefix hit on the LRU block takes it off the evictable list
    assert pool.ref_count(2) == 1
    assert pool.num_free_blocks == 2
    pool.check_invariants()
    pool.free([2])  # back to the MRU end: 1, 0, 2
    assert pool.allocate(3) == [1, 0, 2]
    free_all(pool, rest, [1, 0, 2])


def test_touch_of_a_used_block_shares_it(pool):
    a = pool.allocate(2)
    pool.commit(0, h(0))
    pool.touch([0])
    assert pool.ref_count(0) == 2
    assert pool.num_free_blocks == 8
    pool.free([0])
    assert pool.ref_count(0) == 1
    assert pool.num_free_blocks == 8  # still held by its first owner
    free_all(pool, a)


def test_stored_on_commit_and_removed_on_eviction_for_reused_hash(pool):
    [b0] = pool.allocate(1)
    rest = pool.allocate(9)
    pool.commit(b0, h(7))
    pool.free([b0])
    [again] = pool.allocate(1)  # evicts block 0 (the only free one)
    assert again == 0
    assert pool.commit(again, h(8)) is True  # re-published under a new hash
    assert pool.take_events() == [
        BlockEvent(STORED, h(7), 0),
        BlockEvent(REMOVED, h(7), 0),
        BlockEvent(STORED, h(8), 0),
    ]
    free_all(pool, rest, [again])


def test_reset_prefix_cache_forgets_evictable_blocks_only(pool):
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    for block_id in a + b:
        pool.commit(block_id, h(block_id))
    pool.free(reversed(a))  # 0 and 1 evictable; 2 and 3 in use
    pool.take_events()
    pool.reset_prefix_cache()
    assert pool.take_events() == [BlockEvent(REMOVED, h(1), 1), BlockEvent(REMOVED, h(0), 0)]
    assert pool.lookup(h(0)) is None and pool.lookup(h(1)) is None
    assert pool.lookup(h(2)) == 2 and pool.lookup(h(3)) == 3  # used blocks keep their hashes
    assert pool.num_free_blocks == 8
    pool.check_invariants()
    assert pool.allocate(8) == [4, 5, 6, 7, 8, 9, 1, 0]  # forgotten blocks are plain free, at the tail
    free_all(pool, b, [4, 5, 6, 7, 8, 9, 1, 0])


def test_reset_prefix_cache_on_an_empty_cache_is_a_no_op(pool):
    pool.reset_prefix_cache()
    assert pool.take_events() == []
    assert pool.allocate(10) == list(range(10))
    free_all(pool, list(range(10)))


def test_record_lookup_accumulates(pool):
    pool.record_lookup(3, 2)
    pool.record_lookup(4, 0)
    assert (pool.num_cache_queries, pool.num_cache_hits) == (7, 2)


def test_check_invariants_detects_a_corrupted_pool(pool):
    blocks = pool.allocate(1)
    pool._free.append(blocks[0])  # corrupt on purpose: a used block on the free list
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool._free.pop()
    free_all(pool, blocks)


# ---- property test --------------------------------------------------------------------------
NUM_BLOCKS = 10
HASHES = [h(i) for i in range(6)]  # few hashes, so duplicate commits happen often


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate/free/commit/touch/lookup sequences against a model of the ref counts."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.refs: Counter[int] = Counter()  # the model: references this test holds per block

    @rule(n=st.integers(min_value=0, max_value=NUM_BLOCKS))
    def allocate(self, n):
        if n > self.pool.num_free_blocks:
            with pytest.raises(RuntimeError):
                self.pool.allocate(n)
            return
        blocks = self.pool.allocate(n)
        assert len(set(blocks)) == n
        for block_id in blocks:
            assert self.refs[block_id] == 0, f"block {block_id} handed out while still referenced"
            assert self.pool.block_hash(block_id) is None, "a fresh block must carry no hash"
            self.refs[block_id] += 1

    @precondition(lambda self: +self.refs)
    @rule(data=st.data())
    def free(self, data):
        held = sorted(+self.refs)
        block_ids = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=len(held), unique=True))
        self.pool.free(block_ids)
        self.refs.subtract(block_ids)

    @rule(block_id=st.integers(min_value=0, max_value=NUM_BLOCKS - 1))
    def free_unheld_raises(self, block_id):
        if self.refs[block_id] == 0:
            with pytest.raises(RuntimeError):
                self.pool.free([block_id])

    @precondition(lambda self: +self.refs)
    @rule(data=st.data(), block_hash=st.sampled_from(HASHES))
    def commit(self, data, block_hash):
        block_id = data.draw(st.sampled_from(sorted(+self.refs)))
        expected = self.pool.lookup(block_hash) is None and self.pool.block_hash(block_id) is None
        assert self.pool.commit(block_id, block_hash) is expected
        if expected:
            assert self.pool.lookup(block_hash) == block_id

    @rule(block_hash=st.sampled_from(HASHES))
    def touch(self, block_hash):
        block_id = self.pool.lookup(block_hash)
        if block_id is None:
            return
        free_before = self.pool.num_free_blocks
        was_free = self.refs[block_id] == 0
        self.pool.touch([block_id])
        self.refs[block_id] += 1
        assert self.pool.num_free_blocks == free_before - (1 if was_free else 0)

    @rule(block_hash=st.sampled_from(HASHES))
    def lookup(self, block_hash):
        block_id = self.pool.lookup(block_hash)
        if block_id is not None:
            assert self.pool.block_hash(block_id) == block_hash
        assert self.pool.longest_cached_prefix([block_hash]) == ([] if block_id is None else [block_id])

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        for block_id in range(NUM_BLOCKS):
            if self.refs[block_id] == 0:
                assert self.pool.block_hash(block_id) is None

    @rule()
    def drain_events(self):
        for event in self.pool.take_events():
            assert 0 <= event.block_id < NUM_BLOCKS

    @invariant()
    def books_balance(self):
        self.pool.check_invariants()
        counts = [self.pool.ref_count(b) for b in range(NUM_BLOCKS)]
        assert all(c >= 0 for c in counts)
        assert counts == [self.refs[b] for b in range(NUM_BLOCKS)]
        used = sum(1 for c in counts if c > 0)
        assert self.pool.num_free_blocks + used == NUM_BLOCKS

    def teardown(self):
        for block_id, count in list(self.refs.items()):
            self.pool.free([block_id] * count)
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == NUM_BLOCKS
        assert all(self.pool.ref_count(b) == 0 for b in range(NUM_BLOCKS))


BlockPoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestBlockPoolMachine = BlockPoolMachine.TestCase
