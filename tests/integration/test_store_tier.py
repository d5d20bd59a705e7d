"""The store tier with real processes: Redis, a Mooncake Store on loopback (metadata server, ``mooncake_master``
and a standalone ``mooncake_client`` holding the memory, started as ``baton up --kv-store`` starts them) and
workers driven by hand: decode workers ``wa`` (a small pool and host tier, writing what leaves them to the store)
and ``wb`` (``Worker/Decode``, local prefill), and a prefill worker ``pc`` (``Worker/Prefill``, write-through).

A prompt whose blocks left ``wa``'s pool and host tier is served to ``wb`` from the store, greedy-exact against
recompute, and the index lists the store's prefix; ``pc`` writes what it computes at once and fetches what the
store holds before computing. Then the failures, each recomputing what it could not fetch,
counted by reason, with every pool full afterwards and nothing waiting past the store's deadline: a value
corrupted on purpose (removed from the store and the index), the standalone client stopped mid-read (the read
times out), then killed (the reads fail), the master hung, the master killed (the last ones: the module's store
is gone after them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import grpc
import numpy as np
import pytest

from deploy.kv_store import start_store, store_env
from kv_transfer.hashing import hash_blocks, root_hash
from kv_transfer.kv_store import CHECKSUM_BYTES, parse_store_uri
from kv_transfer.layout import KVLayout
from kv_transfer.redis_index import KVIndex
from kv_transfer.registry import Registry, connect
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster, free_port
from tests.integration.test_e2e import MAX_TOKENS, PROMPTS, assert_pools_full, expected, model_dir  # noqa: F401
from tests.integration.test_metrics import scrape
from tests.redis_server import RedisServer, require_redis_server
from tests.required import import_or_skip

mooncake = import_or_skip("mooncake", "mooncake", "the store tier needs mooncake-transfer-engine-non-cuda")

BLOCK = 4
TIMEOUT_S = 2.0  # the store's per-call deadline (the URI's timeout_s)
GREEDY = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT = 12  # PROMPTS[12]: 50 tokens, 12 reusable blocks
FILLERS = (13, 14, 15)  # 64-70 tokens each: together they push a prompt out of wa's pool and host tier


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    log_dir, procs = tmp_path_factory.mktemp("store-logs"), {}

    def spawn(name: str, argv: list[str], log_path) -> subprocess.Popen:
        with log_path.open("wb") as log:
            procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=store_env())
        return procs[name]

    try:
        uri = start_store(log_dir, spawn, memory="64 MB")
        yield uri + f"&timeout_s={TIMEOUT_S}", procs
    finally:
        for popen in reversed(list(procs.values())):
            _stop(popen)


def _stop(popen: subprocess.Popen) -> None:
    if popen.poll() is None:
        popen.send_signal(signal.SIGCONT)  # a test may have left it stopped
        popen.terminate()
    try:
        popen.wait(10)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(5)


@pytest.fixture(scope="module")
def cluster(model_dir, store, tmp_path_factory):  # noqa: F811
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("store-tier-logs"))
    cluster.metrics = {"wa": free_port(), "wb": free_port()}
    common = ("--kv-store", store[0], "--calibrate-tokens", "0")
    cluster.workers = [
        cluster.start_worker("decode", *common, "--kv-host-blocks", "8", "--metrics-port", str(cluster.metrics["wa"]),
                             num_blocks=24, block_size=BLOCK, worker_id="wa"),
        cluster.start_worker("decode", *common, "--metrics-port", str(cluster.metrics["wb"]), num_blocks=64,
                             block_size=BLOCK, worker_id="wb"),
        cluster.start_worker("prefill", *common, "--kv-store-write", "through", num_blocks=64, block_size=BLOCK,
                             worker_id="pc"),
    ]
    try:
        cluster.wait_for_workers({"wa", "wb", "pc"})
        _wait_connected(cluster)
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def _wait_connected(cluster, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all("store tier: connected" in w.log_path.read_text(errors="replace") for w in cluster.workers):
        assert time.monotonic() < deadline, [w.log() for w in cluster.workers]
        time.sleep(0.2)


def stub(cluster, worker_id: str) -> pb_grpc.WorkerStub:
    (proc,) = [w for w in cluster.workers if w.name == worker_id]
    return pb_grpc.WorkerStub(grpc.insecure_channel(proc.address))


def decode(cluster, worker_id: str, tokens: list[int], salt: str, store_blocks: int | None = None
           ) -> list[pb.DecodeResponse]:
    request = pb.DecodeRequest(request_id=f"r-{time.monotonic_ns()}", token_ids=tokens, sampling=GREEDY,
                               prompt_len=len(tokens), cache_salt=salt, store_blocks=store_blocks)
    return list(stub(cluster, worker_id).Decode(request, timeout=60))


def prefill(cluster, tokens: list[int], salt: str) -> pb.PrefillResponse:
    """pc's first token for ``tokens``; its lease released at once."""
    pc = stub(cluster, "pc")
    reply = pc.Prefill(pb.PrefillRequest(request_id=f"p-{time.monotonic_ns()}", token_ids=tokens, sampling=GREEDY,
                                         cache_salt=salt), timeout=60)
    assert pc.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=reply.handle.lease_id), timeout=10).found
    return reply


def tokens_of(responses: list[pb.DecodeResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def fresh_salt() -> str:
    return f"tenant-{time.monotonic_ns()}"


def layout_of(cluster) -> KVLayout:
    async def read() -> KVLayout:
        redis = connect(cluster.redis_url)
        try:
            (info, _), *_ = await Registry(redis, cluster.namespace).list_workers()
            return KVLayout.from_json(info.layout_json)
        finally:
            await redis.aclose()

    return asyncio.run(read())


def hashes_of(cluster, tokens: list[int], salt: str) -> list[bytes]:
    num_blocks = (len(tokens) - 1) // BLOCK
    root = root_hash(layout_of(cluster).model_fingerprint, BLOCK, salt)
    return hash_blocks(tokens[: num_blocks * BLOCK], BLOCK, root)


def store_prefix(cluster, hashes: list[bytes]) -> int:
    """The store's leading blocks of ``hashes``, as the index says."""
    async def lookup() -> int:
        redis = connect(cluster.redis_url)
        try:
            return (await KVIndex(redis, cluster.namespace).lookup_tiers(hashes)).store
        finally:
            await redis.aclose()

    return asyncio.run(lookup())


def wait_for(predicate, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def metric(cluster, worker_id: str, name: str, **labels: str) -> float:
    text = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "worker_id": worker_id}.items()))
    return scrape(cluster.metrics[worker_id]).get(f"{name}{{{text}}}", 0.0)


def push_out_of_wa(cluster, expected, salt: str) -> None:  # noqa: F811
    """wa serves the prompt, then fillers that evict it from its pool (24 blocks) and its host tier (8)."""
    for i in (PROMPT, *FILLERS):
        assert tokens_of(decode(cluster, "wa", PROMPTS[i], salt)) == expected[i]


def test_a_prefix_that_left_one_worker_is_served_from_the_store_to_another(cluster, expected):  # noqa: F811
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    hashes = hashes_of(cluster, prompt, salt)
    assert len(hashes) == 12
    push_out_of_wa(cluster, expected, salt)
    wait_for(lambda: store_prefix(cluster, hashes) == 12, "the index to list the store's 12 blocks")
    fetched = metric(cluster, "wb", "baton:kv_store_blocks_fetched_total")
    responses = decode(cluster, "wb", prompt, salt)  # wb holds nothing of it
    assert tokens_of(responses) == expected[PROMPT]
    assert responses[-1].num_cached_tokens == 48
    assert "fetched 48 prefix tokens from the store" in responses[0].timings.route_reason
    assert metric(cluster, "wb", "baton:kv_store_blocks_fetched_total") - fetched == 12
    assert metric(cluster, "wa", "baton:kv_store_blocks_written_total") >= 12
    assert_pools_full(cluster)


def test_the_routers_store_hint_replaces_the_store_lookup(cluster, expected):  # noqa: F811
    """A request carrying the index's count of the store's blocks (``store_blocks``, as the router sends it) is
    read without asking the store first; a count of 0 skips the store; a count the store no longer backs
    (here: blocks never written) reads them, finds them missing and recomputes."""
    lookups = lambda source: metric(cluster, "wb", "baton:kv_store_lookups_total", source=source)  # noqa: E731
    fetched = lambda: metric(cluster, "wb", "baton:kv_store_blocks_fetched_total")  # noqa: E731
    prompt = PROMPTS[PROMPT]
    salts = fresh_salt(), fresh_salt()
    for salt in salts:
        push_out_of_wa(cluster, expected, salt)
        wait_for(lambda: store_prefix(cluster, hashes_of(cluster, prompt, salt)) == 12, "the store's blocks")
    asked, hinted, got = lookups("store"), lookups("index"), fetched()

    responses = decode(cluster, "wb", prompt, salts[0], store_blocks=12)
    assert tokens_of(responses) == expected[PROMPT] and responses[-1].num_cached_tokens == 48
    assert "fetched 48 prefix tokens from the store" in responses[0].timings.route_reason
    assert (lookups("store") - asked, lookups("index") - hinted, fetched() - got) == (0, 1, 12)

    responses = decode(cluster, "wb", prompt, salts[1], store_blocks=0)  # the store holds it; the hint says not
    assert tokens_of(responses) == expected[PROMPT] and responses[-1].num_cached_tokens == 0
    assert (lookups("store") - asked, lookups("index") - hinted, fetched() - got) == (0, 1, 12)

    missing = metric(cluster, "wb", "baton:kv_store_fetch_failures_total", reason="missing")
    responses = decode(cluster, "wb", prompt, fresh_salt(), store_blocks=12)  # a stale hint
    assert tokens_of(responses) == expected[PROMPT] and responses[-1].num_cached_tokens == 0
    assert metric(cluster, "wb", "baton:kv_store_fetch_failures_total", reason="missing") - missing == 12
    assert (lookups("store") - asked, lookups("index") - hinted) == (0, 2)
    assert_pools_full(cluster)


def test_a_prefill_worker_writes_through_and_fetches_what_the_store_holds(cluster, expected):  # noqa: F811
    salt = fresh_salt()
    other = PROMPTS[FILLERS[0]]
    assert prefill(cluster, other, salt).first_token == expected[FILLERS[0]][0]
    other_hashes = hashes_of(cluster, other, salt)  # still in pc's pool: written through, not evicted
    wait_for(lambda: store_prefix(cluster, other_hashes) == len(other_hashes), "pc's blocks in the store")
    prompt, hashes = PROMPTS[PROMPT], hashes_of(cluster, PROMPTS[PROMPT], salt)
    push_out_of_wa(cluster, expected, salt)
    wait_for(lambda: store_prefix(cluster, hashes) == 12, "the store's blocks in the index")
    reply = prefill(cluster, prompt, salt)
    assert reply.first_token == expected[PROMPT][0] and reply.num_cached_tokens == 48
    assert_pools_full(cluster)


def _corrupt(uri: str, block_hash: bytes, value_bytes: int) -> None:
    """Replace the store's value of ``block_hash`` with random bytes of the right length (its checksum fails)."""
    from mooncake.store import MooncakeDistributedStore

    config = parse_store_uri(uri)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", config.metadata_url, 0, 1 << 20, "tcp", "", config.master_address) == 0
    garbage = np.random.default_rng(0).integers(0, 256, value_bytes, dtype=np.uint8)
    try:
        assert client.register_buffer(garbage.ctypes.data, garbage.nbytes) == 0
        assert client.remove(block_hash.hex(), True) == 0
        assert client.batch_put_from([block_hash.hex()], [garbage.ctypes.data], [value_bytes]) == [0]
        assert client.batch_is_exist([block_hash.hex()]) == [1]
    finally:
        client.close()


def test_a_corrupt_value_is_recomputed_and_removed(cluster, store, expected):  # noqa: F811
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    hashes = hashes_of(cluster, prompt, salt)
    push_out_of_wa(cluster, expected, salt)
    wait_for(lambda: store_prefix(cluster, hashes) == 12, "the store's blocks in the index")
    _corrupt(store[0], hashes[5], layout_of(cluster).bytes_per_block + CHECKSUM_BYTES)
    corrupt = metric(cluster, "wb", "baton:kv_store_fetch_failures_total", reason="corrupt")
    responses = decode(cluster, "wb", prompt, salt)
    assert tokens_of(responses) == expected[PROMPT]
    assert responses[-1].num_cached_tokens == 20  # blocks 0-4 from the store; 5 onwards recomputed
    assert "recomputed 7 blocks past them (corrupt)" in responses[0].timings.route_reason
    assert metric(cluster, "wb", "baton:kv_store_fetch_failures_total", reason="corrupt") - corrupt == 1
    wait_for(lambda: store_prefix(cluster, hashes) == 5, "the corrupt block to leave the index")
    assert_pools_full(cluster)


def test_a_read_that_hangs_times_out_and_recomputes(cluster, store, expected):  # noqa: F811
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    hashes = hashes_of(cluster, prompt, salt)
    push_out_of_wa(cluster, expected, salt)
    wait_for(lambda: store_prefix(cluster, hashes) == 12, "the store's blocks in the index")
    holder = store[1]["store-client"]  # holds the bytes: stopped, every read of them hangs
    timeouts = metric(cluster, "wb", "baton:kv_store_fetch_failures_total", reason="timeout")
    holder.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        responses = decode(cluster, "wb", prompt, salt)
        took_s = time.monotonic() - started
    finally:
        holder.send_signal(signal.SIGCONT)
    assert tokens_of(responses) == expected[PROMPT] and responses[-1].num_cached_tokens == 0
    assert took_s < 10 * TIMEOUT_S, took_s  # one store deadline, not a transfer engine's 30 s
    assert metric(cluster, "wb", "baton:kv_store_fetch_failures_total", reason="timeout") - timeouts == 12
    # the read that timed out ends by itself once the holder answers (until then wb refuses new reads at once)
    wait_for(lambda: metric(cluster, "wb", "baton:kv_store_stuck_calls") == 0, "wb's stuck store read to end")
    assert_pools_full(cluster)


def test_a_read_from_a_dead_holder_fails_and_recomputes(cluster, store, expected):  # noqa: F811
    """The standalone client holding the bytes is killed: the master still lists the blocks, their reads fail."""
    salt, prompt = fresh_salt(), PROMPTS[PROMPT]
    hashes = hashes_of(cluster, prompt, salt)
    push_out_of_wa(cluster, expected, salt)
    wait_for(lambda: store_prefix(cluster, hashes) == 12, "the store's blocks in the index")
    failed = metric(cluster, "wb", "baton:kv_store_fetch_failures_total", reason="failed")
    holder = store[1]["store-client"]
    holder.kill()
    holder.wait(10)
    responses = decode(cluster, "wb", prompt, salt)
    assert tokens_of(responses) == expected[PROMPT] and responses[-1].num_cached_tokens == 0
    assert metric(cluster, "wb", "baton:kv_store_fetch_failures_total", reason="failed") - failed == 12
    assert_pools_full(cluster)


@pytest.mark.parametrize("how", ["hung", "killed"])
def test_with_the_master_down_requests_compute(cluster, store, expected, how):  # noqa: F811
    """Last: the killed master is not restarted (its objects would be gone anyway)."""
    master = store[1]["store-master"]
    master.send_signal(signal.SIGSTOP if how == "hung" else signal.SIGKILL)
    try:
        salt = fresh_salt()
        started = time.monotonic()
        for i in (PROMPT, *FILLERS):  # wa's evictions try to write, wb's admissions to read: both give up
            assert tokens_of(decode(cluster, "wa", PROMPTS[i], salt)) == expected[i]
        responses = decode(cluster, "wb", PROMPTS[PROMPT], salt)
        assert tokens_of(responses) == expected[PROMPT] and responses[-1].num_cached_tokens == 0
        assert time.monotonic() - started < 60
    finally:
        if how == "hung":
            master.send_signal(signal.SIGCONT)
    assert_pools_full(cluster)
