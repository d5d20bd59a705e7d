"""A quantized KV cache through real processes (issue 24, item 3): a prefill and a decode worker both started with
``--kv-cache-dtype int8`` move the quantized rows and their scales over the data plane (fewer bytes than a
float32 cache's, by the layout's arithmetic) and decode what the offline int8 engine decodes. (Workers of one
model with different KV dtypes register different fingerprints, so a router never pairs them: the served scheme
is the decode pool's; a handle of the other layout would be refused before any byte moves, as any mismatch.)"""

from __future__ import annotations

import grpc
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.integration.test_e2e import PROMPTS, _wait_serving, assert_pools_full, model_dir  # noqa: F401
from tests.redis_server import RedisServer, require_redis_server

MAX_TOKENS = 8
CASES = PROMPTS[10:16]


def _offline(model_dir, kv_cache_dtype: str) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=512, block_size=4, kv_cache_dtype=kv_cache_dtype))
    for i, prompt in enumerate(CASES):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    out: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            out.setdefault(int(delta.request_id), []).extend(delta.new_token_ids)
    return [out[i] for i in range(len(CASES))]


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


def _generate(cluster, prompt: list[int]) -> tuple[list[int], pb.Timings]:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(cluster.router.address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params),
                                   timeout=60))
    return [t for r in responses for t in r.token_ids], responses[-1].timings


def test_int8_kv_moves_between_int8_workers(cluster, model_dir):  # noqa: F811
    bytes_per_block = 2 * 4 * 2 * (16 + 4) * 2  # K and V x block 4 x 2 KV heads x (16 values + scale) x 2 layers
    for prompt, want in zip(CASES, _offline(model_dir, "int8")):
        tokens, timings = _generate(cluster, prompt)
        assert tokens == want
        assert timings.route_kind == "remote" and not timings.local_fallback and timings.transfer_blocks > 0, timings
        assert timings.transfer_bytes == timings.transfer_blocks * bytes_per_block  # 0.31x a float32 block's
    assert_pools_full(cluster)
