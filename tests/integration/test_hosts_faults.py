"""Faults across links (issue 21, items 4 and 5), each once, on hosts of tests/hosts.py (1 Gbit/s links): a prefill
host's link taken down mid-pull, a decode host's link taken down mid-stream (no other decode worker to move to), a
decode host's processes all SIGKILLed mid-stream (its streams migrate to another decode worker and go on exactly,
greedy and seeded), the router cut off from Redis. Each request completes (recomputed, retried, migrated: greedy
outputs equal the offline engine's tokens and their logprobs, tests/oracle.py) or ends with a clear UNAVAILABLE within
its deadline — none hangs — and every pool is full again afterwards: no block, no lease left behind.

Hosts: redis, router, b (p0), c (d0), e (p1), f (d1: every step 20 ms slower, for long streams), client. Workers
run `--lease-ttl-s 5 --kv-io-timeout-s 3` (ordinary flags) so what a partition strands is freed within seconds."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from router.relay import INDEX_UNANSWERED
from tests.hosts import Network, unavailable_reason
from tests.hosts_cluster import HostsCluster
from tests.integration.test_e2e import model_dir  # noqa: F401
from tests.integration.test_hosts import generate_output
from tests.oracle import assert_same, reference, streamed
from tests.required import unavailable

WHY_NOT = unavailable("root", unavailable_reason())
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
WORKER = ("--kv-transport", "tcp", "--calibrate-tokens", "0", "--lease-ttl-s", "5", "--kv-io-timeout-s", "3")
PROMPTS = [[(13 * i + 7 * j) % 2900 + 40 for j in range(150 + i)] for i in range(12)]
MAX_TOKENS = 8
MIGRATING_TOKENS = 100  # > 2.5 s on d1 (20 ms slower a step): its host is killed 1-1.5 s in
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 4321}


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):  # noqa: F811
    log_dir = tmp_path_factory.mktemp("hosts-faults-logs")
    with Network.create(["redis", "router", "b", "c", "e", "f", "client"], rate="1gbit") as net:
        cluster = HostsCluster(net, model_dir, log_dir, client="client")
        try:
            cluster.start_redis("redis")
            for worker_id, host, role in (("p0", "b", "prefill"), ("d0", "c", "decode"), ("p1", "e", "prefill")):
                cluster.start_worker(role, worker_id, host=host, extra=WORKER)
            cluster.start_worker("decode", "d1", host="f", extra=(*WORKER, "--fault-step-delay-s", "0.02"))
            cluster.wait_for_workers({"p0", "d0", "p1", "d1"})
            cluster.start_router("router", "--disagg-threshold-tokens", "8", "--policy", "least_loaded")
            yield cluster
        finally:
            cluster.close()


@pytest.fixture(scope="module")
def expected(model_dir):  # noqa: F811
    return reference(model_dir, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def migrating(model_dir):  # noqa: F811
    """The offline engine's undisturbed streams of PROMPTS[3]: greedy (tokens and logprobs) and seeded (tokens)."""
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=512, block_size=4))
    engine.add_request("seeded", PROMPTS[3], SamplingParams(**SEEDED, max_tokens=MIGRATING_TOKENS, ignore_eos=True))
    seeded: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            seeded.extend(delta.new_token_ids)
    engine.close()
    return [reference(model_dir, [PROMPTS[3]], MIGRATING_TOKENS)[0], seeded]


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def kv_bytes_in_flight(net: Network, sender: str, receiver: str) -> bool:
    """``sender`` has bytes queued on a TCP connection to ``receiver`` (``ss`` on its host): a pull is under way."""
    lines = net[sender].run("ss", "-tnH", "state", "established").stdout.splitlines()
    return any(int(f[1]) > 0 and f[3].startswith(f"{net[receiver].address}:") for f in map(str.split, lines))


def test_a_prefill_hosts_link_down_mid_pull_recomputes_on_d(cluster, expected) -> None:
    net = cluster.net
    cluster.only("p0", "d0")
    assert cluster.generate(PROMPTS[0], MAX_TOKENS)[1].timings.transfer_bytes > 0  # the pair knows its transport
    net.shape("b", "1gbit", per_peer={"c": "1mbit"})  # p0 -> d0 slow: a pull lasts ~0.7 s
    result: list = []
    request = threading.Thread(target=lambda: result.append(generate_output(cluster, PROMPTS[1], MAX_TOKENS,
                                                                             timeout_s=30)))
    try:
        request.start()
        wait_for(lambda: kv_bytes_in_flight(net, "b", "c"))  # p0 is sending d0 the KV
        net["b"].set_link(up=False)
        request.join(30)
    finally:
        net["b"].set_link(up=True)
        net.shape("b", "1gbit")
    output, last = result[0]
    assert_same(output, expected[1], "recomputed on d0")
    assert last.timings.local_fallback, last.timings
    assert "KV pull failed" in last.timings.route_reason, last.timings
    cluster.assert_pools_full(timeout_s=15)  # p0's lease: released, or expired (5 s) while nobody could reach it


def test_a_decode_hosts_link_down_mid_stream_ends_with_a_clear_error(cluster, expected) -> None:
    net = cluster.net
    cluster.only("p1", "d1")
    call = cluster.stream(PROMPTS[2], 400, timeout_s=60)  # ~8 s of tokens from the slowed d1
    started = time.monotonic()
    try:
        assert len(next(call).token_ids) >= 1
        next(call)  # d1 streams
        net["f"].set_link(up=False)
        with pytest.raises(grpc.RpcError) as failure:
            for _ in call:
                pass
    finally:
        net["f"].set_link(up=True)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value
    details = failure.value.details()  # d0 drains: the request has nowhere to migrate to
    assert "decode worker d1 failed after" in details and "no other decode worker can resume it" in details, details
    assert time.monotonic() - started < 30  # found by keepalive pings, not by the 60 s deadline
    cluster.assert_pools_full(timeout_s=20)  # d1 finishes (or is cancelled) once it is reachable again
    cluster.wait_for_workers({"d1"})  # its registration expired while its link was down: back with a heartbeat


def test_hosts_whose_processes_are_all_killed_migrate_streams_exactly_and_are_routed_around(
        cluster, expected, migrating) -> None:
    net = cluster.net
    cluster.only("p0", "d1")
    calls = [cluster.stream(PROMPTS[3], MIGRATING_TOKENS, timeout_s=60, logprobs=0),
             cluster.stream(PROMPTS[3], MIGRATING_TOKENS, timeout_s=60, **SEEDED)]
    received = [[next(call) for _ in range(2)] for call in calls]  # P's first token, then d1's
    cluster.only("p0", "p1", "d0", "d1")  # d0 to migrate to
    net["f"].kill_all()  # d1's host: every process SIGKILLed at once, mid-stream
    greedy, seeded = ([*first, *call] for call, first in zip(calls, received))
    assert_same(streamed(greedy), migrating[0], "greedy, migrated")  # no token repeated, none missing, none amiss
    assert [t for r in seeded for t in r.token_ids] == migrating[1]
    for responses in (greedy, seeded):
        t = responses[-1].timings
        assert (t.migrations, t.decode_worker) == (1, "d0") and "migrated: decode worker d1 failed" in t.route_reason, t
    net["b"].kill_all()  # p0's host too, the prefill worker the router prefers: both listed until their TTL
    for i in range(4, 9):  # prefilled on p1 (retried there) or on d0
        output, last = generate_output(cluster, PROMPTS[i], MAX_TOKENS, timeout_s=30)
        assert_same(output, expected[i], f"prompt {i} without p0 and d1")
        assert last.timings.decode_worker == "d0", last.timings
    for host, worker_id in (("f", "d1"), ("b", "p0")):
        net[host].reboot()
        cluster.restart_worker(worker_id)
    cluster.wait_for_workers({"p0", "d1"})
    cluster.assert_pools_full()


def test_the_router_cut_off_from_redis_keeps_serving(cluster, expected) -> None:
    net, redis = cluster.net, cluster.net["redis"].address
    cluster.only("p0", "p1", "d0", "d1")
    cluster.generate(PROMPTS[9], MAX_TOKENS)  # the router has a listing
    net["router"].blackhole(redis)  # Redis silent to the router only: the workers keep heartbeating
    time.sleep(2.5)  # past the index mirror's stale_after_s (its 1 s blocking read + 1 s): it answers no more
    try:
        for i in (10, 11):
            output, last = generate_output(cluster, PROMPTS[i], MAX_TOKENS, timeout_s=5)  # 12 s each before the fix
            assert_same(output, expected[i], f"prompt {i} routed blind")
            assert INDEX_UNANSWERED in last.timings.route_reason, last.timings  # routed blind, and said so
    finally:
        net["router"].unblackhole(redis)
    cluster.assert_pools_full()
