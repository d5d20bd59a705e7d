"""A KV handle covers only the blocks still in the sliding window (issue 24, item 4): a prefill of a model whose
every layer attends within one window hands over the blocks its next token attends to and frees the ones before
(still in its prefix cache); a decode engine adopts them behind pad entries, as ``free_outside_window`` leaves a
running request, and never commits a pad entry. Exact ids on the books, then greedy and seeded parity of a
prefill engine -> tensor copy of the handed-over blocks only -> decode engine, on the tiny Mistral (window 20)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from decode_node.handles import handle_problem, prefix_problem
from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager, window_start
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from prefill_node.layerwise import LayerwiseHooks
from proto import baton_pb2 as pb

BLOCK, WINDOW = 4, 20


def _request(prompt_len: int, rid: str = "r", outputs: int = 0) -> Request:
    request = Request(request_id=rid, prompt_token_ids=list(range(prompt_len)), seed=0,
                      sampling_params=SamplingParams(temperature=0, max_tokens=8))
    for token in range(outputs):
        request.append_output_token(token)
    return request


def _manager(num_blocks: int = 10) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks), b"x" * 16)


def test_window_start_is_the_first_block_the_next_token_attends_to():
    assert window_start(14, 6, 4) == 2  # the token at 14 sees 9..14: blocks 2, 3
    assert window_start(120, 20, 4) == 25 and window_start(121, 20, 4) == 25 and window_start(124, 20, 4) == 26
    assert window_start(19, 20, 4) == 0 and window_start(500, None, 4) == 0


def test_a_prefill_hands_over_the_window_blocks_and_frees_the_rest_still_cached():
    kv = _manager()
    request = _request(14)
    kv.allocate_slots(request, 14)  # blocks 0-3
    request.num_computed_tokens = 14
    kv.commit(request)
    first, held = kv.hand_over(request, window=6)
    assert (first, held) == (2, (2, 3)) and request.num_window_freed == 0
    assert kv.pool.num_free_blocks == 8 and kv.num_requests() == 0
    assert [kv.pool.lookup(h) for h in request.block_hashes] == [0, 1, 2]  # blocks 0, 1 evictable, still cached
    assert [kv.pool.ref_count(b) for b in range(4)] == [0, 0, 1, 1]  # the caller's now
    kv.release(list(held))
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == 10


def test_without_a_window_the_whole_prompt_is_handed_over():
    kv = _manager()
    request = _request(14)
    kv.allocate_slots(request, 14)
    request.num_computed_tokens = 14
    assert kv.hand_over(request, window=None) == (0, (0, 1, 2, 3))
    assert kv.pool.num_free_blocks == 6


def test_a_decode_reservation_puts_pad_entries_before_the_first_block_and_never_commits_them():
    kv = _manager()
    request = _request(14, outputs=1)
    assert kv.allocate_window(request, 14, first_block=2) == 2
    assert kv.block_ids("r") == [10, 10, 0, 1] and request.num_window_freed == 2  # 10: the pad block
    assert kv.pool.num_free_blocks == 8
    request.num_computed_tokens = 14  # the pulled KV is in place
    kv.commit(request)
    assert [kv.pool.lookup(h) for h in request.block_hashes[:3]] == [None, None, 0]
    kv.free(request)
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == 10 and request.num_window_freed == 0


def test_a_decode_reservation_reuses_cached_blocks_from_the_first_block_on():
    """A block's hash names its whole prefix: cached blocks at the window's start serve though the ones before
    them are not here."""
    kv = _manager()
    warm = _request(14, rid="warm")
    kv.allocate_slots(warm, 14)  # blocks 0-3; 0-2 full
    warm.num_computed_tokens = 14
    kv.commit(warm)
    kv.free(warm)
    request = _request(14, outputs=1)
    assert kv.allocate_window(request, 14, first_block=2) == 3  # block 2 (the third) cached: pull only the last
    assert kv.block_ids("r") == [10, 10, 2, 4]
    assert kv.pool.ref_count(2) == 1 and kv.pool.num_free_blocks == 8
    kv.free(request)
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == 10


def _scheduler(window: int | None, num_blocks: int = 10) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=200, sliding_window=window)
    return Scheduler(config, _manager(num_blocks))


def test_add_remote_reserves_a_window_handle_and_refuses_one_past_the_window():
    sched = _scheduler(window=6)
    assert sched.add_remote(_request(14, outputs=1), 14, first_block=2) == (2, [10, 10, 0, 1])
    for rid, window, first in (("late", 6, 3), ("negative", 6, -1), ("no-window", None, 1)):
        other = _scheduler(window)
        with pytest.raises(InvalidRequest, match="cannot do"):
            other.add_remote(_request(14, rid=rid, outputs=1), 14, first_block=first)
        assert other.kv_cache.pool.num_free_blocks == 10 and not other.has_unfinished()


def test_a_decode_worker_checks_a_handle_against_its_own_window():
    ok = pb.KVHandle(block_ids=range(5), first_block=25)  # 120 tokens, window 20: blocks 25-29
    assert handle_problem(ok, 120, 20, 4) is None
    assert handle_problem(pb.KVHandle(block_ids=range(30)), 120, 20, 4) is None  # whole prompt: an older P
    assert handle_problem(pb.KVHandle(block_ids=range(10), first_block=20), 120, 20, 4) is None  # more than needed
    assert "attends from block 25" in handle_problem(pb.KVHandle(block_ids=range(4), first_block=26), 120, 20, 4)
    assert "attends from block 0" in handle_problem(ok, 120, None, 4)  # no window here: every block is needed
    assert "4 block ids for the 5" in handle_problem(pb.KVHandle(block_ids=range(4), first_block=25), 120, 20, 4)
    assert "block ids for the 30" in handle_problem(pb.KVHandle(block_ids=range(31)), 120, None, 4)
    prefix = pb.KVHandle(block_ids=range(2), block_hashes=[b"a", b"b"], num_tokens=8, first_block=1)
    assert "starts at block 0" in prefix_problem(prefix, 20, 4)


# ---- engines: the tiny Mistral, window 20 -------------------------------------------------------------------

def _engine(checkpoint, num_blocks: int = 128, **kw) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint.path), num_blocks=num_blocks, block_size=BLOCK, **kw))


def _run(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens


def _prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt) % 380 + 3 for i in range(n)]


def _prefill(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, max_steps: int = 100):
    engine.add_request(rid, prompt, replace(params, max_tokens=1), hold_blocks=True)
    for _ in range(max_steps):  # bounded: a prefill that cannot get its blocks would loop, preempting itself
        finished = [d for d in engine.step() if d.request_id == rid and d.finished]
        if finished:
            return finished[0]
    raise AssertionError(f"{rid}: no first token after {max_steps} steps ({engine.stats()})")


def _assert_full(*engines: Engine) -> None:
    for engine in engines:
        engine.kv_cache_manager.pool.check_invariants()
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks


PARAMS = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True)]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_prefill_hands_over_the_window_and_decode_equals_one_engine(tiny_checkpoints, params):
    """Prompts of 120, 121, 23 and 10 tokens: P hands over 5, 6, 5 and 3 blocks (the first from block 25, 25, 1
    and 0); D pulls (copies) only those, behind pad entries, and decodes what the single engine decodes."""
    checkpoint = tiny_checkpoints["mistral-swa"]
    prompts = [_prompt(n, i) for i, n in enumerate((120, 121, 23, 10))]
    single, p, d = _engine(checkpoint), _engine(checkpoint), _engine(checkpoint)
    for i, prompt in enumerate(prompts):
        single.add_request(str(i), prompt, params)
    expected = _run(single)
    for i, prompt in enumerate(prompts):
        delta = _prefill(p, str(i), prompt, params)
        first, held = delta.held_first_block, list(delta.held_block_ids)
        assert first == window_start(len(prompt), WINDOW, BLOCK) and len(held) == -(-len(prompt) // BLOCK) - first
        hashes = p.kv_cache_manager.prompt_hashes(prompt, "")
        assert all(p.kv_cache_manager.pool.lookup(h) is not None for h in hashes)  # every full block stays cached
        assert p.stats().num_free_blocks == p.stats().num_total_blocks - len(held)  # only the window is pinned
        request, num_hit, dst = d.add_remote_request(str(i), prompt, delta.new_token_ids, params, first_block=first)
        assert num_hit == first and dst[:first] == [d.kv_cache_manager.pad_block] * first
        d.runner.kv_cache[:, dst[first:]] = p.runner.kv_cache[:, held]
        d.activate_remote(str(i))
        p.release_blocks(held)
        assert all(d.kv_cache_manager.pool.lookup(h) is None for h in hashes[:first])  # pads are never cached
    got = _run(d)
    for i in range(len(prompts)):
        assert expected[str(i)][:1] + got[str(i)] == expected[str(i)], f"prompt {i}"
    _assert_full(single, p, d)


def test_a_prefill_longer_than_its_pool_slides_through_its_chunks(tiny_checkpoints):
    """A 120-token prompt (30 blocks) prefilled in 16-token chunks in a 16-block pool: it frees what fell out of
    the window between its chunks, so it never runs out of blocks, and hands over the same window blocks."""
    checkpoint = tiny_checkpoints["mistral-swa"]
    p = _engine(checkpoint, num_blocks=16, max_num_batched_tokens=16)
    delta = _prefill(p, "long", _prompt(120, 0), PARAMS[0])
    assert delta.held_first_block == 25 and len(delta.held_block_ids) == 5
    assert p.stats().num_preemptions == 0
    p.release_blocks(list(delta.held_block_ids))
    _assert_full(p)


def test_layerwise_hooks_pin_exactly_the_blocks_handed_over(tiny_checkpoints):
    """The lease pinned at admission (layer-wise streaming) names the window blocks the finished prefill hands
    over, from the same first block: nothing is pinned that the engine freed."""
    engine = _engine(tiny_checkpoints["mistral-swa"], num_blocks=64, max_num_batched_tokens=32)
    admitted = []

    async def run():
        hooks = LayerwiseHooks(asyncio.get_running_loop(), engine.model_config.num_layers,
                               lambda rid, blocks, progress, first: admitted.append((blocks, first)),
                               first_block=lambda n: window_start(n, WINDOW, BLOCK))
        async_engine = AsyncEngine(engine, step_hooks=hooks)
        async_engine.start()
        try:
            hooks.watch("r")
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            add = lambda e: e.add_request("r", _prompt(90, 1), params, hold_blocks=True)  # noqa: E731
            deltas = [d async for d in async_engine.stream("r", add)]
            await asyncio.sleep(0)  # the admitted callback runs on this loop
        finally:
            async_engine.stop()
        return deltas[-1]

    last = asyncio.run(run())
    assert admitted == [(last.held_block_ids, last.held_first_block)]
    assert last.held_first_block == 17 and len(last.held_block_ids) == 23 - 17  # (90 - 19) // 4; ceil(90 / 4)
    _assert_full(engine)  # AsyncEngine freed the held blocks
