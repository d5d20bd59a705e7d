"""A worker drained with ``baton admin drain`` finishes its work, then exits by itself (``--on-drain exit``).

``DrainGate`` is the pure decision (no I/O): once the worker sees itself in ``{ns}:draining`` and has been
idle — no Prefill/Decode call in flight, nothing running or queued in the engine, no open transfer lease —
for ``settle_s`` without a break, it may exit. The settle time covers a request a router routed from a
listing taken just before the drain mark. Undraining before that resets it.
``InFlightCounter`` is the gRPC interceptor that counts the Worker calls being served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from proto.malformed import stream_responses

log = logging.getLogger(__name__)

ON_DRAIN_CHOICES = ("exit", "stay")


@dataclass
class DrainGate:
    settle_s: float
    draining: bool = False
    idle_since_s: float | None = None

    def update(self, *, draining: bool | None, busy: bool, now_s: float) -> bool:
        """True once the worker may exit. ``draining`` None: unknown this time (Redis away), keep the state."""
        if draining is not None and draining != self.draining:
            self.draining, self.idle_since_s = draining, None
            log.info("worker is %s", "draining: finishing in-flight work" if draining else "no longer draining")
        if not self.draining or busy:
            self.idle_since_s = None
            return False
        if self.idle_since_s is None:
            self.idle_since_s = now_s
        return now_s - self.idle_since_s >= self.settle_s


class InFlightCounter(grpc.aio.ServerInterceptor):
    """Counts calls in flight of the given full method names (``/baton.v1.Worker/Decode``)."""

    def __init__(self, methods: frozenset[str]) -> None:
        self.methods = methods
        self.count = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods or handler.request_streaming:
            return handler
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(handler.unary_stream))
        return handler._replace(unary_unary=self._unary(handler.unary_unary))

    def _unary(self, behaviour):
        async def unary(request, context):
            self.count += 1
            try:
                return await behaviour(request, context)
            finally:
                self.count -= 1

        return unary

    def _stream(self, behaviour):
        async def stream(request, context):
            self.count += 1
            try:
                async for response in stream_responses(behaviour(request, context)):
                    yield response
            finally:
                self.count -= 1

        return stream
