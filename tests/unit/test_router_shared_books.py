"""Several routers in front of the same workers (issue 23, item 4): each publishes its in-flight books and prices
the others' beside its own. Pure parts with an injected clock (the documents, the merge, the pricing, a burst
split across three routers on the real policy), then the sync against a real redis-server."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest

from kv_transfer.hashing import hash_blocks, root_hash
from kv_transfer.index_schema import RedisKeys, TieredLookup
from kv_transfer.registry import connect
from kv_transfer.workers import WorkerInfo, WorkerLoad
from router.routing.books_sync import BooksSync
from router.routing.chain_match import TieredMatch
from router.routing.directory import Snapshot
from router.routing.in_progress import InflightPrefills, PendingPrefixes
from router.routing.policy import PolicyConfig, RouteRequest, RoutingState, route
from router.routing.preselect import Books, PoolView
from router.routing.rates import Rates
from router.routing.shared_books import (
    NO_OTHERS, BooksDoc, OtherBooks, SharedBooksConfig, decode, own_doc, with_others,
)
from tests.redis_server import RedisServer, require_redis_server

LAYOUT = ('{"model_fingerprint": "' + "ab" * 16 + '", "dtype": "bfloat16", "block_size": 16, "num_layers": 32, '
          '"num_kv_heads": 8, "head_dim": 128}')
ROOT = root_hash(b"\xab" * 16, 16)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s

    def wall_ms(self) -> int:  # another clock (wall time) that moves with it
        return 1_700_000_000_000 + round(self.now_s * 1000)


def chain(seed: int, num_tokens: int = 400) -> list[bytes]:
    rng = random.Random(seed)
    return hash_blocks([rng.randrange(5, 4000) for _ in range(num_tokens)], 16, ROOT)


def doc_from(clock: Clock, router_id: str, **books) -> str:
    return BooksDoc(router_id=router_id, at_ms=clock.wall_ms(), **books).encode()


def others_from(clock: Clock, *docs: str) -> OtherBooks:
    return OtherBooks.merge([decode(doc, clock(), clock.wall_ms()) for doc in docs])


def test_a_document_round_trips_dated_on_the_readers_clock():
    clock, hashes = Clock(), chain(1)
    doc = doc_from(clock, "r1", streams={"d0": 2}, queued={"d0": 300}, pending={"p0": hashes[:3]})
    clock.now_s += 0.4  # read 0.4 s after it was written
    books = decode(doc, clock(), clock.wall_ms())
    assert books.router_id == "r1" and books.streams == {"d0": 2} and books.queued == {"d0": 300}
    assert books.as_of_s == pytest.approx(clock() - 0.4)
    assert OtherBooks.merge([books]).pending_lookup(hashes) == {"p0": 3}
    ahead = BooksDoc(router_id="r2", at_ms=clock.wall_ms() + 5_000).encode()  # a host whose clock runs ahead
    assert decode(ahead, clock(), clock.wall_ms()).as_of_s == clock()
    with pytest.raises((ValueError, KeyError)):
        decode('{"router": "r3"}', clock(), clock.wall_ms())


def test_the_other_routers_books_add_up_per_worker():
    clock, a, b = Clock(), chain(1), chain(2)
    others = others_from(clock, doc_from(clock, "r1", streams={"d0": 2, "d1": 1}, queued={"d0": 100},
                                         pending={"d0": a[:2]}),
                         doc_from(clock, "r2", streams={"d0": 3}, queued={"d0": 50, "p0": 70}, pending={"d0": b}))
    assert others.routers == ("r1", "r2") and others.streams == {"d0": 5, "d1": 1}
    assert sorted(n for n, _ in others.queued["d0"]) == [50, 100] and len(others.queued["p0"]) == 1
    assert others.pending_lookup(a) == {"d0": 2} and others.pending_lookup(b) == {"d0": len(b)}
    assert others.pending_lookup(chain(3)) == {}


def test_the_books_price_this_routers_own_plus_the_others():
    clock, hashes = Clock(), chain(1)
    prefills = InflightPrefills(clock=clock)
    prefills.add("d0", "mine", 1000)
    own = Books({"d0": 1}, prefills, {}, Rates(clock=clock))
    others = others_from(clock, doc_from(clock, "r2", streams={"d0": 2, "d1": 4}, queued={"d0": 1000, "d1": 500},
                                         pending={"d1": hashes[:5]}))
    books = with_others(own, others, hashes)
    assert books.inflight.get("d0", 0) == 3 and books.inflight.get("d1", 0) == 4 and books.inflight.get("d2", 0) == 0
    assert "d1" in books.prefills and "d2" not in books.prefills
    assert books.prefills.backlog("d0", 1000.0) == 2000  # one queue: mine behind theirs
    assert books.pending == {"d1": 5}  # r2 is computing 5 leading blocks of this prompt on d1
    clock.now_s += 1.5  # both drain at the worker's rate from when they were sent (published)
    assert books.prefills.backlog("d0", 1000.0) == 500 and books.prefills.backlog("d1", 1000.0) == 0
    assert own.prefills.backlog("d0", 1000.0) == 0  # this router's own books are untouched
    assert with_others(own, NO_OTHERS, hashes) is own  # one router: nothing changes


def test_own_doc_publishes_only_what_this_router_sent():
    clock = Clock()
    doc = own_doc("r1", clock.wall_ms(), Counter({"d0": 2, "d1": 0}), {"d0": 300, "p0": 0}, {"p0": [], "d0": chain(1)})
    assert doc.streams == {"d0": 2} and doc.queued == {"d0": 300} and list(doc.pending) == ["d0"]
    assert own_doc("r1", 0, {}, {}, {}).empty


def test_pending_newest_keeps_the_newest_requests_leading_blocks():
    clock = Clock()
    pending = PendingPrefixes(clock=clock)
    old, new = chain(1), chain(2)
    pending.add("old", "d0", old)
    pending.add("new", "d1", new)
    pending.add("same", "d0", old[:4])  # a newer request on a prefix d0 already holds: counted once
    assert pending.newest(10_000) == {"d0": old, "d1": new}
    capped = pending.newest(len(new) + 6)
    assert capped["d1"] == new and capped["d0"] == old[:6]  # newest first, each chain from its first block
    changes = pending.changes
    pending.settle("new")
    clock.now_s += pending.grace_s
    pending.expire()
    assert "d1" not in pending.newest(10_000) and pending.changes > changes


# --- a burst split across three routers, on the real policy ----------------------------------------------


def snapshot(running: list[int]) -> Snapshot:
    entries = []
    for i, n in enumerate(running):
        info = WorkerInfo(worker_id=f"d{i}", role="decode", grpc_address=f"h{i}:1", kv_uri=f"tcp://h{i}:2",
                          model_fingerprint="ab" * 16, layout_json=LAYOUT, total_blocks=4096)
        entries.append((info, WorkerLoad(running=n, waiting=0, free_blocks=4096, queued_prefill_tokens=0,
                                         prefill_tokens_per_s=2000.0, decode_step_s=0.02)))
    return Snapshot(workers=tuple(entries), draining=frozenset(), taken_at_s=0.0)


class Router:
    """The relay's books and its routing stage (``_Flow._look_up`` + ``_route``), on the pure objects."""

    def __init__(self, name: str, clock: Clock) -> None:
        self.name, self.clock = name, clock
        self.inflight: Counter[str] = Counter()
        self.prefills = InflightPrefills(clock=clock)
        self.pending = PendingPrefixes(clock=clock)
        self.routing = RoutingState(rates=Rates(clock=clock), rng=random.Random(0))
        self.other_books = NO_OTHERS

    def route(self, view: PoolView, request_id: str, hashes: list[bytes], num_tokens: int) -> str:
        books = with_others(Books(self.inflight, self.prefills, self.pending.lookup(hashes), self.routing.rates),
                            self.other_books, hashes)
        candidates, _ = view.candidates(TieredMatch(TieredLookup()), books, None, self.routing.rng)
        decision = route(RouteRequest(num_prompt_tokens=num_tokens, block_size=16, max_tokens=16), candidates,
                         PolicyConfig(), state=self.routing)
        self.inflight[decision.decode_id] += 1
        self.prefills.add(decision.decode_id, request_id, num_tokens)
        self.pending.add(request_id, decision.decode_id, hashes)
        return decision.decode_id

    def doc(self, view: PoolView) -> str:
        queued = self.prefills.backlogs(view.snapshot.workers, self.routing.rates)
        return own_doc(self.name, self.clock.wall_ms(), self.inflight, queued, self.pending.newest(4096)).encode()


def burst(shared: bool, *, num_requests: int = 12, gap_s: float = 0.05, period_s: float = 0.05) -> Counter[str]:
    """d0 reported idle, d1-d3 three streams each (the last heartbeat); the burst goes round-robin across three
    routers; with ``shared``, they exchange their documents every ``period_s``."""
    clock, view = Clock(), PoolView(snapshot([0, 3, 3, 3]))
    routers = [Router(f"r{i}", clock) for i in range(3)]
    placed: Counter[str] = Counter()
    synced_s = float("-inf")
    for i in range(num_requests):
        if shared and clock() - synced_s >= period_s:
            docs = {r.name: r.doc(view) for r in routers}
            for r in routers:
                r.other_books = others_from(clock, *(d for name, d in docs.items() if name != r.name))
            synced_s = clock()
        placed[routers[i % 3].route(view, f"q{i}", chain(100 + i), 400)] += 1
        clock.now_s += gap_s
    return placed


def test_a_burst_across_three_routers_herds_without_shared_books_and_spreads_with_them():
    alone, shared = burst(False), burst(True)
    assert alone["d0"] >= 9, alone  # each router fills d0 to the others' level by its own books: three times over
    assert shared["d0"] <= 4 and max(shared.values()) <= 4 and len(shared) == 4, shared


def test_a_second_router_routes_a_prefix_to_where_the_first_is_computing_it():
    clock, view = Clock(), PoolView(snapshot([0, 0, 0, 0]))
    first, second = Router("r1", clock), Router("r2", clock)
    first.route(view, "x", chain(6), 400)  # d0, the default pick of idle workers
    prompt = chain(7, 800)
    computing = first.route(view, "a", prompt, 800)
    assert computing != "d0"
    second.other_books = others_from(clock, first.doc(view))
    clock.now_s += 0.05
    # not the idle d0 (nor another idle one, which would compute the whole prompt again): the worker computing
    # its prefix for the other router, which it waits for and then computes only its tail
    assert second.route(view, "b", prompt + chain(8, 32), 832) == computing


# --- the sync, against a real redis-server ---------------------------------------------------------------


class Owner:
    """A router's books (the relay's attributes ``BooksSync`` reads and writes)."""

    def __init__(self) -> None:
        self.inflight: Counter[str] = Counter()
        self.inflight_prefills = InflightPrefills()
        self.pending_prefixes = PendingPrefixes()
        self.routing = RoutingState()
        self.other_books = NO_OTHERS


async def until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Polls the async ``condition`` until it holds; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def redis_url():
    require_redis_server()
    with RedisServer.start() as server:
        yield server.url


def test_routers_see_each_others_books_through_redis_until_they_stop_or_die(redis_url):
    keys = RedisKeys("books-test")
    config = SharedBooksConfig(period_s=0.02, ttl_s=0.4)

    async def scenario() -> None:
        redis = connect(redis_url)
        a, b, c = Owner(), Owner(), Owner()
        syncs = [BooksSync(redis, keys, o, lambda: None, SharedBooksConfig(period_s=0.02, ttl_s=0.4, router_id=n))
                 for o, n in ((a, "ra"), (b, "rb"), (c, "rc"))]
        try:
            a.inflight["d0"] += 2
            a.inflight_prefills.add("d0", "q1", 500)
            a.pending_prefixes.add("q1", "d0", chain(1))
            b.inflight["d1"] += 1
            for sync in syncs:
                await sync.sync_once()
            await redis.set(keys.router_books("bad"), "{not json", px=5000)  # a router of another version, say
            await redis.sadd(keys.routers, "bad")
            for sync in syncs:  # everyone read what everyone wrote
                await sync.sync_once()
            assert c.other_books.routers == ("ra", "rb") and c.other_books.streams == {"d0": 2, "d1": 1}
            await redis.delete(keys.router_books("bad"))
            assert c.other_books.pending_lookup(chain(1)) == {"d0": len(chain(1))}
            assert b.other_books.routers == ("ra",)  # c has no books: it wrote nothing
            assert await redis.exists(keys.router_books("rc")) == 0
            b.inflight.clear()  # b's request ended: its books are deleted, not left to expire
            await syncs[1].sync_once()
            await syncs[2].sync_once()
            assert c.other_books.routers == ("ra",) and await redis.smembers(keys.routers) == {"ra"}
            await syncs[0].stop()  # a stops: its books go at once
            await syncs[2].sync_once()
            assert c.other_books is NO_OTHERS
            a.other_books = NO_OTHERS
            b.inflight["d2"] += 1
            await syncs[1].sync_once()
            assert 0 < await redis.pttl(keys.router_books("rb")) <= round(config.ttl_s * 1000)  # written with its TTL
            await syncs[2].sync_once()
            assert c.other_books.routers == ("rb",)
            # b dies (syncs no more): Redis expires its books by their TTL (a key written without one never goes)
            await until(lambda: _gone(redis, keys.router_books("rb")), "b's books expired", timeout_s=10 * config.ttl_s)
            await syncs[2].sync_once()
            assert c.other_books is NO_OTHERS and await redis.smembers(keys.routers) == set()
        finally:
            await redis.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 20.0))


def test_unchanged_books_are_only_extended_and_rewritten_after_they_expired(redis_url):
    """By cause, not by racing the TTL: the time left on the document is cut by hand (as if most of its TTL had run
    out) and the sync must set it back to the whole TTL; the clocks it reads move, so a rewrite would be dated later
    (another document)."""
    keys, key, ttl_ms = RedisKeys("books-extend"), RedisKeys("books-extend").router_books("r"), 60_000

    async def scenario() -> None:
        redis = connect(redis_url)
        owner, clock = Owner(), Clock()
        sync = BooksSync(redis, keys, owner, lambda: None,
                         SharedBooksConfig(period_s=0.02, ttl_s=ttl_ms / 1000, router_id="r"),
                         clock=clock, wall_ms=clock.wall_ms)
        try:
            owner.inflight["d0"] += 1
            await sync.sync_once()
            written = await redis.get(key)
            assert 0 < await redis.pttl(key) <= ttl_ms  # written with the TTL
            await redis.pexpire(key, 1_000)  # 1 s left
            clock.now_s += 30.0
            await sync.sync_once()  # unchanged: its TTL is extended, the document is the same one
            assert await redis.get(key) == written
            assert 1_000 < await redis.pttl(key) <= ttl_ms  # the whole TTL again
            await redis.delete(key)  # gone (a Redis restart, a stall past the TTL)
            await sync.sync_once()  # finds it gone ...
            assert await redis.exists(key) == 0  # (extending a missing key does not make one)
            await sync.sync_once()  # ... and writes it again: dated now
            assert (await redis.get(key)) not in (None, written) and 0 < await redis.pttl(key) <= ttl_ms
        finally:
            await redis.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 20.0))


def test_stop_ends_the_sync_even_when_a_round_swallows_the_cancellation(redis_url):
    """Python 3.11's ``asyncio.wait_for`` (in the loop and inside redis-py) can swallow a cancellation that lands as
    its operation completes; the router's stop must not wait for the sync forever (a CI run hung 30 s on it)."""
    keys = RedisKeys("books-stop")

    async def scenario() -> None:
        redis = connect(redis_url)
        sync = BooksSync(redis, keys, Owner(), lambda: None, SharedBooksConfig(period_s=0.02, ttl_s=0.3, router_id="r"))
        in_round = asyncio.Event()

        async def swallowing() -> None:  # a round that ends in the same turn of the loop as the stop's cancel
            in_round.set()

        sync.sync_once = swallowing
        try:
            sync.start()
            await in_round.wait()  # wakes before the loop's wait_for sees its round done: cancelled, it returns
            await asyncio.wait_for(sync.stop(), 5.0)
            assert sync._task is not None and sync._task.done()
        finally:
            await redis.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 20.0))


def test_redis_failing_drops_the_others_books_after_their_ttl():
    require_redis_server()
    keys, server = RedisKeys("books-down"), RedisServer.start()

    async def scenario() -> None:
        redis = connect(server.url, timeout_s=0.2)
        mine, theirs = Owner(), Owner()
        reader = BooksSync(redis, keys, mine, lambda: None, SharedBooksConfig(period_s=0.01, ttl_s=0.3, router_id="me"))
        writer = BooksSync(redis, keys, theirs, lambda: None, SharedBooksConfig(period_s=0.01, ttl_s=5, router_id="x"))
        try:
            theirs.inflight["d0"] += 1
            await writer.sync_once()
            reader.start()
            while mine.other_books is NO_OTHERS:
                await asyncio.sleep(0.01)
            assert mine.other_books.streams == {"d0": 1}
            server.stop()

            async def dropped() -> bool:
                return mine.other_books is NO_OTHERS

            await until(dropped, "stale books are not priced for ever")  # once the reader's TTL has passed
            await reader.stop()  # its delete fails quietly: its books expire on their own
        finally:
            await redis.aclose()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 20.0))
    finally:
        server.stop()


async def _gone(redis, key: str) -> bool:
    return await redis.exists(key) == 0
