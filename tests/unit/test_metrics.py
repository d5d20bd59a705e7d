"""Router and worker Prometheus series: exact values after recorded events (fake clock, own registries)."""

from __future__ import annotations

import urllib.request

import pytest

from engine.core.outputs import SchedulerStats
from worker.metrics import WorkerMetrics
from proto.metrics_http import serve_metrics
from router.metrics import RouterMetrics, reason_category
from router.trace import RequestTrace
from tests.integration.cluster import free_port


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _stats(**fields) -> SchedulerStats:
    base = dict(num_running=0, num_waiting=0, num_free_blocks=10, num_total_blocks=10, kv_cache_usage=0.0,
                prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
    return SchedulerStats(**(base | fields))


@pytest.mark.parametrize(("reason", "category"), [
    ("80 uncached prompt tokens > threshold 64", "threshold"),
    ("round_robin: 3 uncached prompt tokens <= threshold 8", "threshold"),
    ("cost: remote on p0 (ttft 12 ms) vs local 30 ms; no prefill workers", "cost"),
    ("no prefill workers", "no_prefill"),
    ("prefill pool saturated (every worker queues > 100 tokens)", "saturated"),
    ("fallback: prefill on p0 failed (UNAVAILABLE)", "fallback"),
    ("KV pull failed (connection refused); prefilled locally", "fallback"),
    ("something new", "other"),
])
def test_reason_category_is_a_short_bounded_label(reason, category):
    assert reason_category(reason) == category


def test_router_records_a_finished_request_and_its_decision():
    metrics, clock = RouterMetrics(), Clock()
    trace = RequestTrace(clock)
    metrics.decision("remote", "80 uncached prompt tokens > threshold 64")
    metrics.decision("local", "fallback: prefill on p0 failed (UNAVAILABLE)")
    clock.now_s += 0.25
    trace.tokens_sent(1)  # TTFT 250 ms
    clock.now_s += 0.02
    trace.tokens_sent(1)  # one gap of 20 ms
    clock.now_s += 0.06
    trace.tokens_sent(2)  # two tokens after 60 ms: 30 ms each
    clock.now_s += 0.17
    metrics.request_finished(trace, num_prompt_tokens=80, num_output_tokens=4, finished_reason="length")

    value = metrics.registry.get_sample_value
    assert value("baton:router_decisions_total", {"kind": "remote", "reason": "threshold"}) == 1.0
    assert value("baton:router_decisions_total", {"kind": "local", "reason": "fallback"}) == 1.0
    assert value("baton:time_to_first_token_seconds_count") == 1.0
    assert value("baton:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value("baton:time_to_first_token_seconds_bucket", {"le": "0.25"}) == 1.0
    assert value("baton:time_to_first_token_seconds_bucket", {"le": "0.1"}) == 0.0
    assert value("baton:inter_token_latency_seconds_count") == 3.0
    assert value("baton:inter_token_latency_seconds_sum") == pytest.approx(0.08)
    assert value("baton:e2e_request_latency_seconds_sum") == pytest.approx(0.5)
    assert value("baton:request_prompt_tokens_sum") == 80.0
    assert value("baton:request_generation_tokens_sum") == 4.0
    assert value("baton:request_success_total", {"finished_reason": "length"}) == 1.0
    assert value("baton:request_errors_total", {"code": "UNAVAILABLE"}) is None


def test_errors_count_by_code_and_two_routers_do_not_share_series():
    first, second = RouterMetrics(), RouterMetrics()
    first.request_error("UNAVAILABLE")
    first.request_error("UNAVAILABLE")
    first.request_error("INVALID_ARGUMENT")
    first.running.inc()
    assert first.registry.get_sample_value("baton:request_errors_total", {"code": "UNAVAILABLE"}) == 2.0
    assert first.registry.get_sample_value("baton:request_errors_total", {"code": "INVALID_ARGUMENT"}) == 1.0
    assert first.registry.get_sample_value("baton:num_requests_running") == 1.0
    assert second.registry.get_sample_value("baton:request_errors_total", {"code": "UNAVAILABLE"}) is None
    assert second.registry.get_sample_value("baton:num_requests_running") == 0.0


def test_worker_gauges_follow_stats_and_counters_advance_by_the_new_part():
    metrics = WorkerMetrics("d0")
    labels = {"worker_id": "d0"}
    value = metrics.registry.get_sample_value
    assert value("baton:kv_transfer_bytes_total", labels) == 0.0  # exported before any event
    metrics.scheduler_stats(_stats(num_running=3, num_waiting=1, kv_cache_usage=0.4, prefix_cache_queries=10,
                                   prefix_cache_hits=4))
    metrics.scheduler_stats(_stats(num_running=2, num_waiting=0, kv_cache_usage=0.3, prefix_cache_queries=20,
                                   prefix_cache_hits=15, num_preemptions=1))
    metrics.kv_transfer(4096, 0.002)
    metrics.kv_transfer(1024, 0.001, transport="nccl")
    metrics.request_error("UNAVAILABLE")
    assert (value("baton:num_requests_running", labels), value("baton:num_requests_waiting", labels)) == (2.0, 0.0)
    assert value("baton:kv_cache_usage_perc", labels) == pytest.approx(0.3)
    assert value("baton:prefix_cache_hit_rate", labels) == pytest.approx(0.75)
    assert value("baton:prefix_cache_queries_total", labels) == 20.0
    assert value("baton:prefix_cache_hits_total", labels) == 15.0
    assert value("baton:num_preemptions_total", labels) == 1.0
    assert value("baton:kv_transfer_bytes_total", labels) == 5120.0
    assert value("baton:kv_transfer_seconds_count", labels) == 2.0
    for transport in ("tcp", "nccl"):  # which transport each worker pair used
        assert value("baton:kv_transfers_total", {"worker_id": "d0", "transport": transport}) == 1.0
    assert value("baton:request_errors_total", {"worker_id": "d0", "code": "UNAVAILABLE"}) == 1.0


def test_metrics_endpoint_serves_the_registry_and_zero_serves_nothing():
    metrics = RouterMetrics()
    metrics.decision("local", "3 uncached prompt tokens <= threshold 8")
    assert serve_metrics(metrics.registry, "127.0.0.1", 0) is None
    server = serve_metrics(metrics.registry, "127.0.0.1", free_port())
    assert server is not None
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
    finally:
        server.stop()
    assert 'baton:router_decisions_total{kind="local",reason="threshold"} 1.0' in body
    assert "baton:time_to_first_token_seconds_bucket" in body
