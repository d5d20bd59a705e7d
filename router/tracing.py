"""The router's spans of one request (see ``proto.tracing`` for the whole tree and its configuration).

``RequestSpans`` cuts every span at an instant of the request's ``RequestTrace`` clock, the same instants
its ``Timings`` come from: the root ``generate`` span lasts ``e2e_ms``, ``stream`` ``e2e_ms - ttft_ms``.
The Prefill and Decode RPCs get client spans whose context travels in the call's metadata, so the workers'
spans join the same trace; a client that sends a ``traceparent`` (HTTP header) gets the request's trace
under its own span. With tracing off the relay holds ``NO_SPANS``, whose methods do nothing.
"""

from __future__ import annotations

from typing import Any

from proto import baton_pb2 as pb
from proto import tracing
from router.trace import RequestTrace


class NoSpans:
    """Tracing off: every call is a no-op and RPCs carry no trace metadata."""

    def routed(self, kind: str, reason: str) -> None:
        pass

    def call(self, name: str, worker_id: str) -> None:
        return None

    def open(self, name: str, **attributes: Any) -> None:
        pass

    def end(self, name: str, error: str | None = None) -> None:
        pass

    def finish(self, final: pb.GenerateResponse) -> None:
        pass

    def close(self, error: str | None = None) -> None:
        pass


NO_SPANS = NoSpans()


class RequestSpans(NoSpans):
    def __init__(self, tracer: Any, trace: RequestTrace, request_id: str, parent: Any = None) -> None:
        self._tracer, self._trace = tracer, trace
        self._instants = tracing.Instants(trace.start_s, trace.now)
        self._root = tracing.start_span(tracer, "generate", self._ns(trace.start_s), parent, kind="server",
                                        attributes={"baton.request_id": request_id})
        self._open: dict[str, Any] = {}

    @classmethod
    def begin(cls, tracer: Any | None, trace: RequestTrace, request_id: str, parent: Any = None) -> NoSpans:
        """Spans under ``parent`` (the client's context, or None: a new trace); NO_SPANS without a tracer."""
        return NO_SPANS if tracer is None else cls(tracer, trace, request_id, parent)

    def _ns(self, instant_s: float) -> int:
        return self._instants.ns(instant_s)

    def routed(self, kind: str, reason: str) -> None:
        span = tracing.start_span(self._tracer, "route", self._ns(self._trace.start_s), self._root,
                                  attributes={"baton.route_kind": kind, "baton.route_reason": reason})
        span.end(end_time=self._ns(self._trace.now()))

    def call(self, name: str, worker_id: str) -> tuple[tuple[str, str], ...]:
        """Open the client span of an RPC to ``worker_id``; the metadata that carries its context."""
        return tracing.inject(self._start(name, "client", {"baton.worker_id": worker_id}))

    def open(self, name: str, **attributes: Any) -> None:
        self._start(name, "internal", attributes)

    def _start(self, name: str, kind: str, attributes: dict[str, Any]) -> Any:
        self.end(name)
        span = tracing.start_span(self._tracer, name, self._ns(self._trace.now()), self._root, kind=kind,
                                  attributes=attributes)
        self._open[name] = span
        return span

    def end(self, name: str, error: str | None = None) -> None:
        self._end(name, self._trace.now(), error)

    def _end(self, name: str, instant_s: float, error: str | None = None) -> None:
        span = self._open.pop(name, None)
        if span is None:
            return
        if error is not None:
            tracing.fail(span, error)
        span.end(end_time=self._ns(instant_s))

    def finish(self, final: pb.GenerateResponse) -> None:
        """The request's last message is built: close everything at the instant its Timings were cut."""
        end_s = self._trace.end_s if self._trace.end_s is not None else self._trace.now()
        for name in list(self._open):
            self._end(name, end_s)
        first_s = self._trace.first_token_s
        if first_s is not None:
            span = tracing.start_span(self._tracer, "stream", self._ns(first_s), self._root,
                                      attributes={"baton.completion_tokens": final.usage.completion_tokens})
            span.end(end_time=self._ns(end_s))
            self._root.add_event("first_token", timestamp=self._ns(first_s))
        self._root.set_attributes(_attributes(final))
        self._root.end(end_time=self._ns(end_s))
        self._root = None

    def close(self, error: str | None = None) -> None:
        """The request ended without a final message (error, cancellation): close what is open now."""
        if self._root is None:
            return
        now = self._trace.now()
        for name in list(self._open):
            self._end(name, now, error)
        if error is not None:
            tracing.fail(self._root, error)
        self._root.end(end_time=self._ns(now))
        self._root = None


def _attributes(final: pb.GenerateResponse) -> dict[str, Any]:
    t, usage = final.timings, final.usage
    return {
        "baton.route_kind": t.route_kind, "baton.route_reason": t.route_reason,
        "baton.prefill_worker": t.prefill_worker, "baton.decode_worker": t.decode_worker,
        "baton.ttft_ms": t.ttft_ms, "baton.queue_ms": t.queue_ms, "baton.prefill_ms": t.prefill_ms,
        "baton.transfer_ms": t.transfer_ms, "baton.transfer_bytes": t.transfer_bytes, "baton.e2e_ms": t.e2e_ms,
        "baton.prompt_tokens": usage.prompt_tokens, "baton.cached_prompt_tokens": usage.cached_prompt_tokens,
        "baton.completion_tokens": usage.completion_tokens,
        "baton.finish_reason": pb.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower(),
    }
