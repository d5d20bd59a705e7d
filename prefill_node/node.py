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
from dataclasses import dataclass

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
from kv_transfer.transport import make_server
from prefill_node.metrics import WorkerMetrics
from prefill_node.publisher import IndexPublisher
from prefill_node.servicer import WorkerServicer
from proto import baton_pb2 as pb
from proto.malformed import MalformedRequestInterceptor
from proto.metrics_http import serve_metrics
from proto import baton_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    role: str  # prefill | decode
    engine: EngineConfig
    redis_url: str
    namespace: str = "baton"
    host: str = "127.0.0.1"
    grpc_port: int = 0
    kv_transport: str = "tcp"
    kv_port: int = 0
    worker_id: str | None = None
    lease_ttl_s: float = 30.0
    heartbeat_ttl_s: float = 6.0
    heartbeat_interval_s: float = 2.0
    metrics_port: int | None = None  # Prometheus /metrics on host:metrics_port; None or 0: no endpoint


class WorkerNode:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.leases = LeaseTable(default_ttl_s=config.lease_ttl_s)
        self.lease_of_request: dict[str, Lease] = {}
        self.load = WorkerLoad(running=0, waiting=0, free_blocks=0, queued_prefill_tokens=0)
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.engine: Engine = await asyncio.to_thread(Engine, self.config.engine)
        self.async_engine = AsyncEngine(self.engine, on_held=self._on_held)
        self.async_engine.start()
        self.layout = _layout(self.engine)
        # a byte view: numpy has no bfloat16, and the data plane moves bytes (CPU caches; CUDA needs staging)
        self.kv_buffer = KVBuffer(self.layout, self.engine.runner.kv_cache.view(torch.uint8).numpy())
        self.kv_server = make_server(self.config.kv_transport, buffer=self.kv_buffer,
                                     resolve=self.leases.resolver(time.monotonic))
        self.kv_uri = await self.kv_server.start(self.config.host, self.config.kv_port)
        self.grpc_address = await self._start_grpc()
        self.worker_id = self.config.worker_id or f"{self.config.role}-{socket.gethostname()}-{self.grpc_port}"
        self.metrics = WorkerMetrics(self.worker_id)
        self.metrics_server = serve_metrics(self.metrics.registry, self.config.host, self.config.metrics_port)
        self.redis = connect(self.config.redis_url)
        self.registry = Registry(self.redis, self.config.namespace, self.config.heartbeat_ttl_s)
        self.publisher = IndexPublisher(self)
        self.heartbeat = HeartbeatTask(self.registry, self._info(), lambda: self.load,
                                       interval_s=self.config.heartbeat_interval_s,
                                       on_reregistered=self.publisher.republish_all)
        self.heartbeat.start()
        self._tasks = [asyncio.create_task(self._housekeeping(), name="housekeeping")]
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
        await self.kv_server.stop()
        self.async_engine.stop()
        await self.redis.aclose()

    async def _start_grpc(self) -> str:
        self.grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)],
                                           interceptors=[MalformedRequestInterceptor()])
        pb_grpc.add_WorkerServicer_to_server(self.servicer(), self.grpc_server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.grpc_server)
        names = (pb.DESCRIPTOR.services_by_name["Worker"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.grpc_server)
        self.grpc_port = self.grpc_server.add_insecure_port(f"{self.config.host}:{self.config.grpc_port}")
        await self.grpc_server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        return f"{self.config.host}:{self.grpc_port}"

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
        self.lease_of_request[request_id] = self.leases.create(block_ids, now=time.monotonic())

    def release_lease(self, lease_id: str) -> bool:
        lease = self.leases.release(lease_id)
        if lease is not None:
            self._free(lease)
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


def _sample(engine: Engine) -> tuple[SchedulerStats, WorkerLoad]:
    stats = engine.stats()
    return stats, _load(engine, stats)


def _load(engine: Engine, stats: SchedulerStats) -> WorkerLoad:
    queued = sum(r.num_tokens - r.num_computed_tokens for r in engine.scheduler.waiting)
    queued += sum(r.num_tokens - r.num_computed_tokens - 1 for r in engine.scheduler.running)
    return WorkerLoad(running=stats.num_running, waiting=stats.num_waiting, free_blocks=stats.num_free_blocks,
                      queued_prefill_tokens=max(queued, 0))


def _layout(engine: Engine) -> KVLayout:
    config = engine.model_config
    return KVLayout(model_fingerprint=engine.fingerprint, dtype=config.dtype, block_size=engine.cache_config.block_size,
                    num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
