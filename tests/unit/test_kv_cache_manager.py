"""KVCacheManager on a 10-block pool with block_size 4: exact block ids, prefix hits, no leaks."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.core.block_pool import BlockEvent, BlockEventKind
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BS = 4
FINGERPRINT = b"x" * 16


def make_manager(num_blocks: int = 10, *, caching: bool = True) -> KVCacheManager:
    config = CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=caching)
    return KVCacheManager(config, FINGERPRINT)


def make_request(request_id: str, prompt: list[int], cache_salt: str = "") -> Request:
    return Request(
        request_id=request_id, prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0, max_tokens=16), seed=0, cache_salt=cache_salt,
    )


@pytest.fixture
def kv():
    kv = make_manager()
    yield kv
    kv.pool.check_invariants()


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Pretend a step computed ``num_tokens`` more tokens, then publish full blocks (as the scheduler does)."""
    request.num_computed_tokens += num_tokens
    kv.commit(request)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit a waiting request the way the scheduler does: prefix hits, then slots for the rest."""
    hits = kv.get_computed_blocks(request)
    request.num_computed_tokens = 0
    new = kv.allocate_slots(request, request.num_tokens - len(hits) * BS, hits)
    assert new is not None
    request.num_computed_tokens = len(hits) * BS
    return hits


def free_all(kv: KVCacheManager, *requests: Request) -> None:
    for request in requests:
        kv.free(request)
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.num_requests() == 0


# ---- allocation -----------------------------------------------------------------------------
def test_blocks_needed():
    kv = make_manager()
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_slots_grows_one_block_at_a_time(kv):
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    compute(kv, req, 10)
    req.append_output_token(100)  # 11 tokens
    assert kv.allocate_slots(req, 1) == []  # token 11 fits in block 2
    compute(kv, req, 1)
    req.append_output_token(101)  # 12 tokens
    assert kv.allocate_slots(req, 1) == []
    compute(kv, req, 1)
    req.append_output_token(102)  # 13 tokens: a fourth block
    assert kv.allocate_slots(req, 1) == [3]
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert [kv.pool.ref_count(b) for b in range(5)] == [1, 1, 1, 1, 0]
    free_all(kv, req)


def test_allocate_slots_in_chunks(kv):
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 4) == [0]
    compute(kv, req, 4)
    assert kv.allocate_slots(req, 4) == [1]
    compute(kv, req, 4)
    assert kv.allocate_slots(req, 2) == [2]
    assert kv.block_ids("a") == [0, 1, 2]
    free_all(kv, req)


def test_allocate_slots_returns_none_when_out_of_blocks_and_leaks_nothing(kv):
    big = make_request("big", list(range(32)))
    assert kv.allocate_slots(big, 32) == [0, 1, 2, 3, 4, 5, 6, 7]
    small = make_request("small", list(range(100, 112)))  # needs 3 blocks, 2 are free
    assert kv.allocate_slots(small, 12) is None
    assert kv.block_ids("small") == []
    assert kv.num_requests() == 1
    assert kv.pool.num_free_blocks == 2
    kv.pool.check_invariants()
    assert kv.allocate_slots(small, 8) == [8, 9]  # a smaller chunk still fits
    free_all(kv, big, small)


def test_growth_refused_keeps_the_existing_blocks(kv):
    a = make_request("a", list(range(36)))
    assert kv.allocate_slots(a, 36) == list(range(9))
    b = make_request("b", [7, 7, 7, 7])
    assert kv.allocate_slots(b, 4) == [9]
    compute(kv, a, 36)
    a.append_output_token(1)  # 37 tokens: a tenth block is needed, none is free
    assert kv.allocate_slots(a, 1) is None
    assert kv.block_ids("a") == list(range(9))
    assert kv.num_requests() == 2
    free_all(kv, a, b)


def test_free_returns_blocks_tail_first(kv):
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)  # [0, 1, 2], nothing committed
    kv.free(a)
    assert kv.block_ids("a") == []
    assert kv.pool.num_free_blocks == 10
    b = make_request("b", list(range(40)))
    assert kv.allocate_slots(b, 40) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    free_all(kv, b)


def test_free_of_an_unknown_request_is_a_no_op(kv):
    kv.free(make_request("nobody", [1]))
    assert kv.pool.num_free_blocks == 10


# ---- prefix cache ---------------------------------------------------------------------------
def test_commit_follows_num_computed_tokens(kv):
    req = make_request("a", list(range(10)))
    kv.allocate_slots(req, 10)  # [0, 1, 2]
    kv.commit(req)  # nothing computed yet: nothing published
    assert kv.pool.take_events() == []
    compute(kv, req, 3)  # block 0 is not full of computed tokens yet
    assert kv.pool.take_events() == []
    compute(kv, req, 1)
    compute(kv, req, 4)
    compute(kv, req, 2)  # 10 computed: two full blocks; the partial third is never published
    events = kv.pool.take_events()
    assert events == [
        BlockEvent(BlockEventKind.STORED, req.block_hashes[0], 0),
        BlockEvent(BlockEventKind.STORED, req.block_hashes[1], 1),
    ]
    assert kv.pool.lookup(req.block_hashes[0]) == 0
    assert kv.pool.block_hash(2) is None
    kv.commit(req)  # idempotent
    assert kv.pool.take_events() == []
    free_all(kv, req)


def test_prefix_hit_shares_exact_blocks(kv):
    prompt = list(range(10))
    a = make_request("a", prompt)
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    compute(kv, a, 10)
    b = make_request("b", prompt)
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert kv.pool.ref_count(0) == 1  # get_computed_blocks does not take a reference
    assert kv.allocate_slots(b, 10 - 8, hits) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.ref_count(x) for x in range(4)] == [2, 2, 1, 1]
    assert (kv.pool.num_cache_queries, kv.pool.num_cache_hits) == (0, 0)  # counted once, on admission
    kv.record_prefix_lookup(b, len(hits))
    assert (kv.pool.num_cache_queries, kv.pool.num_cache_hits) == (2, 2)
    kv.free(a)
    assert [kv.pool.ref_count(x) for x in range(4)] == [1, 1, 0, 1]
    assert kv.pool.num_free_blocks == 7
    free_all(kv, b)


def test_prompt_of_exactly_n_full_blocks_hits_n_minus_one(kv):
    prompt = list(range(8))
    a = make_request("a", prompt)
    assert kv.allocate_slots(a, 8) == [0, 1]
    compute(kv, a, 8)
    assert kv.pool.lookup(a.block_hashes[1]) == 1  # both blocks are cached
    b = make_request("b", prompt)
    hits = kv.get_computed_blocks(b)
    assert hits == [0]  # the last token is always recomputed, so block 1 is not a hit
    assert kv.allocate_slots(b, 4, hits) == [2]
    assert kv.block_ids("b") == [0, 2]
    compute(kv, b, 8)  # the duplicate of block 1 cannot be published under the same hash
    assert kv.pool.block_hash(2) is None
    assert kv.pool.lookup(b.block_hashes[1]) == 1
    free_all(kv, a, b)


def test_one_token_prompt_never_hits(kv):
    a = make_request("a", [5])
    kv.allocate_slots(a, 1)
    compute(kv, a, 1)
    assert kv.get_computed_blocks(make_request("b", [5])) == []
    free_all(kv, a)


def test_prefix_hit_stops_at_first_difference(kv):
    a = make_request("a", list(range(13)))
    assert kv.allocate_slots(a, 13) == [0, 1, 2, 3]
    compute(kv, a, 13)
    b = make_request("b", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])  # differs in block 1
    assert kv.get_computed_blocks(b) == [0]
    free_all(kv, a)


def test_cache_salt_isolates_tenants(kv):
    prompt = list(range(10))
    a = make_request("a", prompt, cache_salt="tenant-a")
    kv.allocate_slots(a, 10)
    compute(kv, a, 10)
    assert kv.get_computed_blocks(make_request("b", prompt, cache_salt="tenant-b")) == []
    assert kv.get_computed_blocks(make_request("c", prompt)) == []
    assert kv.get_computed_blocks(make_request("d", prompt, cache_salt="tenant-a")) == [0, 1]
    assert kv.root("tenant-a") != kv.root("tenant-b") != kv.root("")
    free_all(kv, a)


def test_hits_on_evictable_blocks_after_the_owner_finished(kv):
    prompt = list(range(10))
    a = make_request("a", prompt)
    kv.allocate_slots(a, 10)  # [0, 1, 2]
    compute(kv, a, 10)
    kv.free(a)  # 2 -> plain free; 1, 0 -> evictable
    b = make_request("b", prompt)
    assert admit(kv, b) == [0, 1]
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.num_free_blocks == 7
    free_all(kv, b)


def test_evictable_hits_count_against_free_blocks(kv):
    prompt = list(range(10))
    a = make_request("a", prompt)
    kv.allocate_slots(a, 10)  # [0, 1, 2]
    compute(kv, a, 10)
    kv.free(a)  # plain free: 3..9, 2; evictable: 1, 0
    filler = make_request("filler", list(range(100, 132)))
    assert kv.allocate_slots(filler, 32) == [3, 4, 5, 6, 7, 8, 9, 2]
    b = make_request("b", prompt)
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]  # both free blocks are these hits: nothing is left for b's third block
    assert kv.allocate_slots(b, 2, hits) is None
    assert kv.block_ids("b") == []
    assert [kv.pool.ref_count(x) for x in (0, 1)] == [0, 0]  # hits were not touched
    assert kv.pool.lookup(b.block_hashes[0]) == 0  # nor evicted
    assert all(e.kind is BlockEventKind.STORED for e in kv.pool.take_events())
    kv.pool.check_invariants()
    free_all(kv, filler)


def test_commit_after_a_prefix_hit_publishes_only_new_blocks(kv):
    a = make_request("a", list(range(10)))
    kv.allocate_slots(a, 10)
    compute(kv, a, 10)
    kv.pool.take_events()
    b = make_request("b", list(range(10)) + [10, 11, 12, 13, 14])  # same two blocks, then 1 more full + 3
    assert admit(kv, b) == [0, 1]
    assert kv.block_ids("b") == [0, 1, 3, 4]
    compute(kv, b, 15 - 8)
    assert kv.pool.take_events() == [BlockEvent(BlockEventKind.STORED, b.block_hashes[2], 3)]
    free_all(kv, a, b)


def test_caching_disabled():
    kv = make_manager(caching=False)
    prompt = list(range(10))
    a = make_request("a", prompt)
    kv.allocate_slots(a, 10)
    compute(kv, a, 10)
    assert kv.pool.take_events() == []
    assert kv.get_computed_blocks(make_request("b", prompt)) == []
    kv.free(a)
    assert kv.pool.allocate(10) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]  # all plain free, none cached
    kv.pool.check_invariants()
