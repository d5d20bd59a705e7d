"""``baton.v1.Worker`` servicer: proto in -> engine (through AsyncEngine) -> proto out.

``Timings.queue_ms`` is the engine's wait before the request's first scheduled step; ``prefill_ms`` is
the whole call (queue + compute). With tracing on (``proto.tracing``), a prefill leaves the spans
``prefill`` > ``prefill.queue`` + ``prefill.compute`` with exactly those durations, under the router's span.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import grpc

from engine.async_engine import EngineDead
from engine.core.request import FinishReason
from engine.errors import CapacityExceeded, InvalidRequest
from kv_transfer.errors import KVTransferError
from prefill_node.convert import FINISH_TO_PB, layout_to_pb, logprobs_to_pb, sampling_from_pb
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from proto import tracing

if TYPE_CHECKING:
    from prefill_node.node import WorkerNode

logger = logging.getLogger(__name__)

_STATUS = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDead, grpc.StatusCode.UNAVAILABLE),
    (KVTransferError, grpc.StatusCode.UNAVAILABLE),
)


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Map a typed error to its status (STYLE.md rule 4); anything else is a bug: INTERNAL."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            await context.abort(code, str(exc))
    logger.exception("unexpected error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, node: WorkerNode, tracer: Any | None = None) -> None:
        self.node = node
        self.tracer = tracer if tracer is not None else tracing.current_tracer()  # None: no spans

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        try:
            started = time.perf_counter()
            response = await self._prefill(request)
            if self.tracer is not None:
                prefill_spans(self.tracer, tracing.extract(context.invocation_metadata()), started,
                              response.timings, request_id=request.request_id, worker_id=self.node.worker_id)
            return response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await abort_with(context, exc)

    async def _prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        node, rid = self.node, request.request_id
        params = sampling_from_pb(request.sampling)
        first_params = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=())
        started = time.perf_counter()
        add = lambda e: e.add_request(  # noqa: E731
            rid, list(request.token_ids), first_params, priority=request.priority,
            cache_salt=request.cache_salt, hold_blocks=True)
        deltas = [d async for d in node.async_engine.stream(rid, add)]
        prefill_ms = (time.perf_counter() - started) * 1e3
        last = deltas[-1]
        if last.finish_reason is FinishReason.ABORT:
            raise CapacityExceeded(f"prefill of {rid} was aborted")
        lease = node.lease_of_request.pop(rid)
        finish = _real_finish(last.finish_reason, params, len(request.token_ids), node.engine.max_model_len)
        response = pb.PrefillResponse(
            first_token=last.new_token_ids[0], finish_reason=FINISH_TO_PB[finish],
            num_cached_tokens=last.num_cached_tokens,
            timings=pb.Timings(prefill_ms=prefill_ms, prefill_worker=node.worker_id),
        )
        if last.queue_s is not None:
            response.timings.queue_ms = last.queue_s * 1e3
        if last.new_logprobs:
            response.logprobs.CopyFrom(logprobs_to_pb(last.new_logprobs)[0])
        if finish is not None:
            node.release_lease(lease.lease_id)  # nothing left to decode
        else:
            response.handle.CopyFrom(self._handle(lease, len(request.token_ids)))
        return response

    async def PrefillStream(self, request: pb.PrefillRequest, context):
        """``Prefill`` whose first message is the handle (``kv_pending``) once the step computing the prompt's
        last chunk starts: a decode worker pulling it gets each layer as soon as it is written. A worker
        serving no streaming transport answers with the one final message, as ``Prefill``."""
        node, rid = self.node, request.request_id
        if not node.streaming_kv_uri:
            yield await self.Prefill(request, context)
            return
        admitted = node.admitted_waiters[rid] = asyncio.get_running_loop().create_future()
        node.layerwise.watch(rid)
        prefill = asyncio.ensure_future(self.Prefill(request, context))
        try:
            await asyncio.wait((admitted, prefill), return_when=asyncio.FIRST_COMPLETED)
            # admitted is always set before the prefill's last delta arrives (both reach this loop in the
            # engine thread's order), so it is done here unless the prefill failed before being scheduled
            failed = prefill.done() and (prefill.cancelled() or prefill.exception() is not None)
            if admitted.done() and not failed:
                lease = admitted.result()
                yield pb.PrefillResponse(kv_pending=True, handle=self._handle(lease, len(request.token_ids),
                                                                              node.streaming_kv_uri))
            yield await prefill
        finally:
            node.layerwise.forget(rid)
            node.admitted_waiters.pop(rid, None)
            prefill.cancel()

    def _handle(self, lease, num_tokens: int, uri: str | None = None) -> pb.KVHandle:
        node = self.node
        wall_expiry_ms = int((time.time() + lease.expires_at - time.monotonic()) * 1e3)
        return pb.KVHandle(
            worker_id=node.worker_id, data_plane_uri=uri or node.kv_uri, lease_id=lease.lease_id,
            block_ids=list(lease.block_ids), num_tokens=num_tokens, layout=layout_to_pb(node.layout),
            lease_expires_unix_ms=wall_expiry_ms,
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
        lease = self.node.leases.create(held.block_ids, now=time.monotonic())
        handle = self._handle(lease, held.num_tokens)
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

    async def Decode(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.node.worker_id} is a prefill worker")

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        delta = await self.node.async_engine.call(lambda e: e.abort(request.request_id))
        lease = self.node.lease_of_request.pop(request.request_id, None)
        if lease is not None:
            self.node.release_lease(lease.lease_id)
        return pb.AbortResponse(found=delta is not None or lease is not None)

    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context) -> pb.ReleaseLeaseResponse:
        return pb.ReleaseLeaseResponse(found=self.node.release_lease(request.lease_id))

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = await self.node.async_engine.call(lambda e: e.stats())
        load = self.node.load
        return pb.StatsResponse(
            worker_id=self.node.worker_id, role=self.node.config.role, num_running=stats.num_running,
            num_waiting=stats.num_waiting, num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks, num_open_leases=len(self.node.leases),
            queued_prefill_tokens=load.queued_prefill_tokens, kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions, kv_transfer_bytes=self.node.metrics.transfer_bytes_total,
            kv_transfer_seconds=self.node.metrics.transfer_seconds_total,
        )


def prefill_spans(tracer: Any, parent: Any, started_s: float, timings: pb.Timings, **ids: str) -> None:
    """``prefill`` (``prefill_ms`` from ``started_s``) split into ``prefill.queue`` and ``prefill.compute``."""
    start_ns = tracing.Instants(started_s).ns(started_s)
    total_ns, queue_ns = tracing.ms_to_ns(timings.prefill_ms), tracing.ms_to_ns(timings.queue_ms)
    attributes = {f"baton.{key}": value for key, value in ids.items()}
    span = tracing.start_span(tracer, "prefill", start_ns, parent, kind="server", attributes=attributes)
    tracing.record_span(tracer, "prefill.queue", start_ns, queue_ns, span)
    tracing.record_span(tracer, "prefill.compute", start_ns + queue_ns, total_ns - queue_ns, span)
    span.end(end_time=start_ns + total_ns)


def _release_orphan(node: WorkerNode, job: asyncio.Future) -> None:
    """A prefix pinned for a ``LeasePrefix`` call that was cancelled before it could lease it."""
    if not job.cancelled() and job.exception() is None and job.result() is not None:
        node.async_engine.submit(lambda e: e.release_blocks(list(job.result().block_ids)))


def _real_finish(engine_finish, params, num_prompt_tokens: int, max_model_len: int) -> FinishReason | None:
    """The prefill engine always stops after one token; did the request itself end there?"""
    if engine_finish is FinishReason.STOP:
        return FinishReason.STOP  # an EOS / stop token (min_tokens already honoured)
    if params.max_tokens == 1 or num_prompt_tokens + 1 >= max_model_len:
        return FinishReason.LENGTH
    return None
