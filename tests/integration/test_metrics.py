"""Prometheus /metrics on real router, prefill and decode processes: the DESIGN.md series exist and move."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from tests.integration.cluster import Cluster, free_port
from tests.integration.test_e2e import _wait_serving, assert_pools_full, generate
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_model import shared_tiny

LONG_PROMPT = [(11 * j) % 3000 + 10 for j in range(40)]  # > threshold 8: prefilled on p0, pulled by d0
SHORT_PROMPT = [12, 13, 14]  # local prefill on d0
# shares 2 blocks (8 tokens) with LONG_PROMPT: a prefix hit on p0, and > 8 uncached tokens on d0 whether
# or not d0's copy of those blocks is indexed yet, so it is prefilled remotely too
OTHER_PROMPT = LONG_PROMPT[:8] + [(7 * j) % 3000 + 3100 for j in range(22)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("logs"))
    cluster.metrics_ports = {"p0": free_port(), "d0": free_port(), "router": free_port()}
    for role, worker_id in (("prefill", "p0"), ("decode", "d0")):
        cluster.start_worker(role, "--metrics-port", str(cluster.metrics_ports[worker_id]), worker_id=worker_id)
    cluster.wait_for_workers({"p0", "d0"})
    cluster.router = cluster.start_router("--disagg-threshold-tokens", "8", "--policy", "least_loaded",
                                          "--metrics-port", str(cluster.metrics_ports["router"]))
    _wait_serving(cluster.router.address)
    yield cluster
    cluster.stop_all()
    redis.stop()


@pytest.fixture(autouse=True)
def pools_return_to_full(request):
    """After every test that used the cluster: its pools full, no lease open, nothing running."""
    yield
    if "cluster" in request.fixturenames:
        cluster = request.getfixturevalue("cluster")
        assert_pools_full(cluster, workers=[p for p in cluster.procs if p.name in ("p0", "d0")])


def scrape(port: int) -> dict[str, float]:
    """Every sample line of ``/metrics`` as ``{'name{labels}': value}``."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def sampled(port: int, ready, timeout_s: float = 10.0) -> dict[str, float]:
    """``scrape(port)`` once ``ready`` holds for it."""
    deadline = time.monotonic() + timeout_s
    while not ready(samples := scrape(port)):
        assert time.monotonic() < deadline, f"/metrics on {port} not there in {timeout_s} s"
        time.sleep(0.05)
    return samples


def test_named_series_exist_and_move_after_requests(cluster):
    for prompt in (LONG_PROMPT, SHORT_PROMPT, OTHER_PROMPT):
        tokens, final = generate(cluster.router.address, prompt, max_tokens=6)
        assert len(tokens) == 6 and final.usage.completion_tokens == 6
    # the workers' housekeeping samples the engine every 0.25 s: until p0's has sampled the third prompt's hit
    sampled(cluster.metrics_ports["p0"], lambda s: s.get('baton:prefix_cache_hits_total{worker_id="p0"}', 0) > 0)

    router = scrape(cluster.metrics_ports["router"])
    assert router["baton:time_to_first_token_seconds_count"] == 3.0
    assert router["baton:e2e_request_latency_seconds_count"] == 3.0
    assert router["baton:inter_token_latency_seconds_count"] == 15.0  # 5 gaps after each first token
    assert router["baton:request_prompt_tokens_sum"] == 40 + 3 + 30
    assert router["baton:request_generation_tokens_sum"] == 18.0
    assert router['baton:router_decisions_total{kind="remote",reason="threshold"}'] == 2.0
    assert router['baton:router_decisions_total{kind="local",reason="threshold"}'] == 1.0
    assert router["baton:num_requests_running"] == 0.0

    decode, prefill = scrape(cluster.metrics_ports["d0"]), scrape(cluster.metrics_ports["p0"])
    assert decode['baton:kv_transfer_bytes_total{worker_id="d0"}'] > 0
    assert decode['baton:kv_transfer_seconds_count{worker_id="d0"}'] == 2.0
    for samples, worker_id in ((decode, "d0"), (prefill, "p0")):
        label = f'{{worker_id="{worker_id}"}}'
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                      "prefix_cache_hit_rate"):
            assert f"baton:{gauge}{label}" in samples
    assert prefill['baton:prefix_cache_queries_total{worker_id="p0"}'] > 0  # P looked up both long prompts
    assert prefill['baton:prefix_cache_hits_total{worker_id="p0"}'] > 0  # the third shares LONG_PROMPT's first blocks


def test_an_invalid_request_counts_as_an_error_by_code(cluster):
    before = scrape(cluster.metrics_ports["router"]).get('baton:request_errors_total{code="INVALID_ARGUMENT"}', 0.0)
    with pytest.raises(grpc.RpcError) as info:
        generate(cluster.router.address, [])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(cluster.metrics_ports["router"])['baton:request_errors_total{code="INVALID_ARGUMENT"}']
    assert after == before + 1
