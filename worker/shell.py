"""The worker shell every engine shares: gRPC server (health, reflection), registration and heartbeat, the KV
index publisher, drain, metrics and the shell's housekeeping. It talks to its engine through ``self.seam``
(``worker.engine_seam.WorkerEngine``) only.

An engine's node subclasses it: ``worker.node.WorkerNode`` (Baton's engine, then its roles in ``prefill_node`` /
``decode_node``) and ``worker.vllm.node.VLLMNode``. The subclass starts its engine and data plane
(``start_engine``, which sets ``seam``, ``layout``, ``fingerprint``, ``total_blocks`` and ``kv_uri``), names its
servicer, and may add steps after registration (``engine_registered``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kv_transfer.layout import KVLayout
from kv_transfer.registry import HeartbeatTask, Registry, connect
from kv_transfer.workers import WorkerInfo, WorkerLoad
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from proto.malformed import MalformedRequestInterceptor
from proto.metrics_http import serve_metrics
from proto.tls import PEER_SERVER_OPTIONS, add_port, describe
from worker.addresses import advertised_host, host_port, loopback_warning
from worker.config import WorkerConfig
from worker.drain import DrainGate, InFlightCounter
from worker.engine_seam import WorkerEngine
from worker.metrics import WorkerMetrics
from worker.publisher import IndexPublisher

logger = logging.getLogger(__name__)
WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerShell:
    seam: WorkerEngine
    layout: KVLayout  # as registered: the index's block size
    fingerprint: bytes
    total_blocks: int  # in layout blocks
    kv_uri: str
    leases: Any  # the open transfer leases: len(), release(lease_id), release_request(request_id), expire()
    staging: Any = None  # host staging of the KV data plane (Baton's, when it stages)

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.load = WorkerLoad(running=0, waiting=0, free_blocks=0, queued_prefill_tokens=0)
        self._tasks: list[asyncio.Task] = []
        self.in_flight = InFlightCounter(
            frozenset(f"/{WORKER_SERVICE}/{m}" for m in ("Prefill", "PrefillStream", "Decode")))
        self.drained = asyncio.Event()  # set when drained and idle with on_drain="exit": the process may exit
        self.failed = asyncio.Event()  # set when the engine died (e.g. a tensor-parallel rank): exit non-zero
        self.metrics_server = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> str:
        self.loop = asyncio.get_running_loop()
        self.advertise_host = self.config.advertise_host or advertised_host(self.config.host, self.config.redis_url)
        if (warning := loopback_warning(self.advertise_host, self.config.redis_url)) is not None:
            logger.warning("%s", warning)
        await self.start_engine()
        self.grpc_address = await self._start_grpc()
        self.worker_id = self.config.worker_id or f"{self.config.role}-{socket.gethostname()}-{self.grpc_port}"
        self.metrics = WorkerMetrics(self.worker_id)
        self.metrics_server = serve_metrics(self.metrics.registry, self.config.host, self.config.metrics_port,
                                            self.config.tls)
        self.redis = connect(self.config.redis_url)
        self.registry = Registry(self.redis, self.config.namespace, self.config.heartbeat_ttl_s)
        self.publisher = IndexPublisher(self.seam, self.registry.index, lambda: self.worker_id)
        await self.engine_registered()
        # the first heartbeat registers the worker with this load: sampled now, not the placeholder (no free
        # blocks), which would tell every router this pool is full until the next heartbeat
        _, self.load = await self.seam.sample()
        self.heartbeat = HeartbeatTask(self.registry, self._info(), lambda: self.load,
                                       interval_s=self.config.heartbeat_interval_s,
                                       on_reregistered=self.publisher.republish_all)
        self.heartbeat.start()
        self._tasks = [asyncio.create_task(self._housekeeping(), name="housekeeping"),
                       asyncio.create_task(self._watch_drain(), name="drain")]
        logger.info("worker %s (%s, engine %s) serving gRPC on %s, KV on %s", self.worker_id, self.config.role,
                    self.seam.name, self.grpc_address, self.kv_uri)
        return self.grpc_address

    async def stop(self, grace_s: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        await self.heartbeat.stop(deregister=True)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        await self.grpc_server.stop(grace_s)
        await self.stop_engine()
        await self.redis.aclose()

    async def _start_grpc(self) -> str:
        options = [("grpc.max_receive_message_length", 64 << 20), *PEER_SERVER_OPTIONS]
        self.grpc_server = grpc.aio.server(options=options,
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
        return host_port(self.advertise_host, self.grpc_port)

    # ---- what an engine's node provides ------------------------------------------------------
    async def start_engine(self) -> None:
        """Load the engine and serve its data plane; sets ``seam``, ``layout``, ``fingerprint``, ``total_blocks``,
        ``kv_uri`` and ``leases``."""
        raise NotImplementedError

    async def engine_registered(self) -> None:
        """After the shell knows its worker id and Redis, before the first heartbeat (e.g. a store tier)."""

    async def stop_engine(self) -> None:
        raise NotImplementedError

    def servicer(self) -> pb_grpc.WorkerServicer:
        """The role's ``baton.v1.Worker`` servicer."""
        raise NotImplementedError

    def _info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id, role=self.config.role, grpc_address=self.grpc_address, kv_uri=self.kv_uri,
            model_fingerprint=self.fingerprint.hex(), layout_json=self.layout.to_json(),
            total_blocks=self.total_blocks,
        )

    def release_lease(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    async def _housekeeping(self, period_s: float = 0.25) -> None:
        """Expire leases, refresh the load figures, publish block events to the index."""
        while True:
            for lease in self.leases.expire():
                logger.info("transfer lease expired; freed %d blocks", len(lease.block_ids))
            try:
                stats, self.load = await self.seam.sample()
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
            stats = await self.seam.stats()
            busy = self.in_flight.count > 0 or len(self.leases) > 0 or stats.num_running + stats.num_waiting > 0
            if gate.update(draining=draining, busy=busy, now_s=time.monotonic()) and self.config.on_drain == "exit":
                logger.info("worker %s drained and idle for %.1f s: exiting", self.worker_id, gate.settle_s)
                self.drained.set()
                return
            await asyncio.sleep(period_s)
