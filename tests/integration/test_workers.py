"""Real worker processes, real Redis, real gRPC: Prefill on P -> pull over TCP -> Decode on D equals the
offline engine, tokens and their logprobs (tests/oracle.py: the oracle that sees one wrong KV block); leases, pools
and bad input behave."""

from __future__ import annotations

import time

import grpc
import pytest

from engine.config import EngineConfig
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.oracle import Output, assert_same, handed_off, reference, streamed
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_model import shared_tiny

PROMPTS = [list(range(5, 5 + n)) for n in (1, 3, 4, 7, 16, 33, 60)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    require_redis_server()
    redis = RedisServer.start()
    c = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("logs"))
    try:
        p = c.start_worker("prefill", "--lease-ttl-s", "3", worker_id="p1")
        d = c.start_worker("decode", worker_id="d1")
        c.wait_for_workers({"p1", "d1"})
        c.p, c.d = p, d
        yield c
    finally:
        c.stop_all()
        redis.stop()


@pytest.fixture(scope="module")
def expected(model_dir) -> list[Output]:
    """The offline engine's greedy tokens and their logprobs per prompt."""
    return reference(model_dir, PROMPTS, 12)


def stub(address: str) -> pb_grpc.WorkerStub:
    return pb_grpc.WorkerStub(grpc.insecure_channel(address))


def greedy(max_tokens=12) -> pb.SamplingParams:
    """Greedy, each token's logprob asked for (the oracle's second half)."""
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=3, logprobs=0)


def disaggregated(cluster, rid: str, prompt: list[int]) -> tuple[Output, pb.Timings]:
    pre = stub(cluster.p.address).Prefill(pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=greedy()))
    responses = list(stub(cluster.d.address).Decode(pb.DecodeRequest(
        request_id=rid, token_ids=[*prompt, pre.first_token], sampling=greedy(), handle=pre.handle,
        prompt_len=len(prompt))))
    return handed_off(pre, responses), responses[0].timings  # D released P's lease once its pull ended


def assert_pools_full(cluster, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [stub(p.address).Stats(pb.StatsRequest()) for p in (cluster.p, cluster.d)]
        if all(s.num_free_blocks == s.num_total_blocks and s.num_open_leases == 0 for s in stats):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not full: {stats}")
        time.sleep(0.1)


def test_prefill_pull_decode_equals_the_offline_engine(cluster, expected):
    """The KV moved: every request pulled blocks (at least its last, partial one; leading blocks an earlier,
    shorter prompt left cached on D are not pulled again) and none fell back to a local prefill, which would give
    the same tokens."""
    fallbacks = stub(cluster.d.address).Stats(pb.StatsRequest()).kv_pull_fallbacks
    for i, prompt in enumerate(PROMPTS):
        output, timings = disaggregated(cluster, f"r{i}", prompt)
        assert_same(output, expected[i], f"prompt {i} ({len(prompt)} tokens)")
        assert timings.transfer_blocks >= 1 and timings.transfer_bytes > 0 and not timings.local_fallback, timings
        assert timings.lease_released and timings.decode_worker == "d1"
    assert stub(cluster.d.address).Stats(pb.StatsRequest()).kv_pull_fallbacks == fallbacks
    assert_pools_full(cluster)


def test_a_failed_pull_falls_back_and_is_counted(cluster, expected):
    """A handle whose lease the prefill worker does not hold: D's pull is refused, D prefills itself (the same
    tokens), and says so: in the timings and in its fallback count."""
    prompt = PROMPTS[5]
    fallbacks = stub(cluster.d.address).Stats(pb.StatsRequest()).kv_pull_fallbacks
    pre = stub(cluster.p.address).Prefill(pb.PrefillRequest(request_id="bogus-lease", token_ids=prompt,
                                                            sampling=greedy()))
    handle = pb.KVHandle()
    handle.CopyFrom(pre.handle)
    handle.lease_id = "00" * 16
    responses = list(stub(cluster.d.address).Decode(pb.DecodeRequest(
        request_id="bogus-lease", token_ids=[*prompt, pre.first_token], sampling=greedy(), handle=handle,
        prompt_len=len(prompt))))
    assert_same(handed_off(pre, responses), expected[5], "recomputed")
    t = responses[0].timings
    assert t.local_fallback and "KV pull failed" in t.route_reason and t.transfer_bytes == 0, t
    assert stub(cluster.d.address).Stats(pb.StatsRequest()).kv_pull_fallbacks == fallbacks + 1
    assert stub(cluster.p.address).ReleaseLease(pb.ReleaseLeaseRequest(lease_id=pre.handle.lease_id)).found
    assert_pools_full(cluster)


def test_a_workers_abort_ends_a_request_that_would_run_on(cluster):
    """Worker/Abort on a real decode worker: a request asking for ~900 tokens ends at once, as ABORT, its
    blocks freed; without the abort it would stream to its LENGTH end."""
    d = stub(cluster.d.address)
    before = d.Stats(pb.StatsRequest()).num_aborted_requests
    call = d.Decode(pb.DecodeRequest(request_id="abort-me", token_ids=PROMPTS[3], sampling=greedy(max_tokens=900)))
    first_two = [next(call), next(call)]
    assert d.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found
    rest = list(call)
    assert rest and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert sum(len(r.token_ids) for r in first_two + rest) < 900
    assert d.Stats(pb.StatsRequest()).num_aborted_requests == before + 1
    assert not d.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found  # nothing left to abort
    assert_pools_full(cluster)


def test_local_decode_equals_the_offline_engine(cluster, expected):
    for i, prompt in enumerate(PROMPTS):
        stream = stub(cluster.d.address).Decode(pb.DecodeRequest(request_id=f"l{i}", token_ids=prompt,
                                                                   sampling=greedy()))
        assert_same(streamed(list(stream)), expected[i], f"prompt {i} local")
    assert_pools_full(cluster)


def test_unpulled_lease_expires_and_frees_blocks(cluster):
    pre = stub(cluster.p.address).Prefill(pb.PrefillRequest(request_id="lapse", token_ids=PROMPTS[5],
                                                             sampling=greedy()))
    stats = stub(cluster.p.address).Stats(pb.StatsRequest())
    assert stats.num_open_leases == 1 and stats.num_free_blocks < stats.num_total_blocks
    assert_pools_full(cluster, timeout_s=10.0)  # TTL 3 s
    # a decoder arriving after expiry falls back to local prefill and still answers correctly
    stream = stub(cluster.d.address).Decode(pb.DecodeRequest(
        request_id="late", token_ids=PROMPTS[5] + [pre.first_token], sampling=greedy(), handle=pre.handle,
        prompt_len=len(PROMPTS[5])))
    responses = list(stream)
    assert "prefilled locally" in responses[0].timings.route_reason
    assert len([t for r in responses for t in r.token_ids]) == 11
    assert_pools_full(cluster)


@pytest.mark.parametrize(("request_", "field"), [
    (pb.PrefillRequest(request_id="e", token_ids=[], sampling=greedy()), "prompt must not be empty"),
    (pb.PrefillRequest(request_id="m", token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (pb.PrefillRequest(request_id="t", token_ids=[1, 2], sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    (pb.PrefillRequest(request_id="v", token_ids=[10**6], sampling=greedy()), "token ids"),
])
def test_bad_input_is_invalid_argument_and_the_worker_keeps_serving(cluster, request_, field):
    with pytest.raises(grpc.RpcError) as info:
        stub(cluster.p.address).Prefill(request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
    assert stub(cluster.p.address).Stats(pb.StatsRequest()).worker_id == "p1"
    assert_pools_full(cluster)



def test_a_new_worker_registers_with_its_engines_load(cluster, model_dir):
    """The load a worker's first heartbeat publishes is sampled from its engine. The placeholder before the first
    sample (no free blocks) told every router the pool was full until the next heartbeat (2 s): a CI run's burst of
    24 requests all went to the other decode worker. In process, to see the first report before any other."""
    import asyncio

    from kv_transfer.registry import Registry, connect
    from decode_node.node import DecodeNode
    from worker.config import WorkerConfig

    async def first_report():
        config = WorkerConfig(role="decode", worker_id="fresh", redis_url=cluster.redis_url,
                              engine=EngineConfig(model=str(model_dir), num_blocks=64, block_size=4),
                              calibrate_tokens=0, heartbeat_interval_s=30.0, heartbeat_ttl_s=90.0)
        node = DecodeNode(config)
        await node.start()
        before_any_beat = node.load  # what the heartbeat reads, however the first beat and sample interleave
        redis = connect(cluster.redis_url)
        try:
            registry = Registry(redis, config.namespace)
            while node.heartbeat.beats == 0:  # the first heartbeat is the only one in this test (30 s apart)
                await asyncio.sleep(0.01)
            return before_any_beat, {info.worker_id: load for info, load in await registry.list_workers()}["fresh"]
        finally:
            await redis.aclose()
            await node.stop(grace_s=0)

    for load in asyncio.run(first_report()):
        assert load is not None and load.free_blocks == 64 and load.running == load.waiting == 0, load
