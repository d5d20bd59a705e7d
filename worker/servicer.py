"""What both roles serve of ``baton.v1.Worker``: leasing a cached prefix (``LeasePrefix``), ending a lease
(``ReleaseLease``) or a request (``Abort``), and ``Stats``; and the one mapping of typed errors to gRPC status.
The roles add theirs: ``prefill_node.servicer`` (``Prefill``, ``PrefillStream``), ``decode_node.servicer``
(``Decode``, ``FirstToken``); what a role does not serve answers UNIMPLEMENTED, naming the role.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import grpc

from engine.async_engine import EngineDead
from engine.errors import CapacityExceeded, InvalidRequest
from kv_transfer.errors import KVTransferError
from kv_transfer.leases import Lease
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from proto import tracing
from worker.convert import layout_to_pb

if TYPE_CHECKING:
    from worker.node import WorkerNode
    from worker.shell import WorkerShell

logger = logging.getLogger(__name__)

STATUS_OF_ERROR = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDead, grpc.StatusCode.UNAVAILABLE),
    (KVTransferError, grpc.StatusCode.UNAVAILABLE),
)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status a typed error maps to (STYLE.md rule 4); anything else is a bug: INTERNAL."""
    return next((code for kind, code in STATUS_OF_ERROR if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.exception("unexpected error", exc_info=exc)
        await context.abort(code, f"internal error: {exc!r}")
    await context.abort(code, str(exc))


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, node: WorkerNode, tracer: Any | None = None) -> None:
        self.node = node
        self.tracer = tracer if tracer is not None else tracing.current_tracer()  # None: no spans

    def handle(self, lease: Lease, num_tokens: int, uri: str | None = None) -> pb.KVHandle:
        """What a peer needs to pull ``lease``'s blocks: where, which, their layout, until when."""
        node = self.node
        return pb.KVHandle(
            worker_id=node.worker_id, data_plane_uri=uri or node.kv_uri, lease_id=lease.lease_id,
            block_ids=node.leases.read_ids(lease), num_tokens=num_tokens, layout=layout_to_pb(node.layout),
            lease_expires_unix_ms=node.leases.expiry_unix_ms(lease), grpc_address=node.grpc_address,
            first_block=lease.first_block,
        )

    async def LeasePrefix(self, request: pb.LeasePrefixRequest, context) -> pb.LeasePrefixResponse:
        """Pin this worker's longest cached prefix of the prompt under a transfer lease (released by
        ``ReleaseLease`` or its expiry) for another worker to pull; no handle when none of ``min_tokens``."""
        try:
            held = await self._hold_prefix(list(request.token_ids), request.cache_salt, request.min_tokens)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await abort_with(context, exc)
        if held is None:
            return pb.LeasePrefixResponse()
        lease = self.node.leases.pin(held.block_ids)
        handle = self.handle(lease, held.num_tokens)
        handle.block_hashes.extend(held.block_hashes)
        return pb.LeasePrefixResponse(handle=handle)

    async def _hold_prefix(self, token_ids: list[int], cache_salt: str, min_tokens: int):
        """The engine's pinned prefix; if this call is cancelled meanwhile, its blocks are freed once pinned."""
        node = self.node
        job = asyncio.ensure_future(
            node.async_engine.call(lambda e: e.hold_cached_prefix(token_ids, cache_salt, min_tokens)))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(lambda done: _release_orphan(node, done))
            raise

    async def Prefill(self, request, context):
        await self._not_served(context)

    async def PrefillStream(self, request, context):
        await self._not_served(context)
        yield pb.PrefillResponse()  # never reached: makes this a stream handler

    async def Decode(self, request, context):
        await self._not_served(context)
        yield pb.DecodeResponse()  # never reached: makes this a stream handler

    async def FirstToken(self, request, context):
        await self._not_served(context)

    async def _not_served(self, context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.node.worker_id} is a {self.node.config.role} worker")

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        aborted = await self.node.seam.abort(request.request_id)  # ends its stream, if one is open
        released = self.node.leases.release_request(request.request_id)
        return pb.AbortResponse(found=aborted or released)

    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context) -> pb.ReleaseLeaseResponse:
        return pb.ReleaseLeaseResponse(found=self.node.leases.release(request.lease_id))

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = await self.node.seam.stats()
        load, staging = self.node.load, self.node.staging
        return pb.StatsResponse(
            worker_id=self.node.worker_id, role=self.node.config.role, num_running=stats.num_running,
            num_waiting=stats.num_waiting, num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks, num_open_leases=len(self.node.leases),
            queued_prefill_tokens=load.queued_prefill_tokens, kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions, kv_transfer_bytes=self.node.metrics.transfer_bytes_total,
            kv_transfer_seconds=self.node.metrics.transfer_seconds_total, num_aborted_requests=stats.num_aborted,
            kv_pull_fallbacks=self.node.metrics.pull_fallbacks_total,
            num_staging_blocks=staging.num_blocks if staging is not None else 0,
            num_free_staging_blocks=staging.num_free if staging is not None else 0,
        )


def _release_orphan(node: WorkerNode, job: asyncio.Future) -> None:
    """A prefix pinned for a ``LeasePrefix`` call that was cancelled before it could lease it."""
    if not job.cancelled() and job.exception() is None and job.result() is not None:
        node.async_engine.submit(lambda e: e.release_blocks(list(job.result().block_ids)))
