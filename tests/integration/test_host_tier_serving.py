"""The host tier in a running worker (issue 40): Redis and two decode workers with the same small KV pool (24 blocks
of 4 tokens), ``wh`` with a host tier (``--kv-host-blocks 64``) and ``wn`` without, both calibrating at start as a
deployed worker does (``--calibrate-tokens`` left at its default: ``wh``'s calibration prices a copy from the host
tier against recomputing and decides whether hits load). Each serves a prompt, then fillers that push it out of its
pool, then the prompt again (``Worker/Decode``, local prefill): on ``wh`` its 12 blocks come back from host memory
(the worker's ``kv_host_tier_loaded`` counter, the 48 cached tokens it reports, a better prefix hit rate than
``wn``'s), on ``wn`` they are recomputed; every output equals the offline engine's, greedy, tokens and each token's
log-probability (tokens alone do not see a block loaded with the wrong bytes: the tiny checkpoint's greedy
continuations hardly depend on the prompt).
"""

from __future__ import annotations

import re
import time

import grpc
import pytest

from engine import LLM, SamplingParams
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster, free_port
from tests.integration.test_e2e import assert_pools_full
from tests.integration.test_metrics import scrape
from tests.oracle import Output, assert_same, streamed
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_model import shared_tiny

BLOCK = 4
MAX_TOKENS = 10
PROMPT = [(11 * j + 5) % 3000 + 10 for j in range(50)]  # 12 reusable blocks
FILLERS = [[(7 * i + 3 * j) % 3000 + 10 for j in range(n)] for i, n in ((13, 64), (14, 65), (15, 70))]  # 16-18 blocks
GREEDY = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[tuple[int, ...], tuple[list[int], list[float]]]:
    """The offline engine's greedy tokens and each one's log-probability, per prompt."""
    llm = LLM(str(model_dir), num_blocks=512, block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompts = [PROMPT, *FILLERS]
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return {tuple(p): (o.token_ids, [chosen for chosen, _ in o.logprobs]) for p, o in zip(prompts, outputs)}


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("host-tier-logs"))
    cluster.metrics = {"wh": free_port(), "wn": free_port()}
    cluster.workers = [
        cluster.start_worker("decode", "--kv-host-blocks", "64", "--metrics-port", str(cluster.metrics["wh"]),
                             num_blocks=24, block_size=BLOCK, worker_id="wh"),
        cluster.start_worker("decode", "--metrics-port", str(cluster.metrics["wn"]), num_blocks=24,
                             block_size=BLOCK, worker_id="wn"),
    ]
    try:
        cluster.wait_for_workers({"wh", "wn"})
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def decode(cluster: Cluster, worker_id: str, prompt: list[int], expected) -> int:
    """The prompt tokens the worker reported cached, once its greedy output was checked against the offline
    engine's."""
    (proc,) = [w for w in cluster.workers if w.name == worker_id]
    request = pb.DecodeRequest(request_id=f"r-{time.monotonic_ns()}", token_ids=prompt, sampling=GREEDY,
                               prompt_len=len(prompt))
    responses = list(pb_grpc.WorkerStub(grpc.insecure_channel(proc.address)).Decode(request, timeout=60))
    assert_same(streamed(responses), Output(*expected[tuple(prompt)]), f"{worker_id}, {len(prompt)}-token prompt")
    return responses[-1].num_cached_tokens


def metric(cluster: Cluster, worker_id: str, name: str) -> float:
    return scrape(cluster.metrics[worker_id]).get(f'{name}{{worker_id="{worker_id}"}}', 0.0)


def test_a_prefix_evicted_from_the_pool_loads_from_the_host_tier(cluster, expected):
    (wh,) = [w for w in cluster.workers if w.name == "wh"]
    calibrated = re.search(r"host tier: 64 blocks .*a block copies up in .*", wh.log_path.read_text())
    assert calibrated is not None and calibrated.group().endswith("loads hits"), wh.log()  # the real decision ran
    cached = {}
    for worker_id in ("wh", "wn"):
        for prompt in (PROMPT, *FILLERS):  # the fillers evict every block of PROMPT from the 24-block pool
            assert decode(cluster, worker_id, prompt, expected) == 0, (worker_id, len(prompt))
        cached[worker_id] = decode(cluster, worker_id, PROMPT, expected)
    assert cached == {"wh": 48, "wn": 0}  # wh: all 12 of PROMPT's blocks from host memory; wn: none left
    deadline = time.monotonic() + 10  # the workers sample their engine's counters every 0.25 s
    while metric(cluster, "wh", "baton:kv_host_tier_loaded_total") < 12 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(cluster, "wh", "baton:kv_host_tier_loaded_total") == 12
    assert metric(cluster, "wh", "baton:kv_host_tier_saved_total") >= 12
    assert metric(cluster, "wn", "baton:kv_host_tier_loaded_total") == 0
    hit_rate = {w: metric(cluster, w, "baton:prefix_cache_hit_rate") for w in ("wh", "wn")}
    assert hit_rate["wh"] > hit_rate["wn"], hit_rate
    assert_pools_full(cluster)
