"""A quantized KV cache through real processes (issue 24, item 3): a prefill and a decode worker both started with
``--kv-cache-dtype int8`` move the quantized rows and their scales over the data plane (fewer bytes than a
float32 cache's, by the layout's arithmetic) and decode what the offline int8 engine decodes, tokens and their
logprobs (tests/oracle.py: the quantized rows and scales moved as P wrote them, byte for byte). (Workers of one
model with different KV dtypes register different fingerprints, so a router never pairs them: the served scheme
is the decode pool's; a handle of the other layout would be refused before any byte moves, as any mismatch.)"""

from __future__ import annotations

import pytest

from tests.integration.cluster import Cluster
from tests.integration.test_e2e import PROMPTS, _wait_serving, assert_pools_full, generate_output, model_dir  # noqa: F401
from tests.oracle import assert_same, reference
from tests.redis_server import RedisServer, require_redis_server

MAX_TOKENS = 8
CASES = PROMPTS[10:16]


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):  # noqa: F811
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("quant-logs"))
    try:
        cluster.workers = [cluster.start_worker(role, "--kv-cache-dtype", "int8", worker_id=f"{role}-int8")
                           for role in ("prefill", "decode")]
        cluster.wait_for_workers({"prefill-int8", "decode-int8"})
        cluster.router = cluster.start_router("--disagg-threshold-tokens", "8", "--policy", "least_loaded")
        _wait_serving(cluster.router.address)
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def test_int8_kv_moves_between_int8_workers(cluster, model_dir):  # noqa: F811
    bytes_per_block = 2 * 4 * 2 * (16 + 4) * 2  # K and V x block 4 x 2 KV heads x (16 values + scale) x 2 layers
    for i, (prompt, want) in enumerate(zip(CASES, reference(model_dir, CASES, MAX_TOKENS, kv_cache_dtype="int8"))):
        output, last = generate_output(cluster.router.address, prompt, MAX_TOKENS, timeout=60)
        assert_same(output, want, f"case {i} ({len(prompt)} tokens)")
        timings = last.timings
        assert timings.route_kind == "remote" and not timings.local_fallback and timings.transfer_blocks > 0, timings
        assert timings.transfer_bytes == timings.transfer_blocks * bytes_per_block  # 0.31x a float32 block's
    assert_pools_full(cluster)
