"""AsyncEngine: the engine thread serves asyncio streams; cancellation aborts and frees blocks."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.request import RequestStatus
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from tests.tiny_model import shared_tiny


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = shared_tiny(tmp_path_factory)
    return Engine(EngineConfig(model=str(folder), num_blocks=64, block_size=4))


@pytest.fixture
def async_engine(engine):
    held = []
    ae = AsyncEngine(engine, on_held=lambda delta: held.append(delta))
    ae.held = held
    ae.start()
    yield ae
    ae.stop()
    for delta in held:
        engine.release_blocks(list(delta.held_block_ids))
    pool = engine.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks and not engine.has_unfinished()


async def collect(ae: AsyncEngine, rid: str, prompt, params, **kwargs) -> list[int]:
    tokens = []
    add = lambda e: e.add_request(rid, prompt, params, **kwargs)  # noqa: E731
    async for delta in ae.stream(rid, add):
        tokens.extend(delta.new_token_ids)
    return tokens


def test_concurrent_streams_match_the_sync_engine(async_engine, engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(10, 10 + n)) for n in (3, 7, 12, 20)]

    async def main():
        return await asyncio.gather(*(collect(async_engine, f"r{i}", p, params) for i, p in enumerate(prompts)))

    got = asyncio.run(main())
    async_engine.stop()
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    expected: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            expected.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert got == [expected[f"s{i}"] for i in range(len(prompts))]


def test_cancelling_a_stream_aborts_the_request(async_engine, engine):
    """Left alone the request would run to the pool's 256-token limit and end as LENGTH; cancelled after its
    first token, only an abort ends it, as FINISHED_ABORTED, before its last token."""
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    added = []
    started = asyncio.Event()

    async def consume():
        async for _ in async_engine.stream("long", lambda e: added.append(e.add_request("long", [5, 6, 7], params))):
            started.set()

    async def main():
        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), timeout=30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the abort is processed on the engine thread; wait until it drained
        for _ in range(100):
            if not await async_engine.call(lambda e: e.has_unfinished()):
                return
            await asyncio.sleep(0.02)

    asyncio.run(main())
    (request,) = added
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert 0 < request.num_output_tokens < params.max_tokens
    assert not engine.has_unfinished()


def test_errors_reach_the_caller_and_the_loop_keeps_serving(async_engine):
    async def main():
        with pytest.raises(InvalidRequest, match="empty"):
            await collect(async_engine, "bad", [], SamplingParams())
        return await collect(async_engine, "ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))

    assert len(asyncio.run(main())) == 3


def test_held_blocks_go_to_the_hook_even_without_a_listener(async_engine):
    params = SamplingParams(temperature=0, max_tokens=1)

    async def main():
        tokens = await collect(async_engine, "p", list(range(40, 50)), params, hold_blocks=True)
        return tokens

    assert len(asyncio.run(main())) == 1
    assert [d.request_id for d in async_engine.held] == ["p"]
    assert len(async_engine.held[0].held_block_ids) == 3  # 10 tokens in blocks of 4
