"""Per-request trace spans (OpenTelemetry), one trace per request across the router and the workers.

Off unless configured, and then free: ``current_tracer()`` is None while no SDK tracer provider is set,
and every span-making path checks that once per request (no exporter, no SDK import, no per-token work).

Configuration, read by each process's ``main`` (the router, ``baton prefill``, ``baton decode``):

- ``OTEL_TRACES_EXPORTER``: ``console``, ``otlp`` (comma-separated for both) or ``none``. Unset means
  ``otlp`` when ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set, else none.
  ``otlp`` needs an exporter package (``opentelemetry-exporter-otlp-proto-grpc``, or ``-proto-http`` with
  ``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf``); it reads the standard ``OTEL_EXPORTER_OTLP_*`` variables
  itself. Without the package a warning says so and spans go nowhere.
- ``--otel-console`` or ``BATON_OTEL_CONSOLE=1``: print every finished span as JSON on stderr.
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: as usual (default service ``baton-<role>``).
- A provider set by other means (``opentelemetry-instrument``, an embedding application) is used as is.

Spans (start and end are the very instants behind the response's ``Timings``, so durations match them):

    generate               router, first byte in -> last message out        = Timings.e2e_ms
      route                router, routing decision
      prefill              router, the Prefill RPC (remote prefill only)
        prefill            P, the request on the prefill worker             = Timings.prefill_ms
          prefill.queue    P, waiting in the engine's queue                 = Timings.queue_ms
          prefill.compute  P, first scheduled step -> first token
      kv.lease             router, P's handle returned -> lease released (acked)
      decode               router, the Decode RPC until its stream ends
        decode             D, the request on the decode worker
          kv.transfer      D, pulling the prompt's KV from P                = Timings.transfer_ms
          prefill.queue    D, local prefill only: waiting in the queue      = Timings.queue_ms
          decode.first_token  D, engine start -> first token
      stream               router, first token sent -> stream end           = e2e_ms - ttft_ms

The trace context crosses processes in W3C ``traceparent`` gRPC metadata (``inject`` / ``extract``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True, kw_only=True)
class TracingConfig:
    exporters: tuple[str, ...] = ()  # "console" and/or "otlp"; empty: tracing off

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, console: bool = False) -> TracingConfig:
        """The configuration the standard ``OTEL_*`` variables (and ``BATON_OTEL_CONSOLE``) describe."""
        names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
        if not names and (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                          or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
            names = ["otlp"]
        if console or environ.get("BATON_OTEL_CONSOLE", "").lower() in _TRUE:
            names.append("console")
        unknown = set(names) - {"console", "otlp", "none"}
        if unknown:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter(s) {sorted(unknown)}; "
                             "use console, otlp or none")
        return cls(exporters=tuple(dict.fromkeys(n for n in names if n != "none")))


def setup_tracing(config: TracingConfig, service_name: str, *, protocol: str = "grpc") -> Any | None:
    """Install an SDK tracer provider as OpenTelemetry's global one; None (nothing done) when off."""
    if not config.exporters:
        return None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    exporters = [ConsoleSpanExporter(out=sys.stderr) if name == "console" else _otlp_exporter(protocol)
                 for name in config.exporters]
    if not any(exporters):
        return None  # nowhere to send spans: stay off
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))  # OTEL_SERVICE_NAME wins
    for exporter in filter(None, exporters):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("OpenTelemetry tracing on (%s) as %s", ", ".join(config.exporters), service_name)
    return provider


def _otlp_exporter(protocol: str) -> Any | None:
    try:
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("OTLP trace export asked for, but no OTLP exporter package is installed "
                    "(pip install opentelemetry-exporter-otlp-proto-%s); spans are not exported",
                    "http" if protocol.startswith("http") else "grpc")
        return None
    return OTLPSpanExporter()


def current_tracer() -> Any | None:
    """OpenTelemetry's global tracer when an SDK provider is installed, else None (tracing off)."""
    if "opentelemetry.trace" not in sys.modules:  # nobody set a provider: skip the ~50 ms import
        return None
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return provider.get_tracer("baton")


# ---- spans from measured instants ----------------------------------------------------------------

class Instants:
    """Converts instants of one monotonic ``clock`` (seconds) to the Unix-epoch nanoseconds spans use."""

    def __init__(self, anchor_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.anchor_s = anchor_s
        self.anchor_ns = time.time_ns() - round((clock() - anchor_s) * 1e9)

    def ns(self, instant_s: float) -> int:
        return self.anchor_ns + round((instant_s - self.anchor_s) * 1e9)


def start_span(tracer: Any, name: str, start_ns: int, parent: Any = None, *, kind: str = "internal",
               attributes: Mapping[str, Any] | None = None) -> Any:
    """A span begun at ``start_ns`` under ``parent`` (a span or an extracted context; None: a new trace)."""
    from opentelemetry import trace

    context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    return tracer.start_span(name, context=context, kind=getattr(trace.SpanKind, kind.upper()),
                             attributes=attributes, start_time=start_ns)


def record_span(tracer: Any, name: str, start_ns: int, duration_ns: int, parent: Any = None,
                **attributes: Any) -> Any:
    """A finished span of exactly ``duration_ns``."""
    span = start_span(tracer, name, start_ns, parent, attributes=attributes or None)
    span.end(end_time=start_ns + duration_ns)
    return span


def ms_to_ns(duration_ms: float) -> int:
    return round(duration_ms * 1e6)


def fail(span: Any, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, message))


# ---- context in gRPC metadata --------------------------------------------------------------------

def inject(span: Any) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``span``'s context (``traceparent``, ``tracestate``)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def extract(metadata: Iterable[Any] | None) -> Any | None:
    """The caller's trace context from gRPC invocation metadata; None when it sent none."""
    carrier = {str(item[0]).lower(): item[1] for item in metadata or () if str(item[0]).lower() in _KEYS}
    if "traceparent" not in carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


_KEYS = ("traceparent", "tracestate")
