"""Speculative decoding through real processes (issue 24, item 1): a decode worker started with
``--speculative-config`` (n-gram drafts) serves through the router after a remote prefill; every output equals the
offline engine without speculation, tokens and their logprobs (tests/oracle.py; a verify step's logprobs equal a
plain decode step's within 1e-6 here); the last response's timings say how many drafts were
proposed and accepted; the worker's metrics count them; pools return to full."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster, free_port
from tests.integration.test_e2e import PROMPTS, _wait_serving, assert_pools_full, model_dir  # noqa: F401
from tests.oracle import assert_same, reference, streamed
from tests.redis_server import RedisServer, require_redis_server

MAX_TOKENS = 48  # long enough for the tiny model's greedy loops, which n-gram drafts predict
CASES = PROMPTS[6:14]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "probe_tokens": 1000}


@pytest.fixture(scope="module")
def expected(model_dir):  # noqa: F811
    """The offline engine's greedy tokens and their logprobs, without speculation."""
    return reference(model_dir, CASES, MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):  # noqa: F811
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("spec-logs"))
    try:
        cluster.metrics_port = free_port()
        cluster.workers = [cluster.start_worker("prefill", worker_id="p0"),
                           cluster.start_worker("decode", "--speculative-config", json.dumps(SPEC), "--metrics-port",
                                                str(cluster.metrics_port), worker_id="d0")]
        cluster.wait_for_workers({"p0", "d0"})
        cluster.router = cluster.start_router("--disagg-threshold-tokens", "8", "--policy", "least_loaded")
        _wait_serving(cluster.router.address)
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def test_outputs_equal_the_engine_without_speculation_and_timings_count_drafts(cluster, expected):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(cluster.router.address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    drafted = accepted = 0
    for i, (prompt, want) in enumerate(zip(CASES, expected)):
        responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params),
                                       timeout=120))
        timings = responses[-1].timings
        assert_same(streamed(responses), want, f"case {i} ({len(prompt)} tokens)")
        assert timings.route_kind == "remote" and timings.transfer_blocks > 0  # prefilled on P, decoded on D
        drafted, accepted = drafted + timings.spec_draft_tokens, accepted + timings.spec_accepted_tokens
    assert accepted >= 50 and drafted >= accepted  # drafts ran, and most paid off on these loops
    deadline = time.monotonic() + 10  # the worker samples its engine's stats every second or so
    while (counted := _metric(cluster.metrics_port, "baton:spec_decode_num_accepted_tokens_total")) != accepted:
        assert time.monotonic() < deadline, f"metrics count {counted} accepted drafts, timings {accepted}"
        time.sleep(0.2)
    assert_pools_full(cluster)


def _metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(next(line for line in body.splitlines() if line.startswith(name)).split()[-1])
