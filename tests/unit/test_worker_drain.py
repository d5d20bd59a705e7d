"""The worker's drain decision: exit only after being drained and idle for the whole settle time."""

from __future__ import annotations

import asyncio

import grpc

from worker.drain import DrainGate, InFlightCounter


def test_not_draining_never_exits():
    gate = DrainGate(settle_s=2.0)
    assert not any(gate.update(draining=False, busy=False, now_s=t) for t in range(10))


def test_drained_and_idle_for_the_settle_time_exits():
    gate = DrainGate(settle_s=2.0)
    assert not gate.update(draining=True, busy=False, now_s=10.0)
    assert not gate.update(draining=True, busy=False, now_s=11.9)
    assert gate.update(draining=True, busy=False, now_s=12.0)


def test_busy_restarts_the_settle_clock():
    gate = DrainGate(settle_s=2.0)
    gate.update(draining=True, busy=False, now_s=0.0)
    assert not gate.update(draining=True, busy=True, now_s=1.5)
    assert not gate.update(draining=True, busy=False, now_s=2.5)  # idle again since 2.5
    assert not gate.update(draining=True, busy=False, now_s=4.0)
    assert gate.update(draining=True, busy=False, now_s=4.5)


def test_undrain_resets_and_unknown_keeps_the_state():
    gate = DrainGate(settle_s=1.0)
    gate.update(draining=True, busy=False, now_s=0.0)
    assert not gate.update(draining=False, busy=False, now_s=5.0)
    assert gate.idle_since_s is None and not gate.draining
    gate.update(draining=True, busy=False, now_s=6.0)
    assert gate.update(draining=None, busy=False, now_s=7.0)  # Redis away: still draining


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method


def test_in_flight_counter_counts_unary_and_streaming_calls():
    counter = InFlightCounter(frozenset({"/x/Unary", "/x/Stream"}))
    seen: list[int] = []

    async def unary(request, context):
        seen.append(counter.count)
        return request

    async def streaming(request, context):
        for i in range(2):
            seen.append(counter.count)
            yield i

    async def scenario():
        async def cont_unary(_):
            return grpc.unary_unary_rpc_method_handler(unary)

        async def cont_stream(_):
            return grpc.unary_stream_rpc_method_handler(streaming)

        h1 = await counter.intercept_service(cont_unary, _Details("/x/Unary"))
        assert await h1.unary_unary("r", None) == "r"
        h2 = await counter.intercept_service(cont_stream, _Details("/x/Stream"))
        assert [x async for x in h2.unary_stream("r", None)] == [0, 1]
        h3 = await counter.intercept_service(cont_unary, _Details("/x/Other"))
        assert h3.unary_unary is unary  # not counted

    asyncio.run(scenario())
    assert seen == [1, 1, 1] and counter.count == 0
