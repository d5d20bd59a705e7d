"""Trace spans (OpenTelemetry SDK, InMemorySpanExporter): names, parent/child structure, the context the
workers receive in gRPC metadata, and durations equal to the response's Timings.

Router spans: the real router against scripted gRPC workers (tests/unit/test_router_relay.py's cluster).
Worker spans: the servicers' span builders from given instants and Timings. Configuration: from env.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from decode_node.servicer import _Marks, decode_spans
from prefill_node.servicer import prefill_spans
from proto import baton_pb2 as pb
from proto import tracing
from router.server import start_router
from router.trace import RequestTrace
from router.tracing import NO_SPANS, RequestSpans
from tests.unit.test_router_relay import (  # noqa: F401 - fixtures
    LONG_PROMPT, SHORT_PROMPT, cluster, loop, model_dir, redis_server, request, router_config, stub, tokenizer, tokens,
    wait_until,
)

ROUTER_SPANS = {"generate", "route", "prefill", "kv.lease", "decode", "stream"}


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exported = InMemorySpanExporter()
    yield exported
    exported.clear()


@pytest.fixture
def tracer(exporter) -> Any:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test")


@pytest.fixture
def traced(stub, tracer) -> Iterator[Any]:
    relay = stub.running.relay
    relay.tracer = tracer
    yield stub
    relay.tracer = None


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans = exporter.get_finished_spans()
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [span.name for span in spans]  # one span of each name per request
    return named


def duration_ns(span: ReadableSpan) -> int:
    return span.end_time - span.start_time


def assert_lasts(span: ReadableSpan, duration_ms: float) -> None:
    assert abs(duration_ns(span) - duration_ms * 1e6) <= 1, (span.name, duration_ns(span), duration_ms)


def ids_of(traceparent: str) -> tuple[int, int]:
    """(trace id, parent span id) of a W3C ``traceparent`` header."""
    _, trace_id, span_id, _ = traceparent.split("-")
    return int(trace_id, 16), int(span_id, 16)


def ids(span: ReadableSpan) -> tuple[int, int]:
    return span.context.trace_id, span.context.span_id


# ---- router: one trace per request ---------------------------------------------------------------

def capture_metadata(worker: Any) -> dict[str, dict[str, str]]:
    seen: dict[str, dict[str, str]] = {}
    prefill, decode = worker.prefill, worker.decode

    async def traced_prefill(req: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        seen["prefill"] = dict(context.invocation_metadata())
        return await prefill(req, context)

    async def traced_decode(req: pb.DecodeRequest, context: Any) -> Any:
        seen["decode"] = dict(context.invocation_metadata())
        async for response in decode(req, context):
            yield response

    worker.prefill, worker.decode = traced_prefill, traced_decode
    return seen


def test_remote_request_is_one_trace_with_spans_matching_its_timings(traced, cluster, exporter):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    seen_by_p, seen_by_d = capture_metadata(p0), capture_metadata(d0)
    final = list(traced.Generate(request(LONG_PROMPT), timeout=10))[-1]
    wait_until(lambda: "generate" in {s.name for s in exporter.get_finished_spans()})
    spans = by_name(exporter)
    assert set(spans) == ROUTER_SPANS
    root = spans["generate"]
    assert root.parent is None and root.kind is SpanKind.SERVER
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}
    assert all(s.parent.span_id == root.context.span_id for name, s in spans.items() if name != "generate")
    assert spans["prefill"].kind is SpanKind.CLIENT and spans["decode"].kind is SpanKind.CLIENT
    # the workers were handed the context of the router's client span of their call
    assert ids_of(seen_by_p["prefill"]["traceparent"]) == ids(spans["prefill"])
    assert ids_of(seen_by_d["decode"]["traceparent"]) == ids(spans["decode"])
    t = final.timings
    assert_lasts(root, t.e2e_ms)
    assert_lasts(spans["stream"], t.e2e_ms - t.ttft_ms)
    [first_token] = root.events
    assert first_token.name == "first_token" and abs(first_token.timestamp - root.start_time - t.ttft_ms * 1e6) <= 1
    assert spans["route"].start_time == root.start_time and spans["route"].end_time <= spans["prefill"].start_time
    assert spans["prefill"].end_time <= spans["kv.lease"].start_time <= spans["kv.lease"].end_time
    assert spans["stream"].end_time == root.end_time
    attributes = root.attributes
    assert (attributes["baton.route_kind"], attributes["baton.prefill_worker"]) == ("remote", "p0")
    assert attributes["baton.queue_ms"] == t.queue_ms == 1.0 and attributes["baton.completion_tokens"] == 6


def test_local_request_has_no_prefill_or_lease_span(traced, cluster, exporter):
    cluster.add("d0", "decode")
    cluster.add("p0", "prefill")
    final = list(traced.Generate(request(SHORT_PROMPT), timeout=10))[-1]
    wait_until(lambda: "generate" in {s.name for s in exporter.get_finished_spans()})
    spans = by_name(exporter)
    assert set(spans) == {"generate", "route", "decode", "stream"}
    assert_lasts(spans["generate"], final.timings.e2e_ms)
    assert spans["generate"].status.is_ok


def test_a_failed_request_ends_its_trace_in_error(traced, cluster, exporter):
    with pytest.raises(grpc.RpcError) as info:
        list(traced.Generate(request(SHORT_PROMPT), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no workers registered
    wait_until(lambda: "generate" in {s.name for s in exporter.get_finished_spans()})
    root = by_name(exporter)["generate"]
    assert root.status.status_code is StatusCode.ERROR and "no decode workers" in root.status.description


def test_a_grpc_client_traceparent_is_continued(traced, cluster, exporter):
    cluster.add("d0", "decode")
    list(traced.Generate(request(SHORT_PROMPT), timeout=10, metadata=PARENT))
    wait_until(lambda: "generate" in {s.name for s in exporter.get_finished_spans()})
    root = by_name(exporter)["generate"]
    assert (root.context.trace_id, root.parent.span_id) == (int("ab" * 16, 16), int("cd" * 8, 16))


def test_an_http_client_traceparent_is_continued(loop, model_dir, redis_server, cluster, tracer, exporter):
    cluster.add("d0", "decode")
    running = loop.run(start_router(router_config(model_dir, redis_server.url), http_port=0))
    running.relay.tracer = tracer
    try:
        body = json.dumps({"prompt": SHORT_PROMPT, "max_tokens": 3}).encode()
        headers = {"Content-Type": "application/json", "traceparent": PARENT[0][1]}
        http = urllib.request.Request(f"http://127.0.0.1:{running.http_server.port}/v1/completions", data=body,
                                      headers=headers)
        with urllib.request.urlopen(http, timeout=10) as response:
            assert response.status == 200
        wait_until(lambda: "generate" in {s.name for s in exporter.get_finished_spans()})
    finally:
        loop.run(running.stop(0.5))
    root = by_name(exporter)["generate"]
    assert (root.context.trace_id, root.parent.span_id) == (int("ab" * 16, 16), int("cd" * 8, 16))


def test_spans_cut_at_the_trace_clock(tracer, exporter):
    now = [10.0]
    trace = RequestTrace(lambda: now[0])
    spans = RequestSpans(tracer, trace, "r1")
    now[0] += 0.002
    spans.routed("local", "short")
    metadata = spans.call("decode", "d0")
    assert [key for key, _ in metadata] == ["traceparent"]
    now[0] += 0.030
    trace.tokens_sent(1)
    now[0] += 0.100
    trace.tokens_sent(4)
    spans.end("decode")
    now[0] += 0.001
    final = pb.GenerateResponse(timings=trace.final(prefill_worker="", decode_worker="d0"))
    spans.finish(final)
    spans.close("ignored: already finished")
    named = by_name(exporter)
    assert duration_ns(named["route"]) == 2_000_000 and duration_ns(named["decode"]) == 130_000_000
    assert duration_ns(named["stream"]) == 101_000_000 and duration_ns(named["generate"]) == 133_000_000
    assert_lasts(named["generate"], final.timings.e2e_ms)
    assert named["generate"].status.is_unset


def test_tracing_off_is_the_no_op():
    assert RequestSpans.begin(None, RequestTrace(), "r1") is NO_SPANS
    assert NO_SPANS.call("prefill", "p0") is None  # no metadata on the wire
    assert tracing.current_tracer() is None  # no SDK provider installed in this process


# ---- workers -------------------------------------------------------------------------------------

PARENT = [("traceparent", f"00-{'ab' * 16}-{'cd' * 8}-01")]


def test_prefill_worker_spans_are_its_timings(tracer, exporter):
    timings = pb.Timings(prefill_ms=12.5, queue_ms=4.25)
    prefill_spans(tracer, tracing.extract(PARENT), time.perf_counter(), timings, request_id="r1", worker_id="p0")
    spans = by_name(exporter)
    top, queue, compute = spans["prefill"], spans["prefill.queue"], spans["prefill.compute"]
    assert top.context.trace_id == int("ab" * 16, 16) and top.parent.span_id == int("cd" * 8, 16)
    assert top.kind is SpanKind.SERVER and top.attributes["baton.worker_id"] == "p0"
    assert queue.parent.span_id == compute.parent.span_id == top.context.span_id
    assert (duration_ns(top), duration_ns(queue), duration_ns(compute)) == (12_500_000, 4_250_000, 8_250_000)
    assert queue.start_time == top.start_time and queue.end_time == compute.start_time
    assert compute.end_time == top.end_time


def test_decode_worker_spans_after_a_pull(tracer, exporter):
    marks = _Marks(100.0, pull_s=100.001, started_s=100.010, first_token_s=100.050,
                   timings=pb.Timings(transfer_ms=3.5, transfer_bytes=4096, transfer_blocks=2, transport="tcp"))
    decode_spans(tracer, tracing.extract(PARENT), marks, request_id="r1", worker_id="d0")
    spans = by_name(exporter)
    assert set(spans) == {"decode", "kv.transfer", "decode.first_token"}  # queue_ms 0: KV came from P
    transfer = spans["kv.transfer"]
    assert duration_ns(transfer) == 3_500_000 and transfer.attributes["baton.transport"] == "tcp"
    assert abs(duration_ns(spans["decode.first_token"]) - 40_000_000) <= 1
    assert spans["decode"].parent.span_id == int("cd" * 8, 16)


def test_decode_worker_local_prefill_has_a_queue_span_and_errors_show(tracer, exporter):
    marks = _Marks(5.0, started_s=5.0, timings=pb.Timings(queue_ms=7.0), error="RESOURCE_EXHAUSTED")
    decode_spans(tracer, None, marks, request_id="r1", worker_id="d0")
    spans = by_name(exporter)
    assert set(spans) == {"decode", "prefill.queue"} and duration_ns(spans["prefill.queue"]) == 7_000_000
    assert spans["decode"].parent is None and spans["decode"].status.status_code is StatusCode.ERROR


# ---- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize(("environ", "console", "exporters"), [
    ({}, False, ()),
    ({}, True, ("console",)),
    ({"BATON_OTEL_CONSOLE": "1"}, False, ("console",)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, False, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False, ()),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, True, ("otlp", "console")),
])
def test_config_from_the_standard_variables(environ, console, exporters):
    assert tracing.TracingConfig.from_env(environ, console=console).exporters == exporters


def test_unknown_exporter_is_refused():
    with pytest.raises(ValueError, match="zipkin"):
        tracing.TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_off_sets_nothing_up():
    assert tracing.setup_tracing(tracing.TracingConfig(), "baton-router") is None
    assert tracing.extract([("other", "x")]) is None


def test_otlp_without_an_exporter_package_stays_off():
    try:
        import opentelemetry.exporter.otlp  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("an OTLP exporter package is installed here")
    assert tracing.setup_tracing(tracing.TracingConfig(exporters=("otlp",)), "baton-router") is None
    assert tracing.current_tracer() is None
