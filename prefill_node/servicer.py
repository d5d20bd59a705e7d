"""The prefill role's ``baton.v1.Worker`` calls: ``Prefill`` computes a prompt, samples its first token and hands
the prompt's blocks out under a transfer lease; ``PrefillStream`` hands the lease out before the compute ends
(layer-wise). The rest of the service is the shell's (``worker.servicer``).

``Timings.queue_ms`` is the engine's wait before the request's first scheduled step; ``prefill_ms`` is
the whole call (queue + compute). With tracing on (``proto.tracing``), a prefill leaves the spans
``prefill`` > ``prefill.queue`` + ``prefill.compute`` with exactly those durations, under the router's span.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import grpc

from engine.core.request import FinishReason
from engine.errors import CapacityExceeded
from proto import baton_pb2 as pb
from proto import tracing
from worker.convert import FINISH_TO_PB, logprobs_to_pb, sampling_from_pb
from worker.servicer import WorkerServicer, abort_with
from worker.store_tier import store_hint


class PrefillServicer(WorkerServicer):
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
        fetched = await node.admit_from_store(rid, list(request.token_ids), [], first_params, hold_blocks=True,
                                              priority=request.priority, cache_salt=request.cache_salt,
                                              store_blocks=store_hint(request))
        if fetched is not None:
            add = fetched  # part of the prefix came from the store tier: the request starts with it cached
        deltas = [d async for d in node.async_engine.stream(rid, add)]
        prefill_ms, ended_unix_ms = (time.perf_counter() - started) * 1e3, time.time() * 1e3
        last = deltas[-1]
        if last.finish_reason is FinishReason.ABORT:
            raise CapacityExceeded(f"prefill of {rid} was aborted")
        # None: the lease ended already, read and released by the decode worker before the step that wrote it
        # returned (layer-wise), or expired; the response then carries no handle
        lease = node.leases.take(rid)
        finish = _real_finish(last.finish_reason, params, len(request.token_ids), node.engine.max_model_len)
        response = pb.PrefillResponse(
            first_token=last.new_token_ids[0], finish_reason=FINISH_TO_PB[finish],
            num_cached_tokens=last.num_cached_tokens,
            timings=pb.Timings(prefill_ms=prefill_ms, prefill_worker=node.worker_id,
                               prefill_end_unix_ms=ended_unix_ms),
        )
        if last.queue_s is not None:
            response.timings.queue_ms = last.queue_s * 1e3
        if last.new_logprobs:
            response.logprobs.CopyFrom(logprobs_to_pb(last.new_logprobs)[0])
        if lease is not None and finish is not None:
            node.leases.release(lease.lease_id)  # nothing left to decode
        elif lease is not None:
            response.handle.CopyFrom(self.handle(lease, len(request.token_ids)))
        return response

    async def PrefillStream(self, request: pb.PrefillRequest, context):
        """``Prefill`` whose first message is the handle (``kv_pending``) once the step computing the prompt's
        last chunk starts: a decode worker pulling it gets each layer as soon as it is written. A worker
        serving no streaming transport answers with the one final message, as ``Prefill``."""
        node, rid = self.node, request.request_id
        if not node.streaming_kv_uri:
            yield await self.Prefill(request, context)
            return
        admitted = node.leases.wait_admitted(rid)
        node.layerwise.watch(rid)
        prefill = asyncio.ensure_future(self.Prefill(request, context))
        try:
            await asyncio.wait((admitted, prefill), return_when=asyncio.FIRST_COMPLETED)
            # admitted is always set before the prefill's last delta arrives (both reach this loop in the
            # engine thread's order), so it is done here unless the prefill failed before being scheduled
            failed = prefill.done() and (prefill.cancelled() or prefill.exception() is not None)
            if admitted.done() and not failed:
                lease = admitted.result()
                yield pb.PrefillResponse(kv_pending=True, handle=self.handle(lease, len(request.token_ids),
                                                                             node.streaming_kv_uri))
            yield await prefill
        finally:
            node.layerwise.forget(rid)
            node.leases.forget_waiter(rid)
            prefill.cancel()


def prefill_spans(tracer: Any, parent: Any, started_s: float, timings: pb.Timings, **ids: str) -> None:
    """``prefill`` (``prefill_ms`` from ``started_s``) split into ``prefill.queue`` and ``prefill.compute``."""
    start_ns = tracing.Instants(started_s).ns(started_s)
    total_ns, queue_ns = tracing.ms_to_ns(timings.prefill_ms), tracing.ms_to_ns(timings.queue_ms)
    attributes = {f"baton.{key}": value for key, value in ids.items()}
    span = tracing.start_span(tracer, "prefill", start_ns, parent, kind="server", attributes=attributes)
    tracing.record_span(tracer, "prefill.queue", start_ns, queue_ns, span)
    tracing.record_span(tracer, "prefill.compute", start_ns + queue_ns, total_ns - queue_ns, span)
    span.end(end_time=start_ns + total_ns)



def _real_finish(engine_finish, params, num_prompt_tokens: int, max_model_len: int) -> FinishReason | None:
    """The prefill engine always stops after one token; did the request itself end there?"""
    if engine_finish is FinishReason.STOP:
        return FinishReason.STOP  # an EOS / stop token (min_tokens already honoured)
    if params.max_tokens == 1 or num_prompt_tokens + 1 >= max_model_len:
        return FinishReason.LENGTH
    return None
