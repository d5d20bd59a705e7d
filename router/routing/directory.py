"""The router's view of the workers: a short-lived cache of the Redis registry, KV index lookups, and
one gRPC channel per worker address.

Redis down: the last listing keeps serving (stale) and lookups return nothing, so routing falls back to
load only (DESIGN.md); with no listing at all requests fail with UNAVAILABLE until Redis is back.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from kv_transfer.index_schema import TieredLookup
from kv_transfer.registry import Registry
from kv_transfer.workers import WorkerInfo, WorkerLoad
from proto import baton_pb2_grpc as pb_grpc
from proto.tls import PEER_CHANNEL_OPTIONS, TlsConfig, aio_channel
from router.errors import WorkerUnavailable
from router.routing.chain_match import PrefixMatch, TieredMatch
from router.routing.mirror_sync import MirrorSync
from router.routing.policy import Candidate

log = logging.getLogger(__name__)

WorkerEntry = tuple[WorkerInfo, WorkerLoad | None]


@dataclass(frozen=True, slots=True)
class HashScheme:
    """How the served model's blocks are hashed: the workers' fingerprint and block size."""

    fingerprint: bytes
    block_size: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    workers: tuple[WorkerEntry, ...]
    draining: frozenset[str]
    taken_at_s: float  # monotonic

    def info(self, worker_id: str) -> WorkerInfo | None:
        return next((info for info, _ in self.workers if info.worker_id == worker_id), None)


def block_size_of(info: WorkerInfo) -> int | None:
    return _block_size(info.layout_json)


def scheme_of(info: WorkerInfo) -> HashScheme | None:
    return _scheme(info.layout_json, info.model_fingerprint)


# Parsed once per distinct registration string, not per worker per request (routing decisions read them
# for every worker; a pool has a handful of distinct layouts).
@functools.lru_cache(maxsize=256)
def _block_size(layout_json: str) -> int | None:
    try:
        value = json.loads(layout_json)["block_size"]
        return value if isinstance(value, int) and value >= 1 else None
    except (ValueError, KeyError, TypeError):
        return None


@functools.lru_cache(maxsize=256)
def _scheme(layout_json: str, model_fingerprint: str) -> HashScheme | None:
    block_size = _block_size(layout_json)
    try:
        fingerprint = bytes.fromhex(model_fingerprint)
    except ValueError:
        return None
    return None if block_size is None or not fingerprint else HashScheme(fingerprint, block_size)


def served_scheme(workers: Sequence[WorkerEntry]) -> HashScheme | None:
    """The scheme most decode workers share (ties: the first worker's); all workers when no decode one.

    Workers registered with another scheme serve another model or layout: routing leaves them out.
    """
    decode = [info for info, _ in workers if info.role == "decode"]
    pool = decode or [info for info, _ in workers]
    schemes = [s for info in pool if (s := scheme_of(info)) is not None]
    return Counter(schemes).most_common(1)[0][0] if schemes else None


def build_candidates(
    snapshot: Snapshot, scheme: HashScheme, cached_blocks: Mapping[str, int],
    inflight: Mapping[str, int] | None = None,
    inflight_prefill_tokens: Mapping[str, int] | None = None, pending_blocks: Mapping[str, int] | None = None,
    tiered_blocks: Mapping[str, int] | None = None, workers: Sequence[WorkerEntry] | None = None,
) -> list[Candidate]:
    """``cached_blocks``: the index's KV-pool (gpu) counts; ``tiered_blocks``: its pool-or-host counts;
    ``workers``: the snapshot's workers to build (pre-selected, ``router.routing.preselect``), else all."""
    inflight, prefill_tokens, pending = inflight or {}, inflight_prefill_tokens or {}, pending_blocks or {}
    tiered = tiered_blocks or {}
    return [
        Candidate(
            info=info, load=load, cached_blocks=cached_blocks.get(info.worker_id, 0),
            tiered_blocks=max(tiered.get(info.worker_id, 0), cached_blocks.get(info.worker_id, 0)),
            draining=info.worker_id in snapshot.draining, inflight=inflight.get(info.worker_id, 0),
            inflight_prefill_tokens=prefill_tokens.get(info.worker_id, 0),
            pending_blocks=pending.get(info.worker_id, 0),
        )
        for info, load in (snapshot.workers if workers is None else workers)
        if scheme_of(info) == scheme
    ]


class WorkerDirectory:
    def __init__(
        self,
        registry: Registry,
        *,
        ttl_s: float = 0.5,
        channel_idle_s: float = 900.0,
        redis_retry_s: float = 1.0,
        redis_wait_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        mirror: MirrorSync | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        """``channel_idle_s``: a channel whose address left the registry is closed after this long (longer
        than any request may last, so a worker that misses a heartbeat never loses its streams).
        ``redis_retry_s``: after a Redis failure, requests use the stale listing and skip index lookups
        for this long instead of each waiting on Redis's timeout.
        ``redis_wait_s``: the longest a request waits on Redis (a listing, a lookup; each takes a millisecond or
        so): requests wait for a listing only in its first ``redis_wait_s`` (it goes on in the background after),
        and a listing or lookup that fails or takes longer stops lookups (load-only routing) until a listing
        succeeds. A Redis that does not answer (a partition: no error, only silence) costs a request at most
        this much, not the client's timeouts and retries (seconds each, twice).
        ``mirror``: an in-memory mirror of the KV index answers lookups with no round trip while in sync.
        ``tls``: call the workers over TLS (presenting its certificate for mTLS); None: plaintext."""
        self._registry = registry
        self.mirror = mirror
        self._ttl_s = ttl_s
        self._channel_idle_s = channel_idle_s
        self._redis_retry_s = redis_retry_s
        self._redis_wait_s = redis_wait_s
        self._refreshing: asyncio.Task | None = None
        self._refresh_started_s = 0.0  # loop time
        self._redis_silent = False  # the last listing failed or timed out: lookups are skipped
        self._clock = clock
        self._snapshot: Snapshot | None = None
        self._last_nonempty_s = float("-inf")  # when a listing last held any worker
        self._next_refresh_s = 0.0
        self._lookups_paused_until_s = 0.0
        self._refresh_lock = asyncio.Lock()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = tls
        self._last_listed_s: dict[str, float] = {}  # address -> when a listing last held it
        self._mismatch_warned: set[str] = set()

    async def snapshot(self) -> Snapshot:
        """The registry as of at most ``ttl_s`` ago; one refresh at a time however many requests wait. Requests
        wait for a refresh only in its first ``redis_wait_s``: after that they use the last listing."""
        if self._fresh():
            return self._snapshot  # type: ignore[return-value]
        loop = asyncio.get_running_loop()
        if self._refreshing is None or self._refreshing.done():
            self._refreshing, self._refresh_started_s = asyncio.ensure_future(self._refresh_once()), loop.time()
        if self._snapshot is None:
            await asyncio.shield(self._refreshing)  # nothing to route by yet: wait (WorkerUnavailable if it fails)
        elif (left_s := self._refresh_started_s + self._redis_wait_s - loop.time()) > 0:  # a refresh's first second
            done, _ = await asyncio.wait({self._refreshing}, timeout=left_s)
            if not done:
                self._mark_silent(f"the worker listing took longer than {self._redis_wait_s:g} s")
        assert self._snapshot is not None
        return self._snapshot

    @property
    def last_snapshot(self) -> Snapshot | None:
        """The last listing, however old (None before the first); never waits on Redis."""
        return self._snapshot

    def _mark_silent(self, why: str) -> None:
        """Redis did not answer (in time): requests route by load only (no lookups) until a listing succeeds."""
        if not self._redis_silent:
            log.warning("Redis is not answering (%s): routing with the last listing and by load only", why)
        self._redis_silent = True

    async def _refresh_once(self) -> None:
        async with self._refresh_lock:
            if not self._fresh():
                await self._refresh()

    async def lookup(self, hashes: list[bytes]) -> dict[str, int]:
        """Leading blocks per worker held in its KV pool (the index's ``gpu`` tier: what a worker serves a
        prefix hit from today); empty (load-only routing) when Redis cannot answer."""
        return dict((await self.lookup_tiers(hashes)).gpu)

    async def lookup_tiers(self, hashes: list[bytes]) -> TieredLookup:
        """Per worker its leading blocks in its KV pool and in its pool or host tier, and the store's; empty
        when Redis cannot answer. From the mirror while it is in sync, else one round trip to Redis."""
        if self.mirror is not None and (mirrored := self.mirror.lookup_tiers(hashes)) is not None:
            return mirrored
        return await self._ask_redis(hashes) or TieredLookup()

    async def match(self, hashes: list[bytes]) -> PrefixMatch:
        """``lookup_tiers``' answer in the shape pre-selection reads: the mirror's walk while it is in sync
        (holders named only on demand), else the Redis script's answer (or none)."""
        if self.mirror is not None and (mirrored := self.mirror.match(hashes)) is not None:
            return mirrored
        lookup = await self._ask_redis(hashes)
        return TieredMatch(lookup or TieredLookup(), answered=lookup is not None)

    def store_run(self, hashes: list[bytes], worker_id: str) -> int | None:
        """Leading blocks of the prompt ``worker_id`` or the shared store holds (the mirror's walk; see
        ``IndexMirror.store_run``): sent to the worker that computes the prompt so it reads the store's part
        without asking the store first. None without a mirror in sync: the worker asks."""
        return self.mirror.store_run(hashes, worker_id) if self.mirror is not None else None

    async def _ask_redis(self, hashes: list[bytes]) -> TieredLookup | None:
        if self._redis_silent or self._clock() < self._lookups_paused_until_s:
            return None
        try:
            return await asyncio.wait_for(self._registry.index.lookup_tiers(hashes), self._redis_wait_s)
        except Exception as exc:  # noqa: BLE001 - any Redis failure (or silence) degrades routing, never fails it
            log.warning("KV index lookup failed, routing by load only for %.1f s: %r", self._redis_retry_s, exc)
            self._lookups_paused_until_s = self._clock() + self._redis_retry_s
            return None

    def stub(self, info: WorkerInfo) -> pb_grpc.WorkerStub:
        channel = self._channels.get(info.grpc_address)
        if channel is None:
            channel = aio_channel(info.grpc_address, self._tls, PEER_CHANNEL_OPTIONS)
            self._channels[info.grpc_address] = channel
            self._last_listed_s.setdefault(info.grpc_address, self._clock())
        return pb_grpc.WorkerStub(channel)

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)

    def _fresh(self) -> bool:
        return self._snapshot is not None and self._clock() < self._next_refresh_s

    async def _refresh(self) -> None:
        try:
            workers = await self._registry.list_workers()
            draining = await self._registry.list_draining()
        except Exception as exc:  # noqa: BLE001 - Redis errors come in many classes
            if self._snapshot is None:
                raise WorkerUnavailable(f"cannot list workers: Redis is unreachable ({exc!r})") from exc
            log.warning("worker listing failed, using the one from %.1f s ago: %r",
                        self._clock() - self._snapshot.taken_at_s, exc)
            self._next_refresh_s = self._clock() + self._redis_retry_s
            self._mark_silent(repr(exc))
            return
        if self._redis_silent:
            log.warning("Redis answers again: routing by the KV index")
        self._redis_silent = False
        now = self._clock()
        if workers:
            self._last_nonempty_s = now
        elif self._snapshot is not None and self._snapshot.workers \
                and now - self._last_nonempty_s < self._registry.ttl_s and not await self._redis_kept_data():
            # Redis answered with no workers at all, right after listing some, and its control stream is
            # gone too: it restarted empty, and the workers re-register with their next heartbeat. Keep
            # routing to the last listing for up to one heartbeat TTL rather than failing every request.
            log.warning("Redis came back empty; routing to the last listing until the workers re-register")
            workers = list(self._snapshot.workers)
        self._snapshot = Snapshot(tuple(workers), frozenset(draining), now)
        self._next_refresh_s = self._snapshot.taken_at_s + self._ttl_s
        await self._close_idle_channels()
        self._warn_mismatches()

    async def _redis_kept_data(self) -> bool:
        try:
            return await self._registry.index.has_events()
        except Exception:  # noqa: BLE001 - cannot tell: believe the listing
            return True

    async def _close_idle_channels(self) -> None:
        now = self._clock()
        for info, _ in self._snapshot.workers:  # type: ignore[union-attr]
            self._last_listed_s[info.grpc_address] = now
        stale = [a for a in self._channels if now - self._last_listed_s.get(a, now) > self._channel_idle_s]
        for address in stale:
            self._last_listed_s.pop(address, None)
            await self._channels.pop(address).close()

    def _warn_mismatches(self) -> None:
        workers = self._snapshot.workers  # type: ignore[union-attr]
        scheme = served_scheme(workers)
        for info, _ in workers:
            if scheme_of(info) != scheme and info.worker_id not in self._mismatch_warned:
                self._mismatch_warned.add(info.worker_id)
                log.warning("worker_id=%s registered another model fingerprint or block size; not routed to",
                            info.worker_id)
