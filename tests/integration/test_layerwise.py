"""Layer-wise KV streaming through the serving path (router ``--kv-layerwise``), with real processes.

P answers ``PrefillStream`` with the KV handle as soon as the step computing the prompt starts; the
router starts Decode on D at once (D pulls over tcp, each layer as P writes it) and hands D P's first
token by ``FirstToken`` when it comes. Greedy output must equal the offline engine's, tokens and their logprobs
(tests/oracle.py: a layer streamed before it was written, or into the wrong block, moves a logprob), and
every pool must be full again afterwards (over cma and nccl, the other streaming transports, too). The
worker-level tests drive the RPCs by hand, including the orders the router does not produce (FirstToken
before Decode, a recompute order, a token that never comes).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.integration.test_e2e import (  # noqa: F401
    MAX_TOKENS, PROMPTS, _wait_serving, assert_pools_full, expected_outputs, model_dir,
)
from tests.oracle import Output, assert_same, handed_off, streamed
from tests.redis_server import RedisServer, require_redis_server


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):  # noqa: F811
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("layerwise-logs"))
    cluster.workers = [cluster.start_worker("prefill", "--kv-transport", "tcp", worker_id="p0"),
                       cluster.start_worker("decode", "--kv-transport", "tcp", worker_id="d0")]
    try:
        cluster.wait_for_workers({"p0", "d0"})
        cluster.router = cluster.start_router("--disagg-threshold-tokens", "8", "--policy", "least_loaded",
                                              "--kv-layerwise")
        _wait_serving(cluster.router.address)
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def generate(cluster, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[Output, pb.GenerateResponse]:
    """Greedy with each token's logprob, under a fresh tenant salt: no prefix is cached anywhere, so every prompt
    goes remote."""
    with grpc.insecure_channel(cluster.router.address) as channel:
        params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params,
                                     cache_salt=f"salt-{time.monotonic_ns()}")
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
    return streamed(responses), responses[-1]


def test_streamed_kv_gives_the_engines_tokens(cluster, expected_outputs):  # noqa: F811
    for i in (20, 21, 23):
        output, final = generate(cluster, PROMPTS[i])
        t = final.timings
        assert_same(output, expected_outputs[i], f"prompt {i}")
        assert (t.route_kind, t.prefill_worker, t.decode_worker) == ("remote", "p0", "d0"), t
        assert t.kv_layerwise and t.transport == "tcp" and t.transfer_bytes > 0 and not t.local_fallback, t
    assert_pools_full(cluster)


def test_concurrent_streamed_requests_are_exact(cluster, expected_outputs):  # noqa: F811
    indices = [20, 21, 22, 23, 20, 22]
    with ThreadPoolExecutor(len(indices)) as pool:
        results = list(pool.map(lambda i: generate(cluster, PROMPTS[i]), indices))
    for i, (output, final) in zip(indices, results):
        assert_same(output, expected_outputs[i], f"prompt {i}")
        assert final.timings.route_kind == "remote" and not final.timings.local_fallback, final.timings
    assert_pools_full(cluster)


def test_a_first_token_that_ends_the_request_stops_the_waiting_decode(cluster, expected_outputs):  # noqa: F811
    output, final = generate(cluster, PROMPTS[22], max_tokens=1)
    assert_same(output, expected_outputs[22][:1], "P's first token")
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert_pools_full(cluster)  # D's reservation aborted, P's lease released


LAYER_DELAY_S = 0.4  # the streaming clusters' P: each of the tiny model's 2 layers takes this much longer


@pytest.fixture(scope="module", params=["tcp", "cma", "nccl", "tcp+staged"])
def streaming_cluster(request, model_dir, tmp_path_factory):  # noqa: F811
    """P and D serving and pulling over one streaming transport (``STREAMING_KINDS``) only; P's layers are slow
    on purpose (``--fault-layer-delay-s``), as a big model's are, so a streamed pull visibly overlaps them.
    ``+staged``: both move the KV through host staging blocks (``--kv-staging always``, as a GPU cache would)."""
    kind, _, staged = request.param.partition("+")
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp(f"layerwise-{kind}{staged}-logs"))
    flags = ("--kv-transport", kind, *(("--kv-staging", "always") if staged else ()))
    cluster.workers = [cluster.start_worker("prefill", *flags, "--fault-layer-delay-s", str(LAYER_DELAY_S),
                                            worker_id="p0"),
                       cluster.start_worker("decode", *flags, worker_id="d0")]
    cluster.staged = bool(staged)
    try:
        cluster.wait_for_workers({"p0", "d0"})
        cluster.router = cluster.start_router("--disagg-threshold-tokens", "8", "--policy", "least_loaded",
                                              "--kv-layerwise")
        _wait_serving(cluster.router.address)
        yield kind, cluster
    finally:
        cluster.stop_all()
        redis.stop()


def test_streamed_kv_lands_while_p_still_computes_and_gives_the_engines_tokens(streaming_cluster,
                                                                                expected_outputs):  # noqa: F811
    """By the instants the workers record (one host, one clock): D had the first layer of every block while
    P's step was still computing the second, a layer's time before it ended; a P that handed the KV out
    only once its step ended would have D's first layer land after that."""
    kind, cluster = streaming_cluster
    indices = [20, 21, 23, 22]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda i: generate(cluster, PROMPTS[i]), indices))
    for i, (output, final) in zip(indices, results):
        t = final.timings
        assert_same(output, expected_outputs[i], f"prompt {i} over {kind}{'+staged' if cluster.staged else ''}")
        assert (t.route_kind, t.prefill_worker, t.decode_worker) == ("remote", "p0", "d0"), t
        assert t.kv_layerwise and t.transport == kind and t.transfer_bytes > 0 and not t.local_fallback, t
        assert t.kv_first_layer_unix_ms > 0 and t.prefill_end_unix_ms > 0, t
        ahead_ms = t.prefill_end_unix_ms - t.kv_first_layer_unix_ms
        assert ahead_ms > LAYER_DELAY_S * 1e3 / 4, f"the first layer landed {ahead_ms:.0f} ms before P's step ended"
    if cluster.staged:  # the KV went through both workers' staging blocks, all back in their pools
        stats = [pb_grpc.WorkerStub(grpc.insecure_channel(w.address)).Stats(pb.StatsRequest(), timeout=10)
                 for w in cluster.workers]
        assert all(s.num_staging_blocks > 0 for s in stats), stats
    assert_pools_full(cluster)  # staging blocks too


# ---- the RPCs by hand ------------------------------------------------------------------------------


def _addresses(cluster) -> dict[str, str]:
    with grpc.insecure_channel(cluster.router.address) as channel:
        rows = pb_grpc.AdminStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=10).workers
    return {w.worker_id: w.grpc_address for w in rows}


async def _by_hand(cluster, prompt: list[int], *, first_token_before_decode: bool, recompute: bool = False):
    addresses = _addresses(cluster)
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    request_id = salt = f"by-hand-{time.monotonic_ns()}"  # a fresh salt: nothing of it is cached on D
    async with grpc.aio.insecure_channel(addresses["p0"]) as p, grpc.aio.insecure_channel(addresses["d0"]) as d:
        prefill = pb_grpc.WorkerStub(p).PrefillStream(
            pb.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=params, cache_salt=salt), timeout=30)
        messages = [m async for m in prefill]
        assert [m.kv_pending for m in messages] == [True, False]
        handle, first = messages[0].handle, messages[1]
        assert handle.lease_id and handle.data_plane_uri.startswith("tcp://")
        assert messages[1].handle.lease_id == handle.lease_id  # the same lease, pinned at admission
        decode_stub = pb_grpc.WorkerStub(d)
        deliver = pb.FirstTokenRequest(request_id=request_id, token_id=first.first_token, recompute=recompute)
        if first_token_before_decode:
            assert not (await decode_stub.FirstToken(deliver, timeout=10)).found  # kept until Decode asks
        decode = decode_stub.Decode(pb.DecodeRequest(
            request_id=request_id, token_ids=prompt, sampling=params, handle=handle, prompt_len=len(prompt),
            first_token_pending=True, cache_salt=salt), timeout=30)
        if not first_token_before_decode:
            await asyncio.sleep(0.2)  # Decode is (most likely) waiting for it; kept for it either way
            await decode_stub.FirstToken(deliver, timeout=10)
        responses = [r async for r in decode]
        await pb_grpc.WorkerStub(p).ReleaseLease(pb.ReleaseLeaseRequest(lease_id=handle.lease_id), timeout=10)
    return first, responses


@pytest.mark.parametrize("first_token_before_decode", [False, True])
def test_decode_waits_for_the_first_token_in_either_order(cluster, expected_outputs,  # noqa: F811
                                                           first_token_before_decode):
    first, responses = asyncio.run(_by_hand(cluster, PROMPTS[21], first_token_before_decode=first_token_before_decode))
    assert_same(handed_off(first, responses), expected_outputs[21], "by hand")
    assert responses[0].timings.kv_layerwise and responses[0].timings.transfer_bytes > 0
    assert_pools_full(cluster)


def test_a_recompute_order_makes_decode_prefill_itself(cluster, expected_outputs):  # noqa: F811
    _, responses = asyncio.run(_by_hand(cluster, PROMPTS[23], first_token_before_decode=False, recompute=True))
    # D sampled the first token itself: its whole stream starts with the token P sent too
    assert_same(streamed(responses), expected_outputs[23], "recomputed on D")
    assert "prefilled locally" in responses[0].timings.route_reason
    assert_pools_full(cluster)


def test_a_first_token_that_never_comes_fails_decode_and_frees_its_blocks(cluster):
    async def run() -> grpc.StatusCode:
        addresses = _addresses(cluster)
        prompt = PROMPTS[20]
        params = pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        async with grpc.aio.insecure_channel(addresses["p0"]) as p, grpc.aio.insecure_channel(addresses["d0"]) as d:
            prefill = pb_grpc.WorkerStub(p).Prefill(pb.PrefillRequest(request_id="never-p", token_ids=prompt,
                                                                      sampling=params), timeout=30)
            handle = (await prefill).handle
            decode = pb_grpc.WorkerStub(d).Decode(pb.DecodeRequest(  # D waits at most the call's deadline
                request_id="never-d", token_ids=prompt, sampling=params, handle=handle, prompt_len=len(prompt),
                first_token_pending=True), timeout=1.5)
            try:
                async for _ in decode:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            finally:
                await pb_grpc.WorkerStub(p).ReleaseLease(pb.ReleaseLeaseRequest(lease_id=handle.lease_id), timeout=10)
        return grpc.StatusCode.OK

    # the deadline, or D's own bound on the wait just before it: either way a clear status, never a hang
    assert asyncio.run(run()) in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    assert_pools_full(cluster)


def test_bad_layerwise_requests_get_clear_errors(cluster):
    """first_token_pending without a handle is INVALID_ARGUMENT; FirstToken for an unknown request is kept
    for no one (found=false) and expires; a prefill worker has no FirstToken at all (UNIMPLEMENTED)."""
    addresses = _addresses(cluster)
    params = pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with grpc.insecure_channel(addresses["d0"]) as d, grpc.insecure_channel(addresses["p0"]) as p:
        decode = pb_grpc.WorkerStub(d)
        with pytest.raises(grpc.RpcError) as info:
            list(decode.Decode(pb.DecodeRequest(request_id="no-handle", token_ids=PROMPTS[20], sampling=params,
                                                prompt_len=len(PROMPTS[20]), first_token_pending=True), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "handle" in info.value.details()
        reply = decode.FirstToken(pb.FirstTokenRequest(request_id="nobody", token_id=5), timeout=10)
        assert not reply.found
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.WorkerStub(p).FirstToken(pb.FirstTokenRequest(request_id="x", token_id=1), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert_pools_full(cluster)
