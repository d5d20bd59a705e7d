"""The seam between the worker shell and the engine it hosts (``baton prefill|decode|up --engine baton|vllm``).

The shell (gRPC server, registration and heartbeat, index publisher, drain, metrics, ``Abort`` / ``Stats`` /
``ReleaseLease``) reaches its engine only through ``WorkerEngine``: load and scheduler figures, aborting a request,
the block events that feed the KV index, and what it holds when the index must be rebuilt. What a role computes
(``Prefill``, ``Decode``) is each engine's own servicer: Baton's in ``prefill_node`` / ``decode_node`` (its blocks
move over Baton's data plane under Baton's leases), vLLM's in ``worker.vllm`` (its blocks move with vLLM's KV
connector, whose parameters ride ``KVHandle.engine_params``). Both serve the same ``baton.v1.Worker`` service, so
the router, admin CLI, drain, metrics and deployment never ask which engine a worker runs.

``BatonEngine`` is Baton's own engine on its engine thread (``engine.async_engine``); ``worker.vllm.engine``
is vLLM's async engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from engine.core.block_pool import TIER_HOST, TIER_POOL, BlockEvent
from engine.core.outputs import SchedulerStats
from kv_transfer.hashing import BlockHash
from kv_transfer.workers import WorkerLoad

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.engine import Engine

ENGINE_NAMES = ("baton", "vllm")  # --engine: Baton's own (the default and the reference) or vLLM's
Holdings = dict[str, list[BlockHash]]  # index tier -> hashes the engine can serve now


class WorkerEngine(Protocol):
    """What the worker shell needs of an engine. Event-loop side; implementations hop to their engine."""

    name: str  # one of ENGINE_NAMES

    async def sample(self) -> tuple[SchedulerStats, WorkerLoad]:
        """The scheduler's figures (metrics, ``Stats``) and the load the heartbeat reports to routers."""
        ...

    async def stats(self) -> SchedulerStats: ...

    async def abort(self, request_id: str) -> bool:
        """End ``request_id`` now (its open stream ends with an ABORT delta); whether it was live."""
        ...

    async def take_block_events(self) -> list[BlockEvent]:
        """Blocks that entered or left a tier since the last call, in order (Baton's own hashes)."""
        ...

    async def holdings(self) -> Holdings:
        """Everything the engine holds now, per tier; unread events are dropped (the holdings supersede them)."""
        ...


class BatonEngine:
    """Baton's engine, stepping on its own thread; every call hops there between steps."""

    name = "baton"

    def __init__(self, async_engine: AsyncEngine, load_of: Callable[[Engine, SchedulerStats], WorkerLoad]) -> None:
        self.async_engine, self._load_of = async_engine, load_of

    async def sample(self) -> tuple[SchedulerStats, WorkerLoad]:
        def sample(engine: Engine) -> tuple[SchedulerStats, WorkerLoad]:
            stats = engine.stats()
            return stats, self._load_of(engine, stats)

        return await self.async_engine.call(sample)

    async def stats(self) -> SchedulerStats:
        return await self.async_engine.call(lambda e: e.stats())

    async def abort(self, request_id: str) -> bool:
        return await self.async_engine.abort_found(request_id)

    async def take_block_events(self) -> list[BlockEvent]:
        return await self.async_engine.call(lambda e: e.take_block_events())

    async def holdings(self) -> Holdings:
        def holdings(engine: Engine) -> Holdings:
            engine.take_block_events()
            return {TIER_POOL: engine.kv_cache_manager.pool.cached_hashes(), TIER_HOST: engine.host_tier_hashes()}

        return await self.async_engine.call(holdings)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Hand leased blocks back to the engine (a lease ended)."""
        blocks = list(block_ids)
        self.async_engine.submit(lambda e: e.release_blocks(blocks))
