"""Baton's engine in the worker shell (``worker.shell``): the engine thread, Baton's KV data-plane servers and
transfer leases, the store tier.

A role is a subclass (``prefill_node.node.PrefillNode``, ``decode_node.node.DecodeNode``) that names its
servicer and, where it needs them, the engine's hooks (``on_held``, ``step_hooks``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from engine.async_engine import AsyncEngine, StepHooks
from engine.core.outputs import RequestDelta, SchedulerStats
from engine.engine import Engine
from engine.kv_quant import SCALE_BYTES
from kv_transfer.layout import KVLayout
from kv_transfer.staging import KVRegion, StagingPool
from kv_transfer.tp_plane import rank_uris, tag_uri
from kv_transfer.workers import WorkerLoad
from kv_transfer.transport import (
    STREAMING_KINDS, KVClient, TransferStats, connect as kv_connect, parse_kinds, uri_kind,
)
from worker.config import WorkerConfig, transport_config
from worker.engine_seam import BatonEngine
from worker.kv_plane import KVPlane
from worker.leases import WorkerLeases
from worker.servicer import WorkerServicer
from worker.shell import WorkerShell
from worker.store_tier import StoreTier

logger = logging.getLogger(__name__)


class WorkerNode(WorkerShell):
    """Baton's engine in the shell: the engine on its own thread, Baton's KV data plane and leases."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.leases = WorkerLeases(config.lease_ttl_s, self._free)

    # ---- lifecycle -----------------------------------------------------------------------
    async def start_engine(self) -> None:
        loop = self.loop
        self.engine: Engine = await asyncio.to_thread(Engine, self.config.engine)
        if self.config.calibrate_tokens > 0:  # before the engine loop runs: the thread has the engine to itself
            await asyncio.to_thread(self.engine.calibrate, self.config.calibrate_tokens)
        if self.config.fault_step_delay_s > 0:
            _slow_steps(self.engine, self.config.fault_step_delay_s)
        if self.config.fault_layer_delay_s > 0:
            _slow_layers(self.engine, self.config.fault_layer_delay_s)
        self.layout = _layout(self.engine)
        self.fingerprint, self.total_blocks = self.engine.fingerprint, self.engine.cache_config.num_blocks
        self.async_engine = AsyncEngine(self.engine, on_held=self.on_held, step_hooks=self.step_hooks(),
                                        on_dead=lambda exc: loop.call_soon_threadsafe(self.failed.set))
        self.async_engine.start()
        self.seam = BatonEngine(self.async_engine, worker_load)
        # Every transport of --kv-transport is served (kv_uri lists their URIs, space-separated) and tried
        # in that order when pulling: the pair's transport is the puller's first one the server offers.
        self.kv_kinds = parse_kinds(self.config.kv_transport, str(self.engine.device))
        if {"ucx", "nixl"} <= set(self.kv_kinds):
            logger.warning("--kv-transport serves both ucx and nixl: each loads its own UCX library, and two in "
                           "one process have crashed it when a peer died (docs/operations.md); serve one of them")
        # each kind reads the cache in place (a host cache; a device cache GPU-direct for nixl/ucx/nccl) or
        # through pinned host staging (a device cache for tcp/cma; every kind with --kv-staging always)
        region, *rank_regions = _regions(self.engine, self.layout)
        self.kv_plane = KVPlane(region, self.kv_kinds, self.config.kv_staging, self.leases,
                                self.config.kv_staging_blocks or default_staging_blocks(self.engine),
                                rank_regions=rank_regions)
        self.transport_config = transport_config(self.config)
        self._kv_clients: dict[str, KVClient] = {}
        served = await self._serve_kv()
        if self.config.fault_nixl_lose_notifications:
            _lose_nixl_notifications(self.kv_servers)
        self.kv_uri = self.config.kv_advertise_uri or " ".join(served)
        # what an early (kv_pending) handle offers: the URIs whose server streams layers
        self.streaming_kv_uri = " ".join(u for u in self.kv_uri.split() if uri_kind(u) in STREAMING_KINDS)

    async def engine_registered(self) -> None:
        self.store_tier = self._start_store_tier()

    def _start_store_tier(self) -> StoreTier | None:
        """The shared store tier (``--kv-store``), connecting in the background: until it is connected, requests
        compute as without it."""
        if self.config.kv_store is None:
            return None
        if self.engine.store is None:
            logger.warning("--kv-store ignored: the store tier needs prefix caching (blocks are named by their hashes)")
            return None
        tier = StoreTier(self, self.config.kv_store)
        tier.start()
        return tier

    async def _serve_kv(self) -> list[str]:
        """Start a server per kind (per kind and tensor-parallel rank: each rank's URI tagged ``?tp_rank=r``);
        their URIs, in order of preference."""
        tp_size = self.kv_plane.tp_size
        self.kv_servers = [self.kv_plane.server(kind, self.transport_config, rank)
                           for kind in self.kv_kinds for rank in range(tp_size)]
        served = [await server.start(self.config.host, self.config.kv_port if i == 0 else 0,
                                     advertise_host=self.advertise_host) for i, server in enumerate(self.kv_servers)]
        return served if tp_size == 1 else [tag_uri(uri, i % tp_size) for i, uri in enumerate(served)]

    async def stop_engine(self) -> None:
        for server in self.kv_servers:
            await server.stop()
        for client in self._kv_clients.values():
            if callable(close := getattr(client, "close", None)):
                close()  # pooled connections (nccl channels)
        if self.store_tier is not None:
            await self.store_tier.stop()
        self.async_engine.stop()
        self.engine.close()  # its tensor-parallel ranks, if any

    async def pull_kv(self, uri: str, offered: str, layout: KVLayout, lease_id: str, src: Sequence[int],
                      dst: Sequence[int]) -> TransferStats:
        """Pull a peer's leased blocks ``src`` into this worker's cache blocks ``dst`` over ``uri``'s kind (the pair's
        choice among the URIs the peer ``offered``, space-separated; every rank's of that kind for a
        tensor-parallel peer): in place, or through host staging when this worker stages that kind."""
        kind, client = uri_kind(uri), self.kv_client(uri_kind(uri))
        if layout.tp_size == 1 and self.kv_plane.tp_size == 1:
            return await self.kv_plane.pull(client, kind, uri, layout, lease_id, src, dst)
        uris = rank_uris(offered, kind, layout.tp_size)
        return await self.kv_plane.pull_ranks(client, uris, layout, lease_id, src, dst)

    async def admit_from_store(self, rid: str, prompt: list[int], outputs: list[int], params, **kwargs):
        """(how to start the request, why) when the store tier fetched part of its prefix into a reservation
        (``worker.store_tier.StoreTier.admit``); None: queue it as usual."""
        if self.store_tier is None:
            return None
        return await self.store_tier.admit(rid, prompt, outputs, params, **kwargs)

    @property
    def staging(self) -> StagingPool | None:
        """The host staging pool (None: every kind reads the cache in place)."""
        return self.kv_plane.pool

    def kv_client(self, kind: str) -> KVClient:
        """This worker's client for transport ``kind``, kept across pulls (nccl reuses its channels)."""
        if kind not in self._kv_clients:
            self._kv_clients[kind] = kv_connect(f"{kind}://", self.transport_config)
        return self._kv_clients[kind]

    # ---- what a role provides ---------------------------------------------------------------
    def servicer(self) -> WorkerServicer:
        """The role's ``baton.v1.Worker`` servicer."""
        raise NotImplementedError

    def step_hooks(self) -> StepHooks | None:
        """Per-step engine hooks (layer-wise progress on a prefill worker); None: none."""
        return None

    # Engine thread: a request finished holding its blocks (``hold_blocks``: a prefill). None: the engine frees
    # them (a decode worker holds none).
    on_held: Callable[[RequestDelta], None] | None = None

    def _free(self, block_ids: Sequence[int]) -> None:
        """Hand blocks back to the engine (a lease ended)."""
        self.seam.release_blocks(block_ids)


def _slow_steps(engine: Engine, delay_s: float) -> None:
    """Fault injection (``--fault-step-delay-s``): each engine step first sleeps ``delay_s`` on the engine thread."""
    logger.warning("fault injection: every engine step is delayed by %.3f s", delay_s)
    step = engine.step

    def slow_step(*args, **kwargs):
        time.sleep(delay_s)
        return step(*args, **kwargs)

    engine.step = slow_step


def _slow_layers(engine: Engine, delay_s: float) -> None:
    """Fault injection (``--fault-layer-delay-s``): in every step, each decoder layer sleeps ``delay_s`` before
    the step's per-layer hook reports its KV written (a streamed read sees the layers come one by one)."""
    logger.warning("fault injection: every decoder layer of a step is delayed by %.3f s", delay_s)
    step = engine.step

    def slow_step(*args, on_layer=None, **kwargs):
        def slow_layer(layer: int) -> None:
            time.sleep(delay_s)
            if on_layer is not None:
                on_layer(layer)

        return step(*args, on_layer=slow_layer, **kwargs)

    engine.step = slow_step


def _lose_nixl_notifications(servers: Sequence[object]) -> None:
    """Fault injection (``--fault-nixl-lose-notifications``): a nixl:// server's agent still progresses when
    polled, but every READ notification it receives is dropped, so none of its reads ends in DONE."""
    logger.warning("fault injection: every nixl READ notification is lost")
    for server in servers:
        if getattr(server, "scheme", "") == "nixl" and (agent := getattr(server, "agent", None)) is not None:
            receive = agent.nixl.get_new_notifs
            agent.nixl.get_new_notifs = lambda: receive() and {}


def default_staging_blocks(engine: Engine) -> int:
    """Half the cache, and at least room for the longest prompt's blocks."""
    size, total = engine.cache_config.block_size, engine.kv_cache_manager.pool.num_blocks
    return min(total, max(total // 2, -(-engine.max_model_len // size) + 1))


def worker_load(engine: Engine, stats: SchedulerStats) -> WorkerLoad:
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
    """Rank 0's layout (the only rank without tensor parallelism)."""
    config, quant = engine.model_config, engine.kv_quant
    return KVLayout(model_fingerprint=engine.fingerprint, dtype=config.dtype if quant is None else quant.layout_dtype,
                    block_size=engine.cache_config.block_size, num_layers=config.num_layers,
                    num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                    scale_bytes=0 if quant is None else SCALE_BYTES, tp_size=engine.tensor_parallel_size)


def _regions(engine: Engine, layout: KVLayout) -> list[KVRegion]:
    """Every rank's cache as the data plane sees it; a tensor-parallel worker serves them all from this process,
    which sees them only in shared host memory (CPU)."""
    caches = engine.runner.kv_ranks
    if len(caches) != layout.tp_size:  # never run here (no GPU)
        raise ValueError("a tensor-parallel worker's KV data plane serves every rank's cache from shared host "
                         f"memory; on {engine.device} each rank's cache is on its own device (not built)")
    return [KVRegion(layout.for_rank(rank), cache) for rank, cache in enumerate(caches)]
