"""Cross-worker prefix reuse with real processes: Redis, a prefill worker ``pa`` and a decode worker ``db``.

The RPCs are driven by hand, as the router drives them: ``LeasePrefix`` on the worker holding a cached
prefix, ``Decode`` on the other with ``prefix_handle`` (it pulls the prefix over tcp and prefills only the
rest), then ``ReleaseLease``; both workers move the KV through host staging (``--kv-staging always``).
Greedy output equals the offline engine's, tokens and their logprobs (tests/oracle.py: an imported block with the
wrong contents moves a logprob, seldom a token), and every pool (staging too) is full again
afterwards, also when the handle is bad (the decode worker recomputes and says why).
"""

from __future__ import annotations

import time

import grpc
import pytest

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.integration.kv_proxy import KVProxy
from tests.integration.test_e2e import MAX_TOKENS, PROMPTS, assert_pools_full, expected_outputs, model_dir  # noqa: F401
from tests.oracle import assert_same, streamed
from tests.redis_server import RedisServer, require_redis_server

BLOCK = 4  # the cluster's block size
GREEDY = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
PROMPT = 20  # PROMPTS[20]: 128 tokens
WARM_TOKENS = 102  # the first 102 of them are cached on pa: 25 whole blocks


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):  # noqa: F811
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("prefix-import-logs"))
    # both through host staging (--kv-staging always): the handles name pa's cache blocks, which its tcp server
    # translates to their staging blocks; db pulls into its own staging blocks and copies them into its cache
    # (test_tls imports a prefix without staging)
    staged = ("--kv-transport", "tcp", "--kv-staging", "always")
    cluster.workers = [cluster.start_worker("prefill", *staged, worker_id="pa"),
                       cluster.start_worker("decode", *staged, worker_id="db")]
    try:
        cluster.wait_for_workers({"pa", "db"})
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def stub(cluster, worker_id: str) -> pb_grpc.WorkerStub:
    (proc,) = [w for w in cluster.workers if w.name == worker_id]
    return pb_grpc.WorkerStub(grpc.insecure_channel(proc.address))


def fresh_salt() -> str:
    return f"tenant-{time.monotonic_ns()}"  # nothing of it is cached anywhere yet


def warm(cluster, salt: str, tokens: list[int]) -> None:
    """Prefill ``tokens`` on pa and end its lease: the full blocks stay in pa's prefix cache."""
    pa = stub(cluster, "pa")
    reply = pa.Prefill(pb.PrefillRequest(request_id=f"warm-{salt}", token_ids=tokens, sampling=GREEDY,
                                         cache_salt=salt), timeout=30)
    assert pa.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=reply.handle.lease_id), timeout=10).found


def lease(cluster, worker_id: str, tokens: list[int], salt: str, min_tokens: int = 0) -> pb.LeasePrefixResponse:
    request = pb.LeasePrefixRequest(token_ids=tokens, cache_salt=salt, min_tokens=min_tokens)
    return stub(cluster, worker_id).LeasePrefix(request, timeout=10)


def decode(cluster, tokens: list[int], salt: str, **handles) -> list[pb.DecodeResponse]:
    request = pb.DecodeRequest(request_id=f"r-{time.monotonic_ns()}", token_ids=tokens, sampling=GREEDY,
                               prompt_len=len(tokens), cache_salt=salt, **handles)
    return list(stub(cluster, "db").Decode(request, timeout=60))


def test_decode_imports_a_leased_prefix_and_prefills_the_rest(cluster, expected_outputs):  # noqa: F811
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    warm(cluster, salt, prompt[:WARM_TOKENS])
    handle = lease(cluster, "pa", prompt, salt, min_tokens=100).handle
    assert (handle.worker_id, handle.num_tokens, len(handle.block_ids), len(handle.block_hashes)) == ("pa", 100, 25, 25)
    assert handle.lease_id and handle.data_plane_uri.startswith("tcp://")
    responses = decode(cluster, prompt, salt, prefix_handle=handle)
    assert_same(streamed(responses), expected_outputs[PROMPT], "prefix imported")
    t = responses[0].timings
    assert responses[-1].num_cached_tokens == 100
    assert t.transfer_bytes > 0 and t.transfer_blocks == 25 and t.transport == "tcp", t
    assert "imported 100 prefix tokens from pa" in t.route_reason
    # db released pa's lease itself the moment its pull ended (the direct handoff): nothing left to release
    assert t.lease_released
    assert not stub(cluster, "pa").ReleaseLease(pb.ReleaseLeaseRequest(lease_id=handle.lease_id), timeout=10).found
    assert_pools_full(cluster)
    # db now caches the whole prompt's blocks under its own hashes: it can lease them in turn
    again = lease(cluster, "db", prompt, salt).handle
    assert again.worker_id == "db" and again.num_tokens == 124 and list(again.block_hashes[:25]) == list(
        handle.block_hashes)
    assert stub(cluster, "db").ReleaseLease(pb.ReleaseLeaseRequest(lease_id=again.lease_id), timeout=10).found
    assert_pools_full(cluster)


def test_lease_prefix_without_a_cached_prefix_answers_no_handle(cluster):
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    assert not lease(cluster, "pa", prompt, salt).HasField("handle")
    warm(cluster, salt, prompt[:WARM_TOKENS])
    assert not lease(cluster, "pa", prompt, salt, min_tokens=101).HasField("handle")
    assert_pools_full(cluster)


def test_bad_lease_prefix_input_is_invalid_argument(cluster):
    for tokens in ([], [10, 1 << 30]):
        with pytest.raises(grpc.RpcError) as info:
            lease(cluster, "pa", tokens, "")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_pools_full(cluster)


def test_decode_with_handle_and_prefix_handle_is_invalid_argument(cluster):
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    warm(cluster, salt, prompt[:WARM_TOKENS])
    handle = lease(cluster, "pa", prompt, salt).handle
    try:
        for extra in ({"handle": handle}, {"first_token_pending": True}):
            with pytest.raises(grpc.RpcError) as info:
                decode(cluster, prompt, salt, prefix_handle=handle, **extra)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        stub(cluster, "pa").ReleaseLease(pb.ReleaseLeaseRequest(lease_id=handle.lease_id), timeout=10)
    assert_pools_full(cluster)


@pytest.mark.parametrize("breakage", ["bogus lease", "other tenant"])
def test_a_bad_prefix_handle_is_recomputed_exactly(cluster, expected_outputs, breakage):  # noqa: F811
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    warm(cluster, salt, prompt[:WARM_TOKENS])
    handle = lease(cluster, "pa", prompt, salt).handle
    sent = pb.KVHandle()
    sent.CopyFrom(handle)
    if breakage == "bogus lease":
        sent.lease_id = "00" * 16
    responses = decode(cluster, prompt, salt if breakage == "bogus lease" else fresh_salt(), prefix_handle=sent)
    assert_same(streamed(responses), expected_outputs[PROMPT], breakage)
    reason = responses[0].timings.route_reason
    assert "prefilled locally" in reason and ("failed" if breakage == "bogus lease" else "hashes differ") in reason
    assert responses[-1].num_cached_tokens == 0 and responses[0].timings.transfer_bytes == 0
    # db released the lease it was handed (it will not read it): the real one, or the bogus id, which leaves the
    # real lease open
    assert responses[0].timings.lease_released
    released = stub(cluster, "pa").ReleaseLease(pb.ReleaseLeaseRequest(lease_id=handle.lease_id), timeout=10).found
    assert released == (breakage == "bogus lease")
    assert_pools_full(cluster)


@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled-mid-pull", "pull-fails"])
def test_a_stalled_prefix_pull_frees_the_reservation(cluster, expected_outputs, cancel):  # noqa: F811
    """db pulls through a proxy that stalls, then closes: a call cancelled meanwhile (its deadline) frees
    db's reservation; a call that outlives the stall recomputes the prefix and gives the exact tokens."""
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    warm(cluster, salt, prompt[:WARM_TOKENS])
    handle = lease(cluster, "pa", prompt, salt).handle
    proxy = KVProxy(int(handle.data_plane_uri.rsplit(":", 1)[1]), stall_s=2.0)
    proxy.mode = "stall"
    sent = pb.KVHandle()
    sent.CopyFrom(handle)
    sent.data_plane_uri = proxy.uri
    request = pb.DecodeRequest(request_id=f"stall-{salt}", token_ids=prompt, sampling=GREEDY, prompt_len=len(prompt),
                               cache_salt=salt, prefix_handle=sent)
    try:
        if cancel:
            with pytest.raises(grpc.RpcError) as info:
                list(stub(cluster, "db").Decode(request, timeout=1.0))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            responses = list(stub(cluster, "db").Decode(request, timeout=60))
            assert_same(streamed(responses), expected_outputs[PROMPT], "recomputed after the failed pull")
            assert "prefix pull from pa failed" in responses[0].timings.route_reason
        assert proxy.pulls["stall"] == 1
    finally:
        stub(cluster, "pa").ReleaseLease(pb.ReleaseLeaseRequest(lease_id=handle.lease_id), timeout=10)
        proxy.stop()
    assert_pools_full(cluster)


def test_a_prefix_the_decoder_caches_already_is_not_pulled_again(cluster, expected_outputs):  # noqa: F811
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    warm(cluster, salt, prompt[:WARM_TOKENS])
    for pulled in (True, False):  # the first Decode leaves the whole prompt cached on db
        handle = lease(cluster, "pa", prompt, salt).handle
        responses = decode(cluster, prompt, salt, prefix_handle=handle)
        assert responses[0].timings.lease_released  # by db, whether it pulled or found the prefix cached
        assert not stub(cluster, "pa").ReleaseLease(pb.ReleaseLeaseRequest(lease_id=handle.lease_id),
                                                    timeout=10).found
        assert_same(streamed(responses), expected_outputs[PROMPT], "imported" if pulled else "cached on db")
        t = responses[0].timings
        assert (t.transfer_bytes > 0, responses[-1].num_cached_tokens) == (pulled, 100 if pulled else 124), t
        assert ("imported 100" if pulled else "nothing pulled") in t.route_reason
    assert_pools_full(cluster)
