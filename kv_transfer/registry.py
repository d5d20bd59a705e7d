"""Worker registry in Redis: registration, heartbeats with a TTL, load reports, pool and drain state (the
values it stores, ``WorkerInfo`` and ``WorkerLoad``, are ``kv_transfer.workers``'s, plain and I/O-free).

Keys (DESIGN.md "KV index and registry in Redis"; names in ``redis_index.RedisKeys``)::

    {ns}:worker:{id}           HASH   WorkerInfo fields; PEXPIRE = ttl, refreshed by every heartbeat
    {ns}:workers               SET    worker ids; ids whose worker key expired are pruned by list_workers
    {ns}:load:{id}             HASH   WorkerLoad fields + reported_unix_ms; same TTL
    {ns}:pool:{role}:desired   STRING desired pool size (admin)
    {ns}:draining              SET    ids being drained (admin)

A heartbeat rewrites the whole worker hash, so a worker comes back by itself after Redis restarts or after
it was pruned; it then clears stale index entries and tells its owner to republish its cache. Registering
(and coming back) announces a worker-up on ``{ns}:worker-events``, leaving a worker-down: that control stream
tells index mirrors which workers' block streams (``{ns}:events:{id}``) to follow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from kv_transfer.redis_index import DEFAULT_EVENTS_MAXLEN, EVENT_WORKER_UP, KVIndex, text
from kv_transfer.workers import ROLES, WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)

# Reads the worker's hash and load of every registered id in one round trip (read-only).
_LIST_LUA = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  out[#out + 1] = {id, redis.call('HGETALL', ARGV[1] .. 'worker:' .. id),
                   redis.call('HGETALL', ARGV[1] .. 'load:' .. id)}
end
return out
"""


def connect(url: str, *, timeout_s: float = 2.0) -> Any:
    """A ``redis.asyncio`` client with short timeouts and few retries, so callers notice an outage fast.

    ``url``: ``redis://[[user]:password@]host:port/db`` (Redis AUTH, ACL user or the default one) or
    ``rediss://...`` (TLS; redis-py's query parameters apply: ``ssl_ca_certs``, ``ssl_certfile``,
    ``ssl_keyfile``, ``ssl_cert_reqs``, ``ssl_check_hostname``; see ``with_ca``). Nothing connects yet;
    ``check_credentials`` fails fast on a wrong password. Never log ``url`` itself: log ``redact_url(url)``.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff

    try:
        return aioredis.from_url(
            url, decode_responses=True, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=2),
        )
    except ValueError as exc:  # redis-py's messages never quote the URL; ours must not either
        raise ValueError(f"bad Redis URL {redact_url(url)}: {exc}") from None


_SECRET_PARAMS = frozenset({"password", "ssl_password"})


def redact_url(url: str) -> str:
    """``url`` with any password (``user:PASSWORD@`` or ``?password=``) replaced by ``***``: safe to print."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"{userinfo}@{host}"
    query = "&".join(
        f"{name}=***" if name.lower() in _SECRET_PARAMS else (f"{name}={value}" if sep else name)
        for name, sep, value in (item.partition("=") for item in parts.query.split("&") if item)
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def with_ca(url: str, ca_path: str | None) -> str:
    """A ``rediss://`` URL verifying the server against ``ca_path`` (``$BATON_REDIS_CA``, read by the CLIs),
    unless the URL names its own ``ssl_ca_certs``; other URLs are returned as they are."""
    parts = urlsplit(url)
    if not ca_path or parts.scheme != "rediss" or "ssl_ca_certs" in parse_qs(parts.query):
        return url
    query = "&".join(filter(None, (parts.query, urlencode({"ssl_ca_certs": ca_path}))))
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


class RedisCredentialsError(RuntimeError):
    """Redis refused the credentials (or the TLS handshake): a configuration error, not an outage."""


async def check_credentials(redis: Any, url: str) -> bool:
    """PING once. Raise ``RedisCredentialsError`` (password redacted) when Redis refuses the credentials
    or the TLS handshake; return False when it is merely unreachable (everything reconnects later)."""
    from redis.exceptions import AuthenticationError, ConnectionError as RedisConnectionError, ResponseError

    try:
        await redis.ping()
    except AuthenticationError as exc:
        if urlsplit(url).password is None and "password=" not in urlsplit(url).query:
            raise RedisCredentialsError(f"Redis at {redact_url(url)} refused the credentials: it requires a "
                                        "password and the URL gives none (redis://:PASSWORD@host:port/0)") from None
        raise RedisCredentialsError(f"Redis at {redact_url(url)} refused the credentials: {exc} "
                                    "(give the password as redis://:PASSWORD@host:port/0, or "
                                    "redis://USER:PASSWORD@... for an ACL user)") from None
    except ResponseError as exc:  # e.g. "AUTH <password> called without any password configured"
        raise RedisCredentialsError(f"Redis at {redact_url(url)} refused the connection: {exc}") from None
    except RedisConnectionError as exc:
        if "SSL" in str(exc) or "certificate" in str(exc).lower():
            raise RedisCredentialsError(f"TLS to Redis at {redact_url(url)} failed: {exc}") from None
        log.warning("Redis at %s is unreachable for now (%s); continuing, it is retried", redact_url(url), exc)
        return False
    return True


def _pairs(flat: list[Any]) -> dict[str, str]:
    return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}


class Registry:
    """Workers register and heartbeat; routers list workers (pruning dead ones); the admin sets pools."""

    def __init__(self, redis: Any, ns: str = "baton", ttl_s: float = 6.0, *,
                 events_maxlen: int = DEFAULT_EVENTS_MAXLEN) -> None:
        self._redis = redis
        self.ttl_s = ttl_s
        self.index = KVIndex(redis, ns, events_maxlen=events_maxlen)
        self.keys = self.index.keys
        self._list = redis.register_script(_LIST_LUA)

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    async def register(self, info: WorkerInfo) -> None:
        """Fresh start: forget index entries of an earlier process with this id, then announce the worker."""
        await self.index.remove_worker(info.worker_id)
        key = self.keys.worker(info.worker_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(key, self.keys.load(info.worker_id))
        pipe.hset(key, mapping=info.to_fields())
        pipe.pexpire(key, self._ttl_ms)
        pipe.sadd(self.keys.workers, info.worker_id)
        self._worker_up(pipe, info, "register")
        await pipe.execute()
        log.info("registered worker_id=%s role=%s grpc=%s", info.worker_id, info.role, info.grpc_address)

    async def heartbeat(self, info: WorkerInfo, load: WorkerLoad) -> bool:
        """Refresh the worker's keys in one round trip.

        Returns True when the worker hash had to be re-created (Redis restarted, or the worker was pruned
        after missing its TTL): its index entries were cleared and the caller must republish its cache.
        """
        if load.reported_unix_ms is None:
            load = dataclasses.replace(load, reported_unix_ms=int(time.time() * 1000))
        key, load_key = self.keys.worker(info.worker_id), self.keys.load(info.worker_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(key, mapping=info.to_fields())
        pipe.pexpire(key, self._ttl_ms)
        pipe.sadd(self.keys.workers, info.worker_id)
        pipe.delete(load_key)
        pipe.hset(load_key, mapping=load.to_fields())
        pipe.pexpire(load_key, self._ttl_ms)
        created = int((await pipe.execute())[0]) > 0
        if created:
            log.warning("worker_id=%s was missing from Redis; re-registered", info.worker_id)
            await self.index.remove_worker(info.worker_id)
            pipe = self._redis.pipeline(transaction=True)
            self._worker_up(pipe, info, "reregister")
            await pipe.execute()
        return created

    async def deregister(self, worker_id: str) -> None:
        """Remove the worker, its load, index entries and drain mark; emits worker-down."""
        await self.index.drop_worker(worker_id, "deregister")
        log.info("deregistered worker_id=%s", worker_id)

    async def list_workers(self) -> list[tuple[WorkerInfo, WorkerLoad | None]]:
        """Live workers (sorted by id) with their last load, in one round trip; prunes expired ids."""
        out: list[tuple[WorkerInfo, WorkerLoad | None]] = []
        for raw_id, raw_info, raw_load in await self._list(keys=[self.keys.workers], args=[self.keys.ns + ":"]):
            worker_id = text(raw_id)
            if not raw_info:
                if await self.index.drop_worker(worker_id, "expired"):
                    log.warning("pruned expired worker_id=%s", worker_id)
                continue
            try:
                info = WorkerInfo.from_fields(worker_id, _pairs(raw_info))
                load = WorkerLoad.from_fields(_pairs(raw_load)) if raw_load else None
            except (KeyError, ValueError) as exc:
                log.warning("skipping malformed registry entry worker_id=%s: %r", worker_id, exc)
                continue
            out.append((info, load))
        return sorted(out, key=lambda pair: pair[0].worker_id)

    async def set_desired_pool_size(self, role: Role, size: int) -> None:
        if role not in ROLES or size < 0:
            raise ValueError(f"bad pool size {role!r}={size}")
        await self._redis.set(self.keys.pool_desired(role), size)

    async def get_desired_pool_size(self, role: Role) -> int | None:
        value = await self._redis.get(self.keys.pool_desired(role))
        return None if value is None else int(value)

    async def add_draining(self, worker_id: str) -> None:
        await self._redis.sadd(self.keys.draining, worker_id)

    async def remove_draining(self, worker_id: str) -> None:
        await self._redis.srem(self.keys.draining, worker_id)

    async def list_draining(self) -> set[str]:
        return {text(m) for m in await self._redis.smembers(self.keys.draining)}

    def _worker_up(self, pipe: Any, info: WorkerInfo, reason: str) -> None:
        self.index.add_worker_event(
            pipe, EVENT_WORKER_UP, info.worker_id, role=info.role, grpc_address=info.grpc_address, reason=reason
        )


class HeartbeatTask:
    """Registers a worker, then heartbeats every ``interval_s`` in the background until stopped.

    Never raises into the worker: Redis errors are logged and retried with backoff (up to ``interval_s``).
    ``load_fn`` returns the current load; ``on_reregistered`` (async) republishes the worker's cached block
    hashes after the registry lost them; it is retried on later beats until it succeeds.
    """

    def __init__(
        self,
        registry: Registry,
        info: WorkerInfo,
        load_fn: Callable[[], WorkerLoad],
        *,
        interval_s: float = 2.0,
        on_reregistered: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._registry, self._info, self._load_fn = registry, info, load_fn
        self.interval_s = interval_s
        self._on_reregistered = on_reregistered
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.registered = False
        self.beats = 0  # successful heartbeats
        self.failures = 0  # consecutive failed attempts

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self._info.worker_id}")

    async def stop(self, *, deregister: bool = True) -> None:
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None
        if deregister:
            try:
                await asyncio.wait_for(self._registry.deregister(self._info.worker_id), self.interval_s)
            except Exception as exc:  # noqa: BLE001 - shutdown must not fail on Redis
                log.warning("deregister failed worker_id=%s: %r", self._info.worker_id, exc)

    async def _run(self) -> None:
        backoff_s = min(0.1, self.interval_s)
        republish = False
        while not self._stopping.is_set():
            try:
                async with asyncio.timeout(max(self.interval_s, 1.0)):
                    republish = await self._beat() or republish
                if republish and self._on_reregistered is not None:
                    await self._on_reregistered()
                republish = False
            except Exception as exc:  # noqa: BLE001 - a Redis outage must never crash the worker
                self.failures += 1
                level = logging.WARNING if self.failures == 1 else logging.DEBUG
                log.log(level, "heartbeat failed worker_id=%s (attempt %d): %r", self._info.worker_id,
                        self.failures, exc)
                await self._sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.interval_s)
                continue
            if self.failures:
                log.info("heartbeat recovered worker_id=%s after %d failures", self._info.worker_id, self.failures)
            self.failures, backoff_s = 0, min(0.1, self.interval_s)
            await self._sleep(self.interval_s)

    async def _beat(self) -> bool:
        if not self.registered:
            await self._registry.register(self._info)
            self.registered = True
        recreated = await self._registry.heartbeat(self._info, self._load_fn())
        self.beats += 1
        return recreated

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass
