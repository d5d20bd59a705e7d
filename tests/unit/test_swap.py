"""Swap preemption (issue 24, item 4: ``--preemption-mode swap``): a preempted request's blocks go to the host
tier and come back when it resumes, so it continues where it stopped instead of recomputing; exact ids on the
scheduler, fallbacks (no room, abort while swapped) and greedy parity on tiny checkpoints."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import SampledTokens
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.errors import InvalidRequest


def _scheduler(num_blocks: int, host_blocks: int, mode: str = "swap") -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks, num_host_blocks=host_blocks), b"x" * 16)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, preemption_mode=mode)
    return Scheduler(config, kv)


def _request(rid: str, prompt: list[int], max_tokens: int = 20) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, seed=0,
                   sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def _step(sched: Scheduler):
    out = sched.schedule()
    copies = sched.kv_cache.take_host_copies()
    sched.update(out, SampledTokens([7] * sum(s.num_rows for s in out.seqs)))
    sched.kv_cache.pool.check_invariants()
    return out, copies


def test_a_swapped_request_resumes_where_it_stopped():
    """Pool of 5 blocks of 4: a (10-token prompt) in blocks 0-2, b (6) in 3-4. a's 13th token needs a block: b,
    the newest, is swapped out (its blocks 3, 4, the partial one too) with 8 tokens computed; when a finishes,
    b's blocks come back into fresh ones and b computes its 9th token, nothing again."""
    sched = _scheduler(num_blocks=5, host_blocks=8)
    a, b = _request("a", list(range(100, 110))), _request("b", list(range(200, 206)))
    sched.add_request(a)
    sched.add_request(b)
    saves = ()
    while b.status is not RequestStatus.PREEMPTED:
        _, copies = _step(sched)
        saves += copies.saves
    # b's two blocks into host blocks 0, 1; then a's new block evicts b's block 4 (full, so cached) from the
    # pool, which the host tier's LRU keeps as well (host block 2)
    assert saves == ((3, 0), (4, 1), (4, 2)) and b.num_computed_tokens == 8 and sched.kv_cache.swapped_out(b) == 2
    while b.status is not RequestStatus.RUNNING:
        out, copies = _step(sched)
    seq = next(s for s in out.seqs if s.request is b)
    assert (seq.start, seq.num_new_tokens) == (8, 1)  # resumed at its next token: nothing recomputed
    assert copies.loads == ((0, seq.block_ids[0]), (1, seq.block_ids[1]))
    while sched.has_unfinished():
        _step(sched)
    sched.kv_cache.host.check_invariants()
    assert sched.kv_cache.pool.num_free_blocks == 5


def test_without_room_in_the_host_tier_preemption_recomputes():
    sched = _scheduler(num_blocks=5, host_blocks=1)  # one host block: no request's blocks fit
    a, b = _request("a", list(range(100, 110))), _request("b", list(range(200, 206)))
    for request in (a, b):
        sched.add_request(request)
    while sched.num_preemptions == 0:
        _step(sched)
    assert sched.kv_cache.host.num_swapped_out == 0
    victim = next(r for r in (a, b) if r.status is RequestStatus.PREEMPTED)
    assert victim.num_computed_tokens == 0  # recompute, as without swap


def test_an_aborted_swapped_request_gives_its_host_blocks_back():
    sched = _scheduler(num_blocks=5, host_blocks=8)
    a, b = _request("a", list(range(100, 110))), _request("b", list(range(200, 206)))
    for request in (a, b):
        sched.add_request(request)
    while sched.kv_cache.host.num_swapped_out == 0:
        _step(sched)
    victim = next(r for r in (a, b) if r.status is RequestStatus.PREEMPTED)
    sched.abort(victim.request_id)
    sched.kv_cache.take_host_copies()
    sched.kv_cache.host.check_invariants()  # held + free == total: nothing swapped left
    assert sched.kv_cache.swapped_out(victim) is None


def test_swap_needs_a_host_tier():
    with pytest.raises(InvalidRequest, match="kv_host_blocks"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(InvalidRequest, match="recompute\\|swap"):
        EngineConfig(preemption_mode="discard")


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # windowed models rarely preempt: test_sliding_window.py
def test_greedy_output_under_swap_preemption_equals_the_unpressured_engine(tiny_checkpoints, name):
    checkpoint = tiny_checkpoints[name]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, checkpoint.vocab_size) for _ in range(rng.randrange(20, 60))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    generate = lambda llm: [o.outputs[0].token_ids  # noqa: E731
                            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    expected = generate(LLM(str(checkpoint.path), num_blocks=128))
    llm = LLM(str(checkpoint.path), num_blocks=14, kv_host_blocks=64, preemption_mode="swap")
    assert generate(llm) == expected
    host = llm.engine.kv_cache_manager.host
    assert host.num_swapped_out >= 2 and host.num_swapped_in == host.num_swapped_out
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    host.check_invariants()
