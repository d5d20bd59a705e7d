"""A decode worker: the worker shell that imports prompts' KV from prefill workers (or prefills them itself)
and decodes them in its continuous batch (``decode_node/servicer.py``)."""

from __future__ import annotations

import asyncio
import logging

from decode_node.first_tokens import FirstTokenMailbox
from decode_node.servicer import DecodeServicer
from kv_transfer.errors import PeerUnreachable
from kv_transfer.pairs import UNREACHABLE_RETRY_S, Fallthrough, PairTransports
from worker.config import WorkerConfig
from worker.holders import LeaseReleaser
from worker.node import WorkerNode

logger = logging.getLogger(__name__)


class DecodeNode(WorkerNode):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.first_tokens = FirstTokenMailbox()  # layer-wise Decodes wait here for P's first token
        self.releaser = LeaseReleaser(config.tls)  # ReleaseLease on the holders of leases this worker read

    async def start(self) -> str:
        address = await super().start()
        # the transport of each pair (this worker pulling from a peer), decided at the pair's first handshake
        self.kv_pairs = PairTransports(self.kv_kinds, self._fell_through, on_unreachable=self._unreachable)
        return address

    def servicer(self) -> DecodeServicer:
        return DecodeServicer(self)

    def _fell_through(self, event: Fallthrough) -> None:
        """A pair's preferred transport cannot work (once per pair): logged, and counted by reason."""
        then = f"the pair pulls over {event.next_kind} instead" if event.next_kind else "no transport is left for it"
        logger.warning("worker_id=%s KV transport %s cannot work with %s (%s): %s; %s", self.worker_id, event.kind,
                       event.peer, event.reason, event.detail, then)
        self.metrics.kv_transport_fallthrough(event.kind, event.reason)

    def _unreachable(self, peer: str, exc: PeerUnreachable) -> None:
        """A peer's KV address cannot be reached (once per spell; its pulls fail fast meanwhile)."""
        logger.warning("worker_id=%s cannot reach the KV data plane of %s: %s; its pulls fail at once for %g s "
                       "(each request prefills here)", self.worker_id, peer, exc, UNREACHABLE_RETRY_S)

    def release_remote_lease(self, address: str, lease_id: str) -> asyncio.Task:
        """Tell the worker at ``address`` that this one is done reading lease ``lease_id`` (it frees the blocks).
        The task's result: whether the holder answered (found or not: either way the lease is over)."""
        return self.releaser.release(address, lease_id)

    async def stop(self, grace_s: float = 5.0) -> None:
        await super().stop(grace_s)
        await self.releaser.close()
