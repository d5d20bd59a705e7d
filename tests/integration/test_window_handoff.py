"""A sliding-window model's KV handle covers only the window (issue 24, item 4), through real worker processes and
real Redis: P serves the tiny Mistral (every layer attends within 20 tokens) and, for a 120-token prompt in
blocks of 4, leases and hands out the 5 blocks the next token attends to (from block 25), not the prompt's 30;
D pulls those 5 behind pad entries and decodes what the offline engine decodes, tokens and their logprobs
(tests/oracle.py: a window block with the wrong contents, or a pad entry attended to, moves a logprob). Also
layer-wise (``PrefillStream``), a repeat that D serves partly from its own cache, a handle whose first block
does not fit D's window (D prefills itself and says why), and both pools full afterwards."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.oracle import Output, assert_same, handed_off, reference
from tests.redis_server import RedisServer, require_redis_server

BLOCK, WINDOW, MAX_TOKENS = 4, 20, 12
BYTES_PER_BLOCK = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V x 2 layers x block x 2 KV heads x head_dim 16 x float32
PROMPTS = {n: [random.Random(n).randrange(3, 384) for _ in range(n)] for n in (120, 121, 90)}


def first_block(num_tokens: int) -> int:
    return max(num_tokens - WINDOW + 1, 0) // BLOCK


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints["mistral-swa"]


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[int, Output]:
    """The offline engine's greedy tokens and their logprobs, by prompt length."""
    return dict(zip(PROMPTS, reference(checkpoint.path, list(PROMPTS.values()), MAX_TOKENS, block_size=BLOCK)))


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    require_redis_server()
    redis = RedisServer.start()
    c = Cluster(redis.url, checkpoint.path, tmp_path_factory.mktemp("window-logs"))
    try:
        c.p = c.start_worker("prefill", "--kv-transport", "tcp", num_blocks=64, block_size=BLOCK, worker_id="p-swa")
        c.d = c.start_worker("decode", "--kv-transport", "tcp", num_blocks=64, block_size=BLOCK, worker_id="d-swa")
        c.wait_for_workers({"p-swa", "d-swa"})
        yield c
    finally:
        c.stop_all()
        redis.stop()


def stub(address: str) -> pb_grpc.WorkerStub:
    return pb_grpc.WorkerStub(grpc.insecure_channel(address))


def greedy() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def prefill(cluster, rid: str, prompt: list[int], salt: str = "") -> pb.PrefillResponse:
    return stub(cluster.p.address).Prefill(pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=greedy(),
                                                             cache_salt=salt), timeout=30)


def decode(cluster, rid: str, prompt: list[int], pre: pb.PrefillResponse, handle: pb.KVHandle | None = None,
           salt: str = "") -> tuple[Output, list[pb.DecodeResponse]]:
    responses = list(stub(cluster.d.address).Decode(pb.DecodeRequest(
        request_id=rid, token_ids=[*prompt, pre.first_token], sampling=greedy(), handle=handle or pre.handle,
        prompt_len=len(prompt), cache_salt=salt), timeout=60))
    return handed_off(pre, responses), responses


def assert_pools_full(cluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [stub(w.address).Stats(pb.StatsRequest(), timeout=10) for w in (cluster.p, cluster.d)]
        if all(s.num_free_blocks == s.num_total_blocks and s.num_open_leases == 0 and s.num_running == 0
               for s in stats):
            return
        assert time.monotonic() < deadline, f"pools not full: {stats}"
        time.sleep(0.1)


@pytest.mark.parametrize("n", [120, 121])
def test_the_handle_covers_the_window_and_decode_equals_the_offline_engine(cluster, expected, n):
    salt = f"fresh-{n}-{time.monotonic_ns()}"  # nothing of it is cached on either worker
    pre = prefill(cluster, f"w{n}", PROMPTS[n], salt)
    handle, num_window = pre.handle, -(-n // BLOCK) - first_block(n)
    assert (handle.first_block, len(handle.block_ids), handle.num_tokens) == (first_block(n), num_window, n)
    assert (handle.layout.num_layers, handle.layout.num_kv_heads, handle.layout.head_dim) == (2, 2, 16)
    p_stats = stub(cluster.p.address).Stats(pb.StatsRequest(), timeout=10)
    assert p_stats.num_total_blocks - p_stats.num_free_blocks == num_window  # only the window is pinned
    output, responses = decode(cluster, f"w{n}", PROMPTS[n], pre, salt=salt)
    t = responses[0].timings
    assert_same(output, expected[n], f"{n} tokens")
    assert not t.local_fallback and t.lease_released and t.transport == "tcp", t
    assert t.transfer_blocks == num_window and t.transfer_bytes == num_window * BYTES_PER_BLOCK, t
    assert responses[-1].num_cached_tokens == 0
    assert_pools_full(cluster)


def test_a_repeat_pulls_only_what_d_does_not_cache_from_the_window_on(cluster, expected):
    """D committed the window blocks it pulled (never a pad entry): the same prompt again (P serves it from its
    prefix cache) has D reuse its 5 full window blocks and pull only the partial last one."""
    n, salt = 121, f"repeat-{time.monotonic_ns()}"
    for i in range(2):
        pre = prefill(cluster, f"rep{i}", PROMPTS[n], salt)
        output, responses = decode(cluster, f"rep{i}", PROMPTS[n], pre, salt=salt)
        assert_same(output, expected[n], f"request {i}")
        assert not responses[0].timings.local_fallback, responses[0].timings
    assert pre.num_cached_tokens == 120  # P: every full block from its prefix cache, the early ones too
    assert responses[0].timings.transfer_blocks == 1 and responses[-1].num_cached_tokens == 5 * BLOCK
    assert_pools_full(cluster)


def test_a_handle_that_skips_blocks_d_attends_to_is_recomputed_locally(cluster, expected):
    n, salt = 120, f"skip-{time.monotonic_ns()}"
    pre = prefill(cluster, "skip", PROMPTS[n], salt)
    handle = pb.KVHandle()
    handle.CopyFrom(pre.handle)
    handle.first_block += 1  # claims block 25 fell out of the window: D's next token attends to it
    del handle.block_ids[0]
    fallbacks = stub(cluster.d.address).Stats(pb.StatsRequest(), timeout=10).kv_pull_fallbacks
    output, responses = decode(cluster, "skip", PROMPTS[n], pre, handle=handle, salt=salt)
    assert_same(output, expected[n], "recomputed")
    t = responses[0].timings
    assert t.local_fallback and "KV handle unusable" in t.route_reason and t.transfer_blocks == 0, t
    assert stub(cluster.d.address).Stats(pb.StatsRequest(), timeout=10).kv_pull_fallbacks == fallbacks + 1
    assert_pools_full(cluster)  # D released P's lease though it pulled nothing


def test_layerwise_the_lease_pinned_at_admission_covers_the_window(cluster, expected):
    """``PrefillStream``: the handle sent before the prompt is computed already names only the window blocks;
    D streams them in and decodes the offline engine's tokens."""
    n, rid = 90, f"lw-{time.monotonic_ns()}"

    async def run():
        async with grpc.aio.insecure_channel(cluster.p.address) as p, grpc.aio.insecure_channel(cluster.d.address) as d:
            messages = [m async for m in pb_grpc.WorkerStub(p).PrefillStream(pb.PrefillRequest(
                request_id=rid, token_ids=PROMPTS[n], sampling=greedy(), cache_salt=rid), timeout=30)]
            assert [m.kv_pending for m in messages] == [True, False]
            handle, first = messages[0].handle, messages[1]
            d_stub = pb_grpc.WorkerStub(d)
            await d_stub.FirstToken(pb.FirstTokenRequest(request_id=rid, token_id=first.first_token), timeout=10)
            responses = [r async for r in d_stub.Decode(pb.DecodeRequest(
                request_id=rid, token_ids=PROMPTS[n], sampling=greedy(), handle=handle, prompt_len=n,
                first_token_pending=True, cache_salt=rid), timeout=60)]
        return handle, handed_off(first, responses), responses[0].timings

    handle, output, t = asyncio.run(run())
    assert (handle.first_block, len(handle.block_ids)) == (first_block(n), -(-n // BLOCK) - first_block(n))
    assert_same(output, expected[n], "layer-wise")
    assert t.kv_layerwise and not t.local_fallback and t.transfer_blocks == len(handle.block_ids), t
    assert_pools_full(cluster)
