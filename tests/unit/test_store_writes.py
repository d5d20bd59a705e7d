"""The store tier's engine side (issue 22, item 2), without a store: the write books on exact ids
(``StoreWrites``), the scheduler offering what leaves the worker (host-tier drops, pool evictions without a host
tier, commits under write-through) in the same copy batch as the copies that reuse those blocks, a remote
reservation loading the host tier's continuation, and two engines end to end: blocks one engine wrote to its
write slots, put in the other's read slots as the store would, decode greedy-exact against recomputing."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM
from engine.config import CacheConfig, SchedulerConfig
from engine.core.block_pool import TIER_HOST, TIER_POOL
from engine.core.host_tier import HostCopies
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import SampledTokens
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.store_writes import StoreCopy, StoreWrites
from engine.sampling_params import SamplingParams as Params

H = [bytes([i]) * 16 for i in range(16)]  # block hashes


# ---- the books -------------------------------------------------------------------------------
def test_offers_take_free_slots_and_become_ready_once_copied():
    books = StoreWrites(2, write_through=False)
    assert books.offer(H[0], TIER_HOST, 7) and books.offer(H[1], TIER_POOL, 3)
    assert not books.offer(H[2], TIER_POOL, 4)  # no free slot: dropped, never waited for
    assert not books.offer(H[0], TIER_POOL, 9)  # on its way already
    assert books.take_ready() == []  # not copied yet
    assert books.take_copies() == (StoreCopy(TIER_HOST, 7, 0), StoreCopy(TIER_POOL, 3, 1))
    assert books.take_ready() == [(H[0], 0), (H[1], 1)] and books.take_ready() == []
    books.written([0, 1], [H[0]])  # H[1]'s write failed: it may be offered again
    assert not books.offer(H[0], TIER_POOL, 5) and books.is_stored(H[0])
    assert books.offer(H[1], TIER_POOL, 6) and books.take_copies() == (StoreCopy(TIER_POOL, 6, 0),)
    assert (books.num_offered, books.num_dropped) == (4, 1)
    books.take_ready()
    books.written([0], [H[1]])
    books.forget([H[0]])  # the store lost it: written again when it next leaves the worker
    assert books.offer(H[0], TIER_HOST, 2)
    books.take_copies()
    books.check_invariants()


def test_what_the_store_is_known_to_hold_is_bounded():
    books = StoreWrites(1, write_through=False, remember=2)
    books.remember(H[:3])
    assert [books.is_stored(h) for h in H[:3]] == [False, True, True]


# ---- the scheduler offering what leaves the worker ------------------------------------------------
def _scheduler(num_blocks: int, host_blocks: int, slots: int = 8, through: bool = False) -> Scheduler:
    config = CacheConfig(block_size=4, num_blocks=num_blocks, num_host_blocks=host_blocks, num_store_slots=slots,
                         store_write_through=through)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                     KVCacheManager(config, b"x" * 16))


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=Params(temperature=0, max_tokens=1),
                   seed=0)


def _run(sched: Scheduler, request: Request) -> tuple[tuple[StoreCopy, ...], HostCopies]:
    """One step, as the engine takes its copies: the store's first, then the host tier's."""
    sched.add_request(request)
    out = sched.schedule()
    copies = sched.kv_cache.take_store_copies(), sched.kv_cache.take_host_copies()
    sched.update(out, SampledTokens([1] * sum(s.samples for s in out.seqs)))
    return copies


A, B, C = (list(range(base, base + 13)) for base in (100, 200, 300))  # 13 tokens: 3 full blocks + 1


def test_blocks_the_host_tier_drops_are_copied_out_before_their_host_blocks_are_reused():
    sched = _scheduler(num_blocks=4, host_blocks=3)
    _run(sched, _request("a", A))
    spills, host = _run(sched, _request("b", B))  # a's 3 cached blocks go down to host blocks 0-2
    assert spills == () and host.saves == ((2, 0), (1, 1), (0, 2))
    spills, host = _run(sched, _request("c", C))  # b's go down: the LRU drops a's, which go to the store
    assert host.saves == ((1, 0), (2, 1), (3, 2))
    assert spills == tuple(StoreCopy(TIER_HOST, h, slot) for slot, h in enumerate((0, 1, 2)))
    a_hashes = sched.kv_cache.prompt_hashes(A, "")
    assert sched.kv_cache.store.take_ready() == [(a_hashes[2], 0), (a_hashes[1], 1), (a_hashes[0], 2)]


def test_without_a_host_tier_the_pools_evictions_go_to_the_store():
    sched = _scheduler(num_blocks=4, host_blocks=0)
    _run(sched, _request("a", A))
    spills, _ = _run(sched, _request("b", B))
    assert spills == (StoreCopy(TIER_POOL, 2, 0), StoreCopy(TIER_POOL, 1, 1), StoreCopy(TIER_POOL, 0, 2))


def test_write_through_offers_each_block_as_it_commits_and_eviction_finds_it_written():
    sched = _scheduler(num_blocks=4, host_blocks=0, through=True)
    _run(sched, _request("a", A))  # committed in this step's update: copied with the next step's copies
    store = sched.kv_cache.store
    spills, _ = _run(sched, _request("b", B))  # b evicts a's blocks, which are on their way already
    assert spills == (StoreCopy(TIER_POOL, 0, 0), StoreCopy(TIER_POOL, 1, 1), StoreCopy(TIER_POOL, 2, 2))
    ready = store.take_ready()
    store.written([slot for _, slot in ready], [h for h, _ in ready])
    spills, _ = _run(sched, _request("c", C))  # b's blocks: committed last step, copied now; a's are stored
    assert [c.slot for c in spills] == [3, 4, 5]  # freed slots queue up last
    # three commits each of a, b and c; the evictions of a's and b's blocks found them on their way already
    assert store.num_offered == 9
    store.take_ready()


def test_a_remote_reservation_loads_its_host_tier_continuation():
    sched = _scheduler(num_blocks=7, host_blocks=8, slots=0)
    _run(sched, _request("a", A))
    _run(sched, _request("b", B + B))  # 26 tokens: all 7 blocks, evicting a's 3 cached ones into the host tier
    sched.kv_cache.take_host_copies()
    request = _request("r", A)
    num_hit, block_ids = sched.add_remote(request, len(A))
    assert num_hit == 3 and request.num_cached_tokens == 12
    assert sched.kv_cache.take_host_copies().loads == tuple(zip((2, 1, 0), block_ids[:3]))
    sched.fallback_remote("r")
    sched.kv_cache.pool.check_invariants()


# ---- two engines, the store played by hand ---------------------------------------------------------
def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


GREEDY = Params(temperature=0, max_tokens=6, ignore_eos=True)


def _finish(engine, rid: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for d in engine.step() if d.request_id == rid for t in d.new_token_ids]
    return tokens


@pytest.mark.parametrize("through", [False, True])
def test_blocks_written_by_one_engine_decode_exactly_on_another(tiny_checkpoints, through):
    checkpoint = tiny_checkpoints["llama"]
    prompts = _prompts(checkpoint.vocab_size, 4, 60, seed=5)  # 60 tokens: 14 reusable blocks of 4
    reference = LLM(str(checkpoint.path), num_blocks=64, block_size=4).engine
    expected = []
    for i, prompt in enumerate(prompts):
        reference.add_request(f"e{i}", prompt, GREEDY)
        expected.append(_finish(reference, f"e{i}"))
    writer = LLM(str(checkpoint.path), num_blocks=20, block_size=4, kv_host_blocks=8, kv_store_buffer_blocks=64,
                 kv_store_write="through" if through else "evict").engine
    store: dict[bytes, bytes] = {}
    for i, prompt in enumerate(prompts):  # each prompt evicts the one before from the pool and the host tier
        writer.add_request(f"w{i}", prompt, GREEDY)
        assert _finish(writer, f"w{i}") == expected[i]
        ready = writer.store.take_writes()
        store |= {h: bytes(writer.store.buffer.raw[slot, : writer.store.buffer.block_bytes]) for h, slot in ready}
        writer.store.written([slot for _, slot in ready], [h for h, _ in ready])
    reader = LLM(str(checkpoint.path), num_blocks=20, block_size=4, kv_store_buffer_blocks=16).engine
    num_local, hashes = reader.store.candidates(prompts[0], "")
    assert num_local == 0 and len(hashes) == 14 and set(hashes) <= set(store)  # prompt 0 left the writer
    slots = list(reader.store.read_slots)[: len(hashes)]
    for block_hash, slot in zip(hashes, slots):
        value = torch.frombuffer(bytearray(store[block_hash]), dtype=torch.uint8)
        reader.store.buffer.raw[slot, : len(value)] = value
    reservation = reader.add_prefix_request("s", prompts[0], [], GREEDY)
    assert reservation.num_local_blocks == 0 and list(reservation.block_hashes[:14]) == hashes
    reader.store.fill(slots, list(reservation.block_ids[:14]), hashes)
    reader.activate_prefix("s", 14 * 4)
    assert _finish(reader, "s") == expected[0]
    stats = reader.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert reader.store.candidates(prompts[0], "")[0] == 14  # now cached here
    assert reader.kv_cache_manager.store.is_stored(hashes[0])  # fetched: never written back
    writer.kv_cache_manager.store.check_invariants()


def test_write_through_copies_a_requests_blocks_out_in_the_step_that_computes_them(tiny_checkpoints):
    """A prefill (one token) that ends the engine's work: its blocks go out with its step, not with a next one."""
    checkpoint = tiny_checkpoints["llama"]
    engine = LLM(str(checkpoint.path), num_blocks=20, block_size=4, kv_store_buffer_blocks=16,
                 kv_store_write="through").engine
    prompt = _prompts(checkpoint.vocab_size, 1, 41, seed=6)[0]  # 10 full blocks
    engine.add_request("p", prompt, Params(temperature=0, max_tokens=1))
    engine.step()
    assert not engine.has_unfinished()
    ready = engine.store.take_writes()
    assert [h for h, _ in ready] == engine.kv_cache_manager.prompt_hashes(prompt, "")


def test_a_prefill_reservation_can_hold_its_blocks(tiny_checkpoints):
    engine = LLM(str(tiny_checkpoints["llama"].path), num_blocks=20, block_size=4, kv_store_buffer_blocks=4).engine
    prompt = list(range(10, 30))
    engine.add_prefix_request("p", prompt, [], Params(temperature=0, max_tokens=1), hold_blocks=True)
    engine.activate_prefix("p", 0)
    deltas = [d for _ in range(4) if engine.has_unfinished() for d in engine.step()]
    assert len(deltas[-1].held_block_ids) == 5
    engine.release_blocks(list(deltas[-1].held_block_ids))
    assert engine.stats().num_free_blocks == 20
