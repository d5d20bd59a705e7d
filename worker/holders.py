"""Telling a lease's holder that this worker is done with it (``Worker/ReleaseLease`` to ``KVHandle.grpc_address``):
one gRPC channel per holder, kept; each release a task the caller may await (whether the holder answered)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from proto.tls import PEER_CHANNEL_OPTIONS, TlsConfig, aio_channel

logger = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 2.0  # a holder that does not confirm by then: its lease's TTL (or the router) frees it


class LeaseReleaser:
    def __init__(self, tls: TlsConfig | None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}  # gRPC address -> channel
        self._tasks: set[asyncio.Task] = set()

    def release(self, address: str, lease_id: str, *, read: bool = False) -> asyncio.Task:
        """Tell the worker at ``address`` that lease ``lease_id`` is over (``read``: its blocks were read). The
        task's result: whether the holder answered (found or not: either way the lease is over)."""
        task = asyncio.ensure_future(self._release(address, lease_id, read))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _release(self, address: str, lease_id: str, read: bool) -> bool:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self._tls, PEER_CHANNEL_OPTIONS)
        try:
            await pb_grpc.WorkerStub(channel).ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease_id, read=read),
                                                          timeout=RELEASE_TIMEOUT_S)
            return True
        except grpc.aio.AioRpcError as exc:
            logger.warning("releasing a lease on %s failed (%s: %s); the router or the lease's TTL frees it",
                           address, exc.code().name, exc.details())
            return False

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=RELEASE_TIMEOUT_S)
        for channel in self._channels.values():
            await channel.close()
