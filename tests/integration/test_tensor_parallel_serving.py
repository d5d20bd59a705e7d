"""Tensor-parallel workers, really started (``--tensor-parallel-size 2``: the worker and its rank process): KV
handed between workers of different degrees through the real tcp data plane, equal to the offline engine in tokens
and their logprobs (tests/oracle.py: one rank's heads of one block wrong would move a logprob, seldom a token), every
rank's bytes moved; a worker whose rank dies exits, deregistered, and the router routes around it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import grpc
import pytest

from kv_transfer.tp_plane import uri_rank
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.integration.test_e2e import _wait_serving, generate_output
from tests.integration.test_workers import PROMPTS, greedy, stub
from tests.oracle import Output, assert_same, handed_off, reference, streamed
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_model import shared_tiny
from worker.convert import layout_from_pb

TP2 = ("--tensor-parallel-size", "2", "--calibrate-tokens", "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    require_redis_server()
    redis = RedisServer.start()
    c = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("logs"))
    try:
        c.workers = {
            # p2 calibrates (a scoring pass under TP); its layers are slowed a little, so streamed reads stream
            "p2": c.start_worker("prefill", "--tensor-parallel-size", "2", "--fault-layer-delay-s", "0.3",
                                 worker_id="p2"),
            "p1": c.start_worker("prefill", "--calibrate-tokens", "0", worker_id="p1"),
            "d1": c.start_worker("decode", "--calibrate-tokens", "0", worker_id="d1"),
            "d2": c.start_worker("decode", *TP2, worker_id="d2"),
        }
        c.wait_for_workers(set(c.workers), timeout_s=180)
        yield c
    finally:
        c.stop_all()
        redis.stop()


PAIRS = ("p2-d1", "p1-d2", "p2-d2")
IMPORTED = [260, *PROMPTS[-1]]  # a prompt whose first 40 tokens p2 holds, imported by d1


def _prompts(pair: str) -> list[list[int]]:
    """PROMPTS behind a token of the pair's own: no pair finds another's blocks cached on its decode worker."""
    return [[200 + PAIRS.index(pair), *p] for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[tuple[int, ...], Output]:
    """The offline engine's (one rank's) tokens and their logprobs by prompt."""
    layerwise = [[250 + i, *PROMPTS[-1]] for i in range(len(PAIRS))]
    prompts = list({tuple(p) for p in [*PROMPTS, *layerwise, IMPORTED, *(q for pair in PAIRS for q in _prompts(pair))]})
    return dict(zip(prompts, reference(model_dir, [list(p) for p in prompts], 12)))


def _handoff(p, d, rid: str, prompt: list[int]) -> tuple[Output, pb.Timings, pb.KVHandle]:
    pre = stub(p.address).Prefill(pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=greedy()))
    responses = list(stub(d.address).Decode(pb.DecodeRequest(request_id=rid, token_ids=[*prompt, pre.first_token],
                                                             sampling=greedy(), handle=pre.handle,
                                                             prompt_len=len(prompt))))
    return handed_off(pre, responses), responses[0].timings, pre.handle


def _assert_pools_full(workers, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [stub(w.address).Stats(pb.StatsRequest()) for w in workers]
        if all(s.num_free_blocks == s.num_total_blocks and s.num_open_leases == 0 and s.num_running == 0
               for s in stats):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not back to full: {stats}")
        time.sleep(0.1)


@pytest.mark.parametrize("pair", PAIRS)
def test_kv_moves_between_degrees_and_decodes_token_exact(cluster, expected, pair):
    """P with TP=2 to D with TP=1 and back, and 2 to 2: every rank's bytes move (a block is the whole model's
    KV), nothing falls back to a local prefill, and the tokens equal the offline engine's."""
    p, d = (cluster.workers[name] for name in pair.split("-"))
    for i, prompt in enumerate(_prompts(pair)):
        output, timings, handle = _handoff(p, d, f"{pair}-{i}", prompt)
        assert_same(output, expected[tuple(prompt)], f"{pair} prompt {i}")
        layout = layout_from_pb(handle.layout)
        assert timings.transfer_blocks >= 1 and not timings.local_fallback, timings
        assert timings.transfer_bytes == timings.transfer_blocks * layout.model_bytes_per_block
    _assert_pools_full([p, d])


async def _layerwise(p, d, rid: str,
                     prompt: list[int]) -> tuple[Output, pb.Timings, pb.PrefillResponse, pb.KVHandle]:
    """The router's layer-wise flow by hand: D starts on P's early handle (sent while the prompt computes) and
    pulls at once; P's first token follows by FirstToken. Returns the tokens and logprobs, D's timings, P's final
    message and the early handle (the final message carries none when D read and released the lease before it)."""
    params = greedy()
    async with grpc.aio.insecure_channel(p.address) as pc, grpc.aio.insecure_channel(d.address) as dc:
        prefill = pb_grpc.WorkerStub(pc).PrefillStream(
            pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=params), timeout=30)
        early = await prefill.read()
        assert early.kv_pending
        decode = pb_grpc.WorkerStub(dc).Decode(pb.DecodeRequest(
            request_id=rid, token_ids=prompt, sampling=params, handle=early.handle, prompt_len=len(prompt),
            first_token_pending=True), timeout=30)
        first = await prefill.read()
        await pb_grpc.WorkerStub(dc).FirstToken(pb.FirstTokenRequest(request_id=rid, token_id=first.first_token),
                                                timeout=10)
        responses = [r async for r in decode]
    return handed_off(first, responses), responses[0].timings, first, early.handle


@pytest.mark.parametrize("pair", ["p2-d1", "p2-d2"])
def test_layerwise_streaming_reads_every_rank_while_the_prompt_computes(cluster, expected, pair):
    """p2's layers take 0.3 s each: D has layer 0 of every rank's blocks before p2's step ends (a margin of about
    one layer), and the tokens are exact, so no rank's server sent a layer before it was computed."""
    p, d = (cluster.workers[name] for name in pair.split("-"))
    prompt = [250 + PAIRS.index(pair), *PROMPTS[-1]]  # fresh: cached nowhere
    output, timings, first, handle = asyncio.run(_layerwise(p, d, f"layerwise-{pair}", prompt))
    assert_same(output, expected[tuple(prompt)], f"{pair} layer-wise")
    assert timings.kv_layerwise and not timings.local_fallback, timings
    assert timings.transfer_bytes == timings.transfer_blocks * layout_from_pb(handle.layout).model_bytes_per_block
    assert timings.kv_first_layer_unix_ms < first.timings.prefill_end_unix_ms, (timings, first.timings)
    _assert_pools_full([p, d])


def test_a_prefix_held_by_a_tp2_worker_is_imported_by_a_tp1_decode_worker(cluster, expected):
    """LeasePrefix on p2 (10 cached blocks), then Decode on d1 with that prefix handle: d1 pulls every rank's share
    of the prefix, re-cuts it into its heads, prefills the rest itself, and the tokens are exact."""
    p2, d1 = cluster.workers["p2"], cluster.workers["d1"]
    warm = stub(p2.address).Prefill(pb.PrefillRequest(request_id="warm", token_ids=IMPORTED[:40], sampling=greedy()))
    assert stub(p2.address).ReleaseLease(pb.ReleaseLeaseRequest(lease_id=warm.handle.lease_id)).found
    handle = stub(p2.address).LeasePrefix(pb.LeasePrefixRequest(token_ids=IMPORTED, min_tokens=40)).handle
    assert handle.num_tokens == 40 and handle.layout.tp_size == 2
    responses = list(stub(d1.address).Decode(pb.DecodeRequest(request_id="import", token_ids=IMPORTED,
                                                               sampling=greedy(), prompt_len=len(IMPORTED),
                                                               prefix_handle=handle), timeout=60))
    assert_same(streamed(responses), expected[tuple(IMPORTED)], "imported from p2")
    timings = responses[0].timings
    assert "imported 40 prefix tokens from p2" in timings.route_reason and timings.transfer_blocks == 10, timings
    assert timings.transfer_bytes == 10 * layout_from_pb(handle.layout).model_bytes_per_block
    _assert_pools_full([p2, d1])


def test_the_layout_names_the_degree_and_the_fingerprint_does_not(cluster):
    handle = _handoff(cluster.workers["p2"], cluster.workers["d1"], "layout", PROMPTS[4])[2]
    assert handle.layout.tp_size == 2 and handle.layout.tp_rank == 0
    assert sorted(uri_rank(u) for u in handle.data_plane_uri.split()) == [0, 1]  # one tcp URI per rank
    one_rank = _handoff(cluster.workers["p1"], cluster.workers["d1"], "layout1", PROMPTS[4])[2]
    assert layout_from_pb(one_rank.layout).tp_size == 1 and len(one_rank.data_plane_uri.split()) == 1
    assert handle.layout.model_fingerprint == one_rank.layout.model_fingerprint
    _assert_pools_full(cluster.workers.values())


def test_a_worker_whose_rank_dies_exits_and_the_router_routes_around_it(cluster, expected):
    """Runs last: kills p2's rank 1. p2's engine loop notices between steps, p2 deregisters and exits 1; a
    router then sends prefills to p1."""
    p2 = cluster.workers["p2"]
    rank_pid = int(re.search(r"started ranks 1\.\.1 \(pids (\d+)\)", p2.log_path.read_text()).group(1))
    os.kill(rank_pid, signal.SIGKILL)
    assert p2.popen.wait(60) == 1, p2.log()
    assert "tensor-parallel rank 1" in p2.log() and "exited with code -9" in p2.log()
    assert "p2" not in asyncio.run(cluster._registered())  # deregistered on its way out
    router = cluster.start_router("--disagg-threshold-tokens", "8", "--policy", "least_loaded")
    _wait_serving(router.address)
    output, last = generate_output(router.address, PROMPTS[5], max_tokens=12)
    assert_same(output, expected[tuple(PROMPTS[5])], "routed around p2")
    assert last.timings.route_kind == "remote" and last.timings.prefill_worker == "p1", last.timings
    _assert_pools_full([cluster.workers[name] for name in ("p1", "d1", "d2")])
