"""A decode worker: the worker shell that imports prompts' KV from prefill workers (or prefills them itself)
and decodes them in its continuous batch (``decode_node/servicer.py``)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from decode_node.first_tokens import FirstTokenMailbox
from decode_node.servicer import DecodeServicer
from kv_transfer.errors import PeerUnreachable
from kv_transfer.pairs import UNREACHABLE_RETRY_S, Fallthrough, PairTransports
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from proto.tls import PEER_CHANNEL_OPTIONS, aio_channel
from worker.config import WorkerConfig
from worker.node import WorkerNode

logger = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 2.0  # a holder that does not confirm by then: its lease's TTL (or the router) frees it


class DecodeNode(WorkerNode):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.first_tokens = FirstTokenMailbox()  # layer-wise Decodes wait here for P's first token
        self._holders: dict[str, grpc.aio.Channel] = {}  # gRPC address -> channel, to release leases there
        self._releases: set[asyncio.Task] = set()

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
        task = asyncio.ensure_future(self._release(address, lease_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return task

    async def _release(self, address: str, lease_id: str) -> bool:
        channel = self._holders.get(address)
        if channel is None:
            channel = self._holders[address] = aio_channel(address, self.config.tls, PEER_CHANNEL_OPTIONS)
        try:
            await pb_grpc.WorkerStub(channel).ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease_id),
                                                          timeout=RELEASE_TIMEOUT_S)
            return True
        except grpc.aio.AioRpcError as exc:
            logger.warning("releasing a lease on %s failed (%s: %s); the router or the lease's TTL frees it",
                           address, exc.code().name, exc.details())
            return False

    async def stop(self, grace_s: float = 5.0) -> None:
        await super().stop(grace_s)
        if self._releases:
            await asyncio.wait(set(self._releases), timeout=RELEASE_TIMEOUT_S)
        for channel in self._holders.values():
            await channel.close()
