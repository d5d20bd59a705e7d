"""KV-aware routing with real processes (1 prefill + 3 decode workers): a request that repeats a long
prefix lands on the decode worker that holds it; another tenant's salt never reuses it. And (1 prefill +
1 decode worker with a small chunk budget, as decode workers run to protect their ITL) a prompt that goes
remote while the prefill pool is idle goes local while it is saturated, and remote again after. And (3 decode
workers, 3 routers in front of them) a burst split across routers that share their in-flight books spreads over
the workers, where routers that do not pile it onto the one that looked idle."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kv_transfer.registry import Registry, connect
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.integration.test_e2e import _wait_serving, assert_pools_full, start_cluster
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_model import shared_tiny

PREFIX = [(13 * j) % 2500 + 20 for j in range(120)]  # 30 blocks of 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    cluster, redis = start_cluster(model_dir, tmp_path_factory.mktemp("logs"), prefill=1, decode=3, policy="cost")
    # Prompts of this router's test prefill locally (threshold 200), so the choice turns on where the prefix
    # is cached (a 122-token local prefill elsewhere) and not on learned ITLs of a busy machine: P holds the
    # prefix too, so a remote prefill for the empty worker would cost almost nothing.
    cluster.mirror_router = cluster.start_router("--disagg-threshold-tokens", "200", "--policy", "cost",
                                                 "--index-mirror")
    _wait_serving(cluster.mirror_router.address)
    yield cluster
    cluster.stop_all()
    redis.stop()


def generate(cluster, prompt: list[int], salt: str = "", router=None) -> pb.GenerateResponse:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel((router or cluster.router).address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params, cache_salt=salt)
    return list(stub.Generate(request, timeout=60))[-1]


def wait_indexed(cluster, served: pb.GenerateResponse, prefix: list[int], salt: str = "") -> None:
    """Until the workers that ``served`` a request (its decode worker, and its prefill worker if any) are named for
    ``prefix`` in the Redis index and in both routers' mirrors of it (the cluster's router mirrors the index too:
    ``--index-mirror`` is the default). A router also counts a prefix it sent a worker to compute as held there, for
    1 s after its first token (``PendingPrefixes.grace_s``), and says so ("d0 is computing N of them"): the tests
    below assert that it did not have to, so a router that cannot read the index fails them."""
    for holder in filter(None, (served.timings.decode_worker, served.timings.prefill_worker)):
        cluster.wait_indexed(holder, prefix, salt=salt, mirrors=2)


def test_a_repeated_long_prefix_lands_where_it_is_cached(cluster):
    first = generate(cluster, PREFIX + [7, 8, 9])
    holders = {first.timings.decode_worker}
    assert first.usage.cached_prompt_tokens == 0
    wait_indexed(cluster, first, PREFIX)
    for suffix in ([1, 2, 3, 4, 5], [40, 41], [99] * 9):
        again = generate(cluster, PREFIX + suffix)
        t = again.timings
        # the prefix is reused wherever the learned rates price it cheapest: decoded on a worker holding it (the
        # first one, or one that imported it in an earlier round), imported from one, or prefilled on the
        # prefill worker that holds it too (the first request's P); what must hold whatever those rates are is
        # that it was not computed again
        assert t.decode_worker in holders or "tokens from" in t.route_reason or t.route_kind == "remote", \
            (holders, t.route_reason)
        holders.add(t.decode_worker)
        assert again.usage.cached_prompt_tokens >= len(PREFIX), t.route_reason
        assert "is computing" not in t.route_reason, t.route_reason  # the index named the holders
        assert again.timings.predicted_ttft_ms > 0  # the cost model's prediction, beside the measured ttft
        wait_indexed(cluster, again, PREFIX)
    assert_pools_full(cluster)


def test_a_router_mirroring_the_index_agrees_with_the_one_that_placed_the_prefix(cluster):
    prefix = [(7 * j) % 2500 + 30 for j in range(120)]
    placed = generate(cluster, prefix + [1])  # through the first router
    holders = {placed.timings.decode_worker}
    wait_indexed(cluster, placed, prefix)
    for suffix in ([2, 3], [4] * 7):  # the second router learned where it lives from the event streams alone
        again = generate(cluster, prefix + suffix, router=cluster.mirror_router)
        reason, decoder = again.timings.route_reason, again.timings.decode_worker
        # it found the prefix and reused it: on a worker holding it, or imported from one (whichever the learned
        # rates price cheaper: both are right choices of the cost model); a worker that imported it in the first
        # round holds it in the second
        total = len(prefix) + len(suffix)
        on_holder = decoder in holders and f"{len(prefix)} of {total} prompt tokens cached on {decoder}" in reason
        imported = any(f"({len(prefix)} tokens from {h})" in reason for h in holders)
        assert on_holder or imported, (holders, reason)
        assert "is computing" not in reason, reason  # its mirror named the holders (not the first router's books)
        assert again.usage.cached_prompt_tokens >= len(prefix), reason
        holders.add(decoder)
        wait_indexed(cluster, again, prefix)
    assert_pools_full(cluster)


def test_another_tenant_salt_never_reuses_the_prefix(cluster):
    first = generate(cluster, PREFIX + [5, 5, 5], salt="tenant-a")
    wait_indexed(cluster, first, PREFIX, salt="tenant-a")
    same_tenant = generate(cluster, PREFIX + [6, 6, 6], salt="tenant-a")
    other_tenant = generate(cluster, PREFIX + [6, 6, 6], salt="tenant-b")
    assert same_tenant.usage.cached_prompt_tokens >= len(PREFIX)
    assert other_tenant.usage.cached_prompt_tokens == 0
    assert_pools_full(cluster)


# --- a saturated prefill pool -----------------------------------------------------------------------

REMOTE_QUEUE = re.compile(r"remote on p0 [0-9.]+ s = overhead [0-9.]+ \+ queue ([0-9.]+)")
REMOTE_PLAN = re.compile(r"remote on p0 ([0-9.]+) s")
LOCAL_PLAN = re.compile(r"local ([0-9.]+) s")
RANDOM = random.Random(11)


def fresh_prompt(num_tokens: int = 600) -> list[int]:
    return [RANDOM.randrange(20, 2000) for _ in range(num_tokens)]  # no prefix any worker holds


@pytest.fixture(scope="module")
def chunked(model_dir, tmp_path_factory):
    """1P + 1D; D prefills in 4-token chunks (its local prefill is several times slower than P's, which is what
    makes remote worth it here), both heartbeat every 0.5 s so the router sees P's queue quickly. P's steps take
    at least 0.1 s each and hold at most 1,024 tokens, so a queue of 60,000 tokens lasts 6 s or more however
    fast the machine is (a fast one emptied it before the router could price it); D's steps take at least 10 ms,
    so its local prefill of 600 tokens (150 chunks) costs 1.5 s or more against P's 0.1 s step, on any machine."""
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("chunked-logs"))
    fast = ("--heartbeat-ttl-s", "1.5")
    cluster.workers = [
        cluster.start_worker("prefill", *fast, "--fault-step-delay-s", "0.1", "--max-num-batched-tokens", "1024",
                             worker_id="p0", num_blocks=1024),
        cluster.start_worker("decode", *fast, "--max-num-batched-tokens", "4", "--fault-step-delay-s", "0.01",
                             worker_id="d0", num_blocks=1024),
    ]
    try:
        cluster.wait_for_workers({"p0", "d0"})
        cluster.router = cluster.start_router("--disagg-threshold-tokens", "8", "--policy", "cost")
        _wait_serving(cluster.router.address)
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def route_of(cluster, prompt: list[int]) -> tuple[str, float | None, str]:
    """(route kind, the remote plan's priced queue seconds, the reason)."""
    final = generate(cluster, prompt)
    reason = final.timings.route_reason
    match = REMOTE_QUEUE.search(reason)
    return final.timings.route_kind, float(match.group(1)) if match else None, reason


def reported_queue(cluster, worker_id: str) -> int:
    """The prompt tokens ``worker_id`` last reported queued to the registry (what a router's listing reads)."""
    load = next(load for info, load in asyncio.run(_list_workers(cluster)) if info.worker_id == worker_id)
    return 0 if load is None else load.queued_prefill_tokens


def wait_for_route(cluster, kind: str, timeout_s: float = 20.0) -> tuple[float | None, str]:
    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        got, queue_s, last = route_of(cluster, fresh_prompt())
        if got == kind:
            return queue_s, last
    raise AssertionError(f"no {kind} route within {timeout_s} s; last: {last}")


def test_a_saturated_prefill_pool_makes_prompts_go_local(chunked):
    for _ in range(3):  # the router learns P's and D's rates and the route kinds' fixed costs
        route_of(chunked, fresh_prompt())
    kind, _, reason = route_of(chunked, fresh_prompt())
    assert kind == "remote", reason  # P idle: 600 tokens prefill several times faster on P than in D's chunks

    # Another router's traffic (sent straight to P) saturates it: 60 x 1,000 tokens, 60 steps of at least 0.1 s
    # (P's queue must outlast the heartbeat and listing delays before the router sees it).
    p0 = pb_grpc.WorkerStub(grpc.insecure_channel(chunked.workers[0].address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=1)

    def prefill_and_release(i: int) -> None:
        response = p0.Prefill(pb.PrefillRequest(request_id=f"other-{i}", token_ids=fresh_prompt(1000), sampling=params,
                                                decode_worker_id="d0"), timeout=120)
        if response.handle.lease_id:  # nobody pulls it: release at once so P's pool keeps admitting
            p0.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=response.handle.lease_id), timeout=10)

    with ThreadPoolExecutor(max_workers=60) as pool:
        futures = [pool.submit(prefill_and_release, i) for i in range(60)]
        # Probe only once the router can see P's queue: P's heartbeat has it in the registry, then the router's
        # listing (renewed when 0.5 s old) reads it. A probe routed before that waits behind the whole queue.
        deadline = time.monotonic() + 30
        while reported_queue(chunked, "p0") < 10_000:
            assert time.monotonic() < deadline, "P's queue never reached the registry"
            time.sleep(0.05)
        time.sleep(0.6)
        queue_s, reason = wait_for_route(chunked, "local")
        remote = REMOTE_PLAN.search(reason)
        assert queue_s is not None and queue_s > 0 and remote is not None, reason  # P's queue was priced ...
        local_s = float(LOCAL_PLAN.search(reason).group(1))
        assert float(remote.group(1)) - queue_s < local_s, reason  # ... and it is what made remote the dearer
        for future in futures:
            future.result(timeout=120)
    wait_for_route(chunked, "remote")  # P idle again: back to remote
    assert_pools_full(chunked)


# --- several routers in front of the same workers ---------------------------------------------------

# 4 per router, one every 120 ms: each router publishes and reads every 50 ms, so a send sees the ones before it (with
# room for a loaded machine's late loop); the whole burst fits between two of d0's heartbeats (6 s apart)
BURST, BURST_GAP_S = 12, 0.12


@pytest.fixture(scope="module")
def routers(model_dir, tmp_path_factory):
    """3 decode workers; in front of them 3 routers that share their books and 3 that do not. d0 reports its load
    every 6 s (a burst fits between two reports: only the books can spread it), d1 and d2 every 0.25 s (the load
    another client gives them is seen at once, before it ends)."""
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("routers-logs"))
    try:
        beats = {"d0": ("--heartbeat-ttl-s", "20", "--heartbeat-interval-s", "6"),
                 "d1": ("--heartbeat-interval-s", "0.25"), "d2": ("--heartbeat-interval-s", "0.25")}
        cluster.workers = [cluster.start_worker("decode", *beat, worker_id=worker_id, num_blocks=2048)
                           for worker_id, beat in beats.items()]
        # least loaded: the decision turns on the books alone, not on rates learned on a busy machine
        cluster.shared = [cluster.start_router("--policy", "least_loaded") for _ in range(3)]
        cluster.alone = [cluster.start_router("--policy", "least_loaded", "--no-shared-books") for _ in range(3)]
        cluster.wait_for_workers({"d0", "d1", "d2"})
        for router in cluster.shared + cluster.alone:
            _wait_serving(router.address)
        yield cluster
    finally:
        for proc in cluster.procs:  # all at once, then each waited for
            proc.popen.terminate()
        cluster.stop_all()
        redis.stop()


def reported_running(cluster) -> dict[str, int]:
    return {info.worker_id: load.running + load.waiting if load else 0
            for info, load in asyncio.run(_list_workers(cluster))}


def d0_report(cluster) -> tuple[int | None, int]:
    """d0's last load report: when (ms), and how many it runs or queues."""
    load = next(load for info, load in asyncio.run(_list_workers(cluster)) if info.worker_id == "d0")
    return (None, 0) if load is None else (load.reported_unix_ms, load.running + load.waiting)


async def _list_workers(cluster):
    redis = connect(cluster.redis_url)
    try:
        return await Registry(redis, cluster.namespace).list_workers()
    finally:
        await redis.aclose()


class Busy:
    """Another client's long streams on d1 and d2, sent straight to them and read to their end on a thread each:
    ``ended_s`` is when the first of them ended (monotonic; None while all run)."""

    def __init__(self, cluster, streams_per_worker: int) -> None:
        params = pb.SamplingParams(temperature=0.0, max_tokens=2040, ignore_eos=True)  # 3 s or more on this machine
        self.calls, self.ended_s = [], None
        for worker in cluster.workers[1:]:
            stub = pb_grpc.WorkerStub(grpc.insecure_channel(worker.address))
            for i in range(streams_per_worker):
                request = pb.DecodeRequest(request_id=f"busy-{worker.name}-{i}-{time.monotonic_ns()}", prompt_len=4,
                                           token_ids=[30 + i, 31, 32, 33], sampling=params)
                self.calls.append(stub.Decode(request, timeout=60))
        self._readers = [threading.Thread(target=self._read, args=(call,), daemon=True) for call in self.calls]
        for reader in self._readers:
            reader.start()

    def _read(self, call) -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled by stop()
            for _ in call:
                pass
        if self.ended_s is None:
            self.ended_s = time.monotonic()

    def stop(self) -> None:
        for call in self.calls:
            call.cancel()
        for reader in self._readers:
            reader.join(timeout=10)


def keep_busy(cluster, streams_per_worker: int = 3) -> Busy:
    """Right after a heartbeat of d0 reporting it idle, busy streams on d1 and d2: once their heartbeats report 3
    running each, every router sees d0 as the idle one, until d0's next heartbeat 6 s later."""
    deadline = time.monotonic() + 20
    first_at, _ = d0_report(cluster)
    while (report := d0_report(cluster))[0] == first_at or report[1]:
        assert time.monotonic() < deadline, ("d0 never reported itself idle", report)
        time.sleep(0.01)
    busy = Busy(cluster, streams_per_worker)
    while reported_running(cluster) != {"d0": 0, "d1": streams_per_worker, "d2": streams_per_worker}:
        assert time.monotonic() < deadline, reported_running(cluster)
        time.sleep(0.02)
    # the routers' listings (renewed when 0.5 s old) catch up with the heartbeats: kept as a sleep, as no interface
    # shows a router's listing and a probe request would change the books the burst is about
    time.sleep(0.6)
    return busy


def burst(cluster, routers) -> tuple[Counter, list[str]]:
    """``BURST`` long prompts sent round-robin through ``routers``, one every ``BURST_GAP_S``: where each was
    decoded, and why. Sent again (twice at most) when a busy stream ended before the routers had routed the whole
    burst (a machine faster than this one decodes its 2,040 tokens sooner): then d1 and d2 were not the busy ones."""
    channels = [grpc.insecure_channel(router.address) for router in routers]
    for channel in channels:  # connected before the burst: a send's connect does not delay it past the next
        grpc.channel_ready_future(channel).result(timeout=10)
    stubs = [pb_grpc.GenerationStub(channel) for channel in channels]
    # long enough to stay in flight until the burst ends: a router's books count a stream until it finishes
    params = pb.SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)
    try:
        for _ in range(3):
            requests = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=fresh_prompt(300)), sampling=params)
                        for _ in range(BURST)]
            busy = keep_busy(cluster)
            try:
                start, streams = time.monotonic(), []
                for i, request in enumerate(requests):  # one thread: a call is sent when it is made
                    # the burst's pacing, one send every BURST_GAP_S: the scenario itself, not a wait for state
                    time.sleep(max(0.0, start + i * BURST_GAP_S - time.monotonic()))
                    streams.append(stubs[i % len(stubs)].Generate(request, timeout=60))
                routed_s = time.monotonic() + 0.6  # the last send routed, and its listing's view of d1 and d2 too
                finals = [list(stream)[-1] for stream in streams]
            finally:
                busy.stop()
            if busy.ended_s is None or busy.ended_s > routed_s:
                return Counter(f.timings.decode_worker for f in finals), [f.timings.route_reason for f in finals]
        raise AssertionError("the busy streams ended before every burst was routed, three times")
    finally:
        for channel in channels:
            channel.close()


def test_routers_sharing_their_books_spread_a_burst_that_routers_alone_pile_onto_one_worker(routers):
    shared, why_shared = burst(routers, routers.shared)
    alone, why_alone = burst(routers, routers.alone)
    # alone, each router sends d0 (the one idle worker in the last heartbeat) its 4 before its own books make d0
    # look busier than the others' 3 streams: d0 takes the whole burst
    assert alone["d0"] >= 8, (alone, why_alone)
    # sharing, each router counts the others' sends (as of their last publish, <= 100 ms old): d0 takes about its
    # share (4, or 5 when a send is missed within a period) and the burst spreads over all three (d1 and d2 read 3
    # until the routers' own count passes it, then 4 each)
    assert shared["d0"] <= 6 and max(shared.values()) <= 6 and len(shared) == 3, (shared, alone, why_shared)
