"""The worker shell shared by both roles: engine thread, gRPC server, KV data plane, leases, Redis.

A prefill worker serves ``Prefill``: it computes the prompt, samples the first token and pins the
prompt's blocks under a transfer lease that a decode worker pulls from. ``decode_node`` extends this
shell with ``Decode`` (a decode worker is a worker that also imports KV and decodes).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.outputs import RequestDelta, SchedulerStats
from engine.engine import Engine
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import Lease, LeaseTable
from kv_transfer.registry import HeartbeatTask, Registry, WorkerInfo, WorkerLoad, connect
from kv_transfer.progress import LayerProgress
from kv_transfer.transport import (
    STREAMING_KINDS, KVClient, TransportConfig, connect as kv_connect, make_server, parse_kinds, uri_kind,
)
from prefill_node.drain import DrainGate, InFlightCounter
from prefill_node.layerwise import LayerwiseHooks
from prefill_node.metrics import WorkerMetrics
from prefill_node.publisher import IndexPublisher
from prefill_node.servicer import WorkerServicer
from proto import baton_pb2 as pb
from proto.malformed import MalformedRequestInterceptor
from proto.metrics_http import serve_metrics
from proto.tls import TlsConfig, add_port, describe
from proto import baton_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    role: str  # prefill | decode
    engine: EngineConfig
    redis_url: str
    namespace: str = "baton"
    host: str = "127.0.0.1"
    grpc_port: int = 0
    kv_transport: str = "tcp"  # --kv-transport: "auto" or kinds in order of preference, e.g. "ucx,tcp"
    kv_port: int = 0
    kv_advertise_uri: str | None = None  # the KV URI registered for peers (e.g. a proxy's); None: the served one
    kv_checksum: bool = False  # pulls ask for and verify per-block xxh3 checksums (decode role)
    kv_io_timeout_s: float = 10.0  # the longest a pull waits on its peer at any one point (decode role)
    kv_secret: bytes | None = field(default=None, repr=False)  # data-plane HMAC secret (kv_transfer/auth.py)
    worker_id: str | None = None
    calibrate_tokens: int = 256  # Engine.calibrate at start, before registering (0: no calibration)
    lease_ttl_s: float = 30.0
    heartbeat_ttl_s: float = 6.0
    heartbeat_interval_s: float = 2.0
    metrics_port: int | None = None  # Prometheus /metrics on host:metrics_port; None or 0: no endpoint
    on_drain: str = "exit"  # drained by the admin: exit once idle (exit) or stay up, idle (stay)
    drain_settle_s: float = 5.0  # idle this long while draining before exiting
    tls: TlsConfig | None = None  # serve gRPC over TLS (mTLS when it has a CA); None: plaintext


class WorkerNode:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.leases = LeaseTable(default_ttl_s=config.lease_ttl_s)
        self.lease_of_request: dict[str, Lease] = {}
        # layer-wise (PrefillStream): the leases pinned at admission, and their progress while computing
        self.early_leases: dict[str, Lease] = {}  # request id -> lease, until the request hands its blocks over
        self.progress_of_lease: dict[str, LayerProgress] = {}
        self.admitted_waiters: dict[str, asyncio.Future] = {}  # request id -> its early lease, for PrefillStream
        self.load = WorkerLoad(running=0, waiting=0, free_blocks=0, queued_prefill_tokens=0)
        self._tasks: list[asyncio.Task] = []
        self.in_flight = InFlightCounter(frozenset(f"/{WORKER_SERVICE}/{m}" for m in ("Prefill", "PrefillStream", "Decode")))
        self.drained = asyncio.Event()  # set when drained and idle with on_drain="exit": the process may exit

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.engine: Engine = await asyncio.to_thread(Engine, self.config.engine)
        if self.config.calibrate_tokens > 0:  # before the engine loop runs: the thread has the engine to itself
            await asyncio.to_thread(self.engine.calibrate, self.config.calibrate_tokens)
        self.layout = _layout(self.engine)
        self.layerwise = LayerwiseHooks(loop, self.layout.num_layers, self._on_admitted, self._ready_probe)
        self.async_engine = AsyncEngine(self.engine, on_held=self._on_held, step_hooks=self.layerwise)
        self.async_engine.start()
        # a byte view: numpy has no bfloat16, and the data plane moves bytes (CPU caches; CUDA needs staging)
        self.kv_buffer = KVBuffer(self.layout, self.engine.runner.kv_cache.view(torch.uint8).numpy())
        # Every transport of --kv-transport is served (kv_uri lists their URIs, space-separated) and tried
        # in that order when pulling: the pair's transport is the puller's first one the server offers.
        self.kv_kinds = parse_kinds(self.config.kv_transport, str(self.engine.device))
        self.transport_config = transport_config(self.config)
        self._kv_clients: dict[str, KVClient] = {}
        resolve = self.leases.resolver(time.monotonic)
        self.kv_servers = [make_server(kind, buffer=self.kv_buffer, resolve=resolve, config=self.transport_config,
                                       progress=self.progress_of_lease.get) for kind in self.kv_kinds]
        served = [await server.start(self.config.host, self.config.kv_port if i == 0 else 0)
                  for i, server in enumerate(self.kv_servers)]
        self.kv_uri = self.config.kv_advertise_uri or " ".join(served)
        # what an early (kv_pending) handle offers: the URIs whose server streams layers
        self.streaming_kv_uri = " ".join(u for u in self.kv_uri.split() if uri_kind(u) in STREAMING_KINDS)
        self.grpc_address = await self._start_grpc()
        self.worker_id = self.config.worker_id or f"{self.config.role}-{socket.gethostname()}-{self.grpc_port}"
        self.metrics = WorkerMetrics(self.worker_id)
        self.metrics_server = serve_metrics(self.metrics.registry, self.config.host, self.config.metrics_port,
                                            self.config.tls)
        self.redis = connect(self.config.redis_url)
        self.registry = Registry(self.redis, self.config.namespace, self.config.heartbeat_ttl_s)
        self.publisher = IndexPublisher(self)
        self.heartbeat = HeartbeatTask(self.registry, self._info(), lambda: self.load,
                                       interval_s=self.config.heartbeat_interval_s,
                                       on_reregistered=self.publisher.republish_all)
        self.heartbeat.start()
        self._tasks = [asyncio.create_task(self._housekeeping(), name="housekeeping"),
                       asyncio.create_task(self._watch_drain(), name="drain")]
        logger.info("worker %s (%s) serving gRPC on %s, KV on %s", self.worker_id, self.config.role,
                    self.grpc_address, self.kv_uri)
        return self.grpc_address

    async def stop(self, grace_s: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        await self.heartbeat.stop(deregister=True)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        await self.grpc_server.stop(grace_s)
        for server in self.kv_servers:
            await server.stop()
        for client in self._kv_clients.values():
            if callable(close := getattr(client, "close", None)):
                close()  # pooled connections (nccl channels)
        self.async_engine.stop()
        await self.redis.aclose()

    async def _start_grpc(self) -> str:
        self.grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)],
                                           interceptors=[MalformedRequestInterceptor(), self.in_flight])
        pb_grpc.add_WorkerServicer_to_server(self.servicer(), self.grpc_server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.grpc_server)
        names = (WORKER_SERVICE, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.grpc_server)
        self.grpc_port = add_port(self.grpc_server, f"{self.config.host}:{self.config.grpc_port}", self.config.tls)
        await self.grpc_server.start()
        logger.info("gRPC on %s:%d is %s", self.config.host, self.grpc_port, describe(self.config.tls))
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        return f"{self.config.host}:{self.grpc_port}"

    def kv_client(self, kind: str) -> KVClient:
        """This worker's client for transport ``kind``, kept across pulls (nccl reuses its channels)."""
        if kind not in self._kv_clients:
            self._kv_clients[kind] = kv_connect(f"{kind}://", self.transport_config)
        return self._kv_clients[kind]

    def servicer(self) -> WorkerServicer:
        return WorkerServicer(self)

    def _info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id, role=self.config.role, grpc_address=self.grpc_address, kv_uri=self.kv_uri,
            model_fingerprint=self.engine.fingerprint.hex(), layout_json=self.layout.to_json(),
            total_blocks=self.engine.cache_config.num_blocks,
        )

    # ---- leases (event loop thread) ------------------------------------------------------
    def _on_held(self, delta: RequestDelta) -> None:
        """Engine thread: a prefill finished and handed its blocks over; pin them under a lease."""
        self.loop.call_soon_threadsafe(self._create_lease, delta.request_id, delta.held_block_ids)

    def _create_lease(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        early = self.early_leases.pop(request_id, None)
        if early is None:
            self.lease_of_request[request_id] = self.leases.create(block_ids, now=time.monotonic())
            return
        # pinned at admission (layer-wise): the lease holds already (its TTL restarts now, as a lease made
        # after the prefill would), or was released / expired meanwhile, which freed its blocks; free only
        # what the request holds beyond them
        self.progress_of_lease.pop(early.lease_id, None)
        renewed = self.leases.renew(early.lease_id, now=time.monotonic())
        if renewed is not None and self.lease_of_request.get(request_id) is early:
            self.lease_of_request[request_id] = renewed
        extra = sorted(set(block_ids) - set(early.block_ids))
        if extra:
            self.async_engine.submit(lambda e: e.release_blocks(extra))

    def _on_admitted(self, request_id: str, block_ids: tuple[int, ...], progress: LayerProgress) -> None:
        """Event loop, layer-wise: the step computing ``request_id``'s last prompt chunk started; pin its
        blocks now so a pull can stream each layer as it is written (``prefill_node/layerwise.py``)."""
        lease = self.leases.create(block_ids, now=time.monotonic())
        self.early_leases[request_id] = self.lease_of_request[request_id] = lease
        self.progress_of_lease[lease.lease_id] = progress
        waiter = self.admitted_waiters.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(lease)

    def _ready_probe(self, layer: int):
        """On CUDA, layer ``layer``'s event of the running step (its kernels finish after the hook)."""
        events = self.engine.runner.layer_events
        return events[layer].query if layer < len(events) else None

    def release_lease(self, lease_id: str) -> bool:
        lease = self.leases.release(lease_id)
        if lease is not None:
            self._free(lease)
            self.progress_of_lease.pop(lease_id, None)
        return lease is not None

    def _free(self, lease: Lease) -> None:
        self.async_engine.submit(lambda e: e.release_blocks(list(lease.block_ids)))

    async def _housekeeping(self, period_s: float = 0.25) -> None:
        """Expire leases, refresh the load figures, publish block events to the index."""
        while True:
            expired = self.leases.expire(time.monotonic())
            for lease in expired:
                logger.info("transfer lease expired; freeing %d blocks", len(lease.block_ids))
                self._free(lease)
                self.progress_of_lease.pop(lease.lease_id, None)
            expired_ids = {lease.lease_id for lease in expired}
            for request_id, lease in list(self.lease_of_request.items()):
                if lease.lease_id in expired_ids:
                    del self.lease_of_request[request_id]
            try:
                stats, self.load = await self.async_engine.call(_sample)
                self.metrics.scheduler_stats(stats)
                await self.publisher.publish_pending()
            except Exception as exc:  # noqa: BLE001 - Redis down: keep serving, retry next period
                logger.debug("housekeeping: %r", exc)
            await asyncio.sleep(period_s)

    async def _watch_drain(self) -> None:
        """Read ``{ns}:draining`` at the heartbeat's pace; once drained and idle, exit (or stay, idle)."""
        gate = DrainGate(settle_s=self.config.drain_settle_s)
        period_s = min(self.config.heartbeat_interval_s, 1.0)
        while True:
            try:
                draining = bool(await self.redis.sismember(self.registry.keys.draining, self.worker_id))
            except Exception as exc:  # noqa: BLE001 - Redis down: keep the last known state
                logger.debug("drain check: %r", exc)
                draining = None
            stats = await self.async_engine.call(lambda e: e.stats())
            busy = self.in_flight.count > 0 or len(self.leases) > 0 or stats.num_running + stats.num_waiting > 0
            if gate.update(draining=draining, busy=busy, now_s=time.monotonic()) and self.config.on_drain == "exit":
                logger.info("worker %s drained and idle for %.1f s: exiting", self.worker_id, gate.settle_s)
                self.drained.set()
                return
            await asyncio.sleep(period_s)


def transport_config(config: WorkerConfig) -> TransportConfig:
    """The worker's data-plane settings, the same for what it serves and what it pulls."""
    return TransportConfig(checksum=config.kv_checksum, secret=config.kv_secret, io_timeout_s=config.kv_io_timeout_s)


def _sample(engine: Engine) -> tuple[SchedulerStats, WorkerLoad]:
    stats = engine.stats()
    return stats, _load(engine, stats)


def _load(engine: Engine, stats: SchedulerStats) -> WorkerLoad:
    """The worker's load as the router prices it; queued prompt tokens are what is left to compute: a waiting
    request's cached prefix does not count (it is found when the request is scheduled)."""
    cache, size = engine.kv_cache_manager, engine.cache_config.block_size
    queued = sum(r.num_tokens - max(r.num_computed_tokens, len(cache.get_computed_blocks(r)) * size)
                 for r in engine.scheduler.waiting)
    queued += sum(r.num_tokens - r.num_computed_tokens - 1 for r in engine.scheduler.running)
    rates = engine.step_rates
    return WorkerLoad(running=stats.num_running, waiting=stats.num_waiting, free_blocks=stats.num_free_blocks,
                      queued_prefill_tokens=max(queued, 0), prefill_tokens_per_s=rates.prefill_tokens_per_s,
                      decode_step_s=rates.decode_step_s, decode_batch_size=rates.decode_batch_size,
                      decode_step_per_seq_s=rates.decode_step_per_seq_s)


def _layout(engine: Engine) -> KVLayout:
    config = engine.model_config
    return KVLayout(model_fingerprint=engine.fingerprint, dtype=config.dtype, block_size=engine.cache_config.block_size,
                    num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
