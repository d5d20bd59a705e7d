"""The host-memory tier below the KV pool (issue 22, item 1): its books on exact ids (``HostTier``), the scheduler
loading a prefix from it (``Scheduler`` + ``KVCacheManager``, no model), and the engine end to end on tiny
checkpoints: greedy output with hits served from host memory equals recomputing them, whatever evicts the pool
(steps, scoring, remote reservations)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.core.block_pool import TIER_HOST, TIER_POOL, BlockEvent, BlockEventKind
from engine.core.host_tier import HostCopies, HostTier
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import SampledTokens
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams as Params

STORED, REMOVED = BlockEventKind.STORED, BlockEventKind.REMOVED
H = [bytes([i]) * 16 for i in range(16)]  # block hashes


# ---- the books -------------------------------------------------------------------------------
def test_saves_take_free_blocks_then_the_least_recent_unpinned_one():
    host = HostTier(2)
    host.save(H[0], 7)
    host.save(H[1], 3)
    assert host.take_copies() == HostCopies(saves=((7, 0), (3, 1)))
    host.save(H[0], 5)  # held already: touched (now most recent), nothing copied
    host.save(H[2], 9)  # full: the least recent, H[1] in host block 1, makes room
    assert host.take_copies() == HostCopies(saves=((9, 1),))
    assert host.take_events() == [
        BlockEvent(STORED, H[0], 0, TIER_HOST), BlockEvent(STORED, H[1], 1, TIER_HOST),
        BlockEvent(REMOVED, H[1], 1, TIER_HOST), BlockEvent(STORED, H[2], 1, TIER_HOST),
    ]
    assert host.hashes() == [H[0], H[2]] and (host.num_saved, host.num_dropped) == (3, 1)
    host.check_invariants()


def test_pinned_blocks_are_never_handed_out_twice_in_one_batch():
    host = HostTier(2)
    host.save(H[0], 1)
    host.save(H[1], 2)
    host.take_copies()
    pinned = host.prefix([H[0], H[1], H[5]])  # a request's hit: H[0], H[1] (H[5] is not held)
    assert pinned == [0, 1]
    host.pin(pinned)
    host.save(H[2], 4)  # every block pinned: dropped, as without a host tier
    assert host.take_copies() == HostCopies() and H[2] not in host.hashes()
    host.pin(pinned)
    host.unpin([0])  # the hit gave up block 0 (its request could not be admitted)
    host.save(H[3], 6)
    host.load([1], [8])
    assert host.take_copies() == HostCopies(saves=((6, 0),), loads=((1, 8),))
    host.check_invariants()


def test_a_save_keeps_its_block_through_a_failed_hit_on_it():
    """Pin counts: a block pinned by a queued save stays pinned when a hit on it is given up."""
    host = HostTier(2)
    host.save(H[0], 1)  # queued, pinned
    host.pin(host.prefix([H[0]]))
    host.unpin([0])
    host.save(H[1], 2)
    host.save(H[2], 3)  # must not take block 0, whose save is still queued
    assert host.take_copies() == HostCopies(saves=((1, 0), (2, 1)))


def test_no_hits_when_loading_is_not_worth_it():
    host = HostTier(1)
    host.save(H[0], 1)
    host.take_copies()
    host.worth_loading = False
    assert host.prefix([H[0]]) == []


# ---- the scheduler loading from it ----------------------------------------------------------------
def _scheduler(num_blocks: int, host_blocks: int) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks, num_host_blocks=host_blocks), b"x" * 16)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=Params(temperature=0, max_tokens=1),
                   seed=0)


def _run(sched: Scheduler, request: Request):
    sched.add_request(request)
    out = sched.schedule()
    copies = sched.kv_cache.take_host_copies()
    sched.update(out, SampledTokens([1] * sum(s.samples for s in out.seqs)))
    return out, copies


def test_an_evicted_prefix_comes_back_from_the_host_tier():
    sched = _scheduler(num_blocks=4, host_blocks=8)
    a, b = list(range(100, 113)), list(range(200, 213))  # 13 tokens: 3 full blocks + 1
    out, copies = _run(sched, _request("a", a))
    assert out.seqs[0].block_ids == (0, 1, 2, 3) and not copies
    out, copies = _run(sched, _request("b", b))  # evicts a's cached blocks 0, 1, 2 (tail first: 2, 1, 0)
    assert copies.saves == ((2, 0), (1, 1), (0, 2)) and not copies.loads
    out, copies = _run(sched, _request("a2", a))  # a's prefix: 3 blocks in host memory, none in the pool
    seq = out.seqs[0]
    assert (seq.start, seq.num_new_tokens) == (12, 1) and seq.request.num_cached_tokens == 12
    assert copies.loads == tuple(zip((2, 1, 0), seq.block_ids[:3]))  # host blocks of a's 1st, 2nd, 3rd block
    # b's cached blocks 1, 2, 3 (b's partial last block 0 was plain free), evicted to make room, go down first
    assert copies.saves == ((1, 3), (2, 4), (3, 5)) and seq.block_ids == (0, 1, 2, 3)
    sched.kv_cache.pool.check_invariants()
    sched.kv_cache.host.check_invariants()
    assert sched.stats().host_tier_loaded == 3 and sched.stats().prefix_cache_hits == 3


def test_the_pools_own_evictions_never_take_the_host_blocks_a_hit_loads():
    """Host tier of 3 blocks, all held by a's prefix; admitting a again evicts b's blocks, whose saves find
    every host block pinned by the hit and are dropped (a's bytes are not overwritten before they load)."""
    sched = _scheduler(num_blocks=4, host_blocks=3)
    a, b = list(range(100, 113)), list(range(200, 213))
    _run(sched, _request("a", a))
    _run(sched, _request("b", b))
    _, copies = _run(sched, _request("a2", a))
    assert [h for h, _ in copies.loads] == [2, 1, 0] and copies.saves == ()
    assert sched.kv_cache.host.hashes() == sched.kv_cache.prompt_hashes(a, "")[2::-1][::-1]


# ---- the engine end to end ------------------------------------------------------------------------
def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _one_by_one(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("name", ["llama", "mistral-swa", "qwen3"])
def test_greedy_output_with_host_hits_equals_recompute(tiny_checkpoints, name):
    """Six 60-token prompts through a pool of 10 blocks: each evicts the one before; the second round finds
    each prompt's prefix only in the host tier (a small one: 16 blocks, so its own LRU turns over too)."""
    checkpoint = tiny_checkpoints[name]
    prompts = _prompts(checkpoint.vocab_size, 6, 60, seed=1)
    expected = _one_by_one(LLM(str(checkpoint.path), num_blocks=64), prompts)
    llm = LLM(str(checkpoint.path), num_blocks=10, kv_host_blocks=16)
    assert _one_by_one(llm, prompts) == expected
    hits = llm.engine.stats().prefix_cache_hits
    assert _one_by_one(llm, prompts[3:]) == expected[3:]  # the last three still fit the host tier
    stats = llm.engine.stats()
    if llm.engine.scheduler.config.sliding_window is None:
        # each hit its whole 3-block prefix: the newest from the pool, the two before it from host memory
        assert stats.prefix_cache_hits - hits == 9 and stats.host_tier_loaded == 6
    else:  # Mistral frees blocks out of its window as it runs: other blocks are evicted when, but hits still load
        assert stats.prefix_cache_hits - hits >= 6 and stats.host_tier_loaded >= 6
    assert stats.host_tier_saved > 16  # the host tier's own LRU turned over
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.engine.kv_cache_manager.host.check_invariants()


def test_scoring_and_remote_reservations_save_what_they_evict_before_writing(tiny_checkpoints):
    """Blocks evicted by a scoring pass's scratch blocks and by a remote reservation (whose pull would write
    them) reach the host tier with their bytes; the prompts they held then decode exactly from there."""
    checkpoint = tiny_checkpoints["llama"]
    prompts = _prompts(checkpoint.vocab_size, 3, 60, seed=2)
    expected = _one_by_one(LLM(str(checkpoint.path), num_blocks=64), prompts)
    llm = LLM(str(checkpoint.path), num_blocks=10, kv_host_blocks=32)
    engine = llm.engine
    _one_by_one(llm, prompts[:1])
    engine.prompt_logits(prompts[2] + prompts[1] + prompts[2][:30])  # 10 scratch blocks: the whole pool
    assert engine.stats().host_tier_saved == 4  # prompt 0's cached blocks (60 prompt + 6 output tokens)
    assert _one_by_one(llm, prompts[:1]) == expected[:1] and engine.stats().host_tier_loaded == 3
    _one_by_one(llm, prompts[1:2])
    saved = engine.stats().host_tier_saved
    reserved = engine.add_remote_request("r", prompts[2] + prompts[0], [5], Params(temperature=0, max_tokens=2))
    assert reserved is not None and engine.stats().host_tier_saved > saved  # evicted prompt 1's last blocks
    engine.fallback_remote("r")  # nothing was pulled into them: recompute
    while engine.has_unfinished():
        engine.step()
    loaded = engine.stats().host_tier_loaded
    assert _one_by_one(llm, prompts[1:2]) == expected[1:2] and engine.stats().host_tier_loaded > loaded
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_host_tier_events_name_their_tier(tiny_checkpoints):
    checkpoint = tiny_checkpoints["llama"]
    llm = LLM(str(checkpoint.path), num_blocks=10, kv_host_blocks=4)
    _one_by_one(llm, _prompts(checkpoint.vocab_size, 5, 60, seed=3))
    events = llm.engine.take_block_events()
    assert any(e.tier == TIER_HOST and e.kind is REMOVED for e in events)  # the host tier's LRU turned over
    held: dict[str, set[bytes]] = {TIER_POOL: set(), TIER_HOST: set()}
    for event in events:
        (held[event.tier].add if event.kind is STORED else held[event.tier].discard)(event.block_hash)
    assert held[TIER_HOST] == set(llm.engine.host_tier_hashes()) and len(held[TIER_HOST]) == 4
    assert held[TIER_POOL] == set(llm.engine.kv_cache_manager.pool.cached_hashes())


def test_calibration_prices_the_host_tier_and_leaves_the_pools_full(tiny_checkpoints, caplog):
    llm = LLM(str(tiny_checkpoints["llama"].path), num_blocks=32, kv_host_blocks=8)
    with caplog.at_level("INFO", logger="engine.engine"):
        assert llm.engine.calibrate(64) is not None
    assert "a block copies up in" in caplog.text  # measured against recomputing it (the outcome is the machine's)
    assert isinstance(llm.engine.kv_cache_manager.host.worth_loading, bool)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.host_tier_loaded == 0
    llm.engine.kv_cache_manager.host.check_invariants()
