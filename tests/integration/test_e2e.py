"""The whole platform in real processes: redis-server, router, prefill and decode workers.

Greedy output through router -> P -> KV pull -> D equals the offline engine token for token, and
equals local-prefill mode; concurrency, cancellation, deadlines and a killed prefill worker leave
every block pool full and no lease open."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.oracle import Output, assert_same, reference, streamed
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_model import shared_tiny

PROMPTS = [[(7 * i + 3 * j) % 3000 + 10 for j in range(n)] for i, n in enumerate(
    (3, 5, 8, 12, 16, 17, 20, 24, 31, 33, 40, 47, 50, 64, 65, 70, 81, 90, 100, 111, 128, 130, 150, 160))]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def expected(model_dir):
    """The offline engine's greedy tokens per prompt."""
    return [output.tokens for output in reference(model_dir, PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def expected_outputs(model_dir):
    """The offline engine's greedy tokens and their logprobs per prompt: the oracle that sees one wrong KV block
    (tests/oracle.py)."""
    return reference(model_dir, PROMPTS, MAX_TOKENS)


def start_cluster(model_dir, log_dir, *, prefill: int, decode: int, policy: str = "least_loaded",
                  router_args=(), prefill_args=()) -> tuple[Cluster, RedisServer]:
    """The router defaults to the threshold policy here: these tests assert remote/local by prompt length
    (the cost policy's choices depend on rates it learns as the tests run; tests/integration/test_routing.py
    exercises it)."""
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, log_dir)
    workers = [cluster.start_worker("prefill", *prefill_args, worker_id=f"p{i}") for i in range(prefill)]
    workers += [cluster.start_worker("decode", worker_id=f"d{i}") for i in range(decode)]
    cluster.workers = workers
    cluster.wait_for_workers({w.name for w in workers})
    cluster.router = cluster.start_router("--disagg-threshold-tokens", "8", "--policy", policy, *router_args)
    _wait_serving(cluster.router.address)
    return cluster, redis


def _wait_serving(address: str, timeout_s: float = 60.0) -> None:
    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=timeout_s)


@pytest.fixture(scope="module")
def platform(model_dir, tmp_path_factory):
    cluster, redis = start_cluster(model_dir, tmp_path_factory.mktemp("logs"), prefill=1, decode=1)
    cluster.local_router = cluster.start_router("--disagg-threshold-tokens", "100000", "--policy", "least_loaded")
    _wait_serving(cluster.local_router.address)
    yield cluster
    cluster.stop_all()
    redis.stop()


def generate(address: str, prompt: list[int], max_tokens: int = MAX_TOKENS, timeout=None, **sampling):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)
    responses = list(stub.Generate(request, timeout=timeout))
    return [t for r in responses for t in r.token_ids], responses[-1]


def generate_output(address: str, prompt: list[int], max_tokens: int = MAX_TOKENS,
                    timeout=None) -> tuple[Output, pb.GenerateResponse]:
    """``generate`` asking for each token's logprob: (tokens and logprobs, the last response)."""
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params),
                                   timeout=timeout))
    return streamed(responses), responses[-1]


def assert_pools_full(cluster: Cluster, timeout_s: float = 10.0, channel=grpc.insecure_channel,
                      workers=None) -> None:
    """Until every live worker (``cluster.workers``, or ``workers``) has its whole pool free, no lease open and
    nothing running; ``channel(address)`` reaches a worker (a TLS one for mTLS workers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [pb_grpc.WorkerStub(channel(w.address)).Stats(pb.StatsRequest(), timeout=10)
                 for w in (cluster.workers if workers is None else workers) if w.popen.poll() is None]
        if all(s.num_free_blocks == s.num_total_blocks and s.num_open_leases == 0 and s.num_running == 0
               and s.num_free_staging_blocks == s.num_staging_blocks for s in stats):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not back to full: {stats}")
        time.sleep(0.1)


def test_disaggregated_equals_offline_engine_and_local_mode(platform, expected_outputs):
    kinds = set()
    for i, prompt in enumerate(PROMPTS):
        output, last = generate_output(platform.router.address, prompt)
        assert_same(output, expected_outputs[i], f"prompt {i} ({len(prompt)} tokens) via {last.timings.route_kind}")
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == MAX_TOKENS
        kinds.add(last.timings.route_kind)
        if last.timings.route_kind == "remote":  # the KV moved: a recompute on D would give the same tokens
            assert last.timings.transfer_bytes > 0 and not last.timings.local_fallback, last.timings
        local_output, local_last = generate_output(platform.local_router.address, prompt)
        assert_same(local_output, expected_outputs[i], f"prompt {i} local")
        assert local_last.timings.route_kind == "local"
    assert kinds == {"local", "remote"}  # short prompts stay local under the 8-token threshold
    assert_pools_full(platform)


def test_remote_timings_report_the_transfer(platform):
    prompt = [11 + (5 * j) % 2000 for j in range(97)]
    _, last = generate(platform.router.address, prompt)
    t = last.timings
    assert t.route_kind == "remote" and t.prefill_worker == "p0" and t.decode_worker == "d0"
    assert t.transfer_blocks == 25 and t.transfer_bytes > 0 and t.transfer_gbps > 0 and t.ttft_ms > 0
    assert not t.local_fallback and t.lease_released, t
    assert_pools_full(platform)


def test_32_concurrent_streams_complete_and_pools_return_to_full(platform, expected):
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = generate(platform.router.address, PROMPTS[i % len(PROMPTS)])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(32))
    assert all(results[i] == expected[i % len(PROMPTS)] for i in range(32))
    assert_pools_full(platform)


def aborted(cluster: Cluster) -> dict[str, int]:
    """Per live worker, how many requests its engine ended by abort."""
    return {w.name: pb_grpc.WorkerStub(grpc.insecure_channel(w.address)).Stats(pb.StatsRequest()).num_aborted_requests
            for w in cluster.workers if w.popen.poll() is None}


def decode_worker(cluster: Cluster) -> str:
    return next(w.name for w in cluster.workers if w.name.startswith("d"))


def test_client_cancel_mid_stream_aborts_on_both_workers(platform):
    """Left alone, the request would run ~2.6 s more, to the pool's limit; cancelled after 3 tokens, only an
    abort explains D's engine counting one more aborted request (and P none: its part ended with the prefill)."""
    before = aborted(platform)
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(platform.router.address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[-1]), sampling=params))
    received = [next(call) for _ in range(3)]
    assert all(r.token_ids for r in received)
    call.cancel()
    assert_pools_full(platform)
    d = decode_worker(platform)
    assert {w: n - before[w] for w, n in aborted(platform).items()} == {w: int(w == d) for w in before}


def test_deadline_exceeded(platform):
    """Left alone the request streams 864 tokens to its length limit, 0.9 s on a quiet machine and seconds on a
    busy one; its 0.3 s deadline ends it on D mid-decode. A token after the first came from D's engine, so D must
    count the abort; on a machine so loaded that none came in time the deadline ended it before D's engine took it
    (nothing there to abort), and only the pools' return is checked."""
    before = aborted(platform)
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(platform.router.address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[-1]), sampling=params), timeout=0.3)
    received = 0
    with pytest.raises(grpc.RpcError) as info:
        for response in call:
            received += len(response.token_ids)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_pools_full(platform)
    d = decode_worker(platform)
    if received >= 2:
        assert aborted(platform)[d] == before[d] + 1  # the deadline aborted it; it did not run to its end


def test_bad_input_is_invalid_argument_and_the_platform_keeps_serving(platform, expected):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(platform.router.address))
    for request, field in [
        (pb.GenerateRequest(prompt="", sampling=pb.SamplingParams(max_tokens=4)), "prompt"),
        (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 5000)), "max_model_len"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
    assert generate(platform.router.address, PROMPTS[3])[0] == expected[3]


def test_two_prefill_two_decode_equals_offline_engine(model_dir, tmp_path, expected_outputs):
    cluster, redis = start_cluster(model_dir, tmp_path, prefill=2, decode=2, router_args=("--log-level", "debug"))
    try:
        results: dict[int, tuple[Output, pb.GenerateResponse]] = {}

        def run(i: int) -> None:
            results[i] = generate_output(cluster.router.address, PROMPTS[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i in range(len(PROMPTS)):
            assert_same(results[i][0], expected_outputs[i], f"prompt {i} via {results[i][1].timings.route_kind}")
        routed = [line for line in cluster.router.log_path.read_text().splitlines() if " routed " in line]
        assert {results[i][1].timings.decode_worker for i in results} == {"d0", "d1"}, "\n".join(routed)
        assert_pools_full(cluster)
    finally:
        cluster.stop_all()
        redis.stop()


def test_prefill_worker_killed_mid_flight_requests_still_complete(model_dir, tmp_path, expected):
    """P's steps are slowed (1 s each), so the long prompts are still being prefilled when P is SIGKILLed: each
    request falls back to a local prefill on D (the only other worker) and is token-exact."""
    cluster, redis = start_cluster(model_dir, tmp_path, prefill=1, decode=1,
                                   prefill_args=("--fault-step-delay-s", "1"))
    try:
        long_ones = [i for i, p in enumerate(PROMPTS) if len(p) > 60]
        results: dict[int, tuple[list[int], pb.GenerateResponse]] = {}

        def run(i: int) -> None:
            results[i] = generate(cluster.router.address, PROMPTS[i], timeout=120)

        threads = [threading.Thread(target=run, args=(i,)) for i in long_ones]
        for t in threads:
            t.start()
        time.sleep(0.3)  # sent; P's first step (1 s) has not ended
        cluster.workers[0].kill(signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert {i: results[i][0] for i in long_ones} == {i: expected[i] for i in long_ones}
        for i in long_ones:  # the fault path did run: every one was recomputed on D
            t = results[i][1].timings
            assert t.route_kind == "local" and "prefill on p0 failed" in t.route_reason, t.route_reason
        assert_pools_full(cluster)
        assert generate(cluster.router.address, PROMPTS[-1])[0] == expected[-1]  # still serving, locally
    finally:
        cluster.stop_all()
        redis.stop()
