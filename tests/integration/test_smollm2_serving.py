"""The real model served disaggregated: redis-server, router, one prefill and one decode worker, all started on
SmolLM2-135M-Instruct's GGUF. Greedy output through router -> P -> KV pull -> D equals ``transformers`` on the
same file token for token, and the official ``openai`` client's chat question gets an answer naming Paris."""

from __future__ import annotations

import threading

import grpc
import openai
import pytest

from engine.model_source import resolve_model
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster, free_port
from tests.integration.test_e2e import _wait_serving, assert_pools_full
from tests.integration.test_openai import _wait_http
from tests.redis_server import RedisServer, require_redis_server
from tests.smollm2 import CHATS, MAX_TOKENS, assert_greedy_matches

BLOCK = 16
THRESHOLD = 8  # prompts with more uncached tokens are prefilled on p0


@pytest.fixture(scope="module")
def platform(request, tmp_path_factory):
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, resolve_model("smollm2").path, tmp_path_factory.mktemp("smollm2-logs"))
    try:
        cluster.workers = [cluster.start_worker(role, num_blocks=256, block_size=BLOCK, worker_id=name)
                           for role, name in (("prefill", "p0"), ("decode", "d0"))]
        request.getfixturevalue("smollm2_reference")  # transformers' reference computes while the workers load
        cluster.wait_for_workers({"p0", "d0"}, timeout_s=240)
        http_port = free_port()
        cluster.router = cluster.start_router("--disagg-threshold-tokens", str(THRESHOLD), "--policy", "least_loaded",
                                              "--model-name", "smollm2", "--http-port", str(http_port))
        _wait_serving(cluster.router.address)
        cluster.http_url = f"http://127.0.0.1:{http_port}/v1"
        _wait_http(cluster.http_url)
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def generate(address: str, request: pb.GenerateRequest) -> tuple[list[int], pb.GenerateResponse, str]:
    responses = list(pb_grpc.GenerationStub(grpc.insecure_channel(address)).Generate(request, timeout=300))
    return [t for r in responses for t in r.token_ids], responses[-1], "".join(r.text for r in responses)


def test_greedy_through_prefill_and_decode_workers_equals_transformers(platform, smollm2_reference):
    ref = smollm2_reference
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results: dict[int, tuple[list[int], pb.GenerateResponse, str]] = {}

    def run(i: int) -> None:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ref.prompts[i]), sampling=params,
                                     cache_salt="parity")  # a cache of its own: no other test's prefix hits
        results[i] = generate(platform.router.address, request)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ref.prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(len(ref.prompts)))
    for i, (tokens, last, _) in sorted(results.items()):
        assert_greedy_matches(tokens, ref.continuations[i], f"prompt {i} ({len(ref.prompts[i])} tokens)")
        timings = last.timings
        if len(ref.prompts[i]) <= THRESHOLD:
            assert timings.route_kind == "local", timings.route_reason
            continue
        route = (timings.route_kind, timings.prefill_worker, timings.decode_worker)
        assert route == ("remote", "p0", "d0"), timings.route_reason
        assert timings.transfer_blocks > 0, timings.route_reason  # D pulled KV: a recompute moves no block
    assert_pools_full(platform)


def test_the_openai_client_asks_the_capital_of_france_and_hears_paris(platform):
    client = openai.OpenAI(base_url=platform.http_url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="smollm2", messages=CHATS["capital"], temperature=0, max_tokens=48)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    # the same chat through gRPC: prefilled on p0, its KV pulled by d0, stopped at <|im_end|>
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in CHATS["capital"]]),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=48),
                                 cache_salt="grpc")  # d0 cached the chat above: a fresh salt misses, goes remote
    _, last, text = generate(platform.router.address, request)
    assert last.timings.route_kind == "remote" and last.timings.transfer_blocks > 0 and not last.timings.local_fallback
    assert last.finish_reason == pb.FINISH_REASON_STOP and text == choice.message.content
    assert_pools_full(platform)
