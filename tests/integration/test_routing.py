"""KV-aware routing with real processes (1 prefill + 3 decode workers): a request that repeats a long
prefix lands on the decode worker that holds it; another tenant's salt never reuses it."""

from __future__ import annotations

import time

import grpc
import pytest

from engine.tiny import build_model
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.test_e2e import assert_pools_full, start_cluster

PREFIX = [(13 * j) % 2500 + 20 for j in range(120)]  # 30 blocks of 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("tiny"), train_steps=20, progress=lambda _: None)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    cluster, redis = start_cluster(model_dir, tmp_path_factory.mktemp("logs"), prefill=1, decode=3, policy="cost")
    yield cluster
    cluster.stop_all()
    redis.stop()


def generate(cluster, prompt: list[int], salt: str = "") -> pb.GenerateResponse:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(cluster.router.address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params, cache_salt=salt)
    return list(stub.Generate(request, timeout=60))[-1]


def wait_indexed(seconds: float = 1.0) -> None:
    time.sleep(seconds)  # workers publish block events to the Redis index every 0.25 s


def test_a_repeated_long_prefix_lands_where_it_is_cached(cluster):
    first = generate(cluster, PREFIX + [7, 8, 9])
    holder = first.timings.decode_worker
    assert first.usage.cached_prompt_tokens == 0
    wait_indexed()
    for suffix in ([1, 2, 3, 4, 5], [40, 41], [99] * 9):
        again = generate(cluster, PREFIX + suffix)
        assert again.timings.decode_worker == holder, again.timings.route_reason
        assert again.usage.cached_prompt_tokens >= len(PREFIX), again.timings.route_reason
        assert again.timings.predicted_ttft_ms > 0  # the cost model's prediction, beside the measured ttft
        wait_indexed(0.3)
    assert_pools_full(cluster)


def test_another_tenant_salt_never_reuses_the_prefix(cluster):
    generate(cluster, PREFIX + [5, 5, 5], salt="tenant-a")
    wait_indexed()
    same_tenant = generate(cluster, PREFIX + [6, 6, 6], salt="tenant-a")
    other_tenant = generate(cluster, PREFIX + [6, 6, 6], salt="tenant-b")
    assert same_tenant.usage.cached_prompt_tokens >= len(PREFIX)
    assert other_tenant.usage.cached_prompt_tokens == 0
    assert_pools_full(cluster)
