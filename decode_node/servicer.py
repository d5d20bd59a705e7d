"""The decode role: ``Decode`` adopts a prompt's KV pulled from a prefill worker (or prefills
locally), then streams tokens from the continuous batch."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.core.outputs import RequestDelta
from kv_transfer.errors import KVTransferError
from kv_transfer.transport import pull
from prefill_node.convert import FINISH_TO_PB, layout_from_pb, logprobs_to_pb, sampling_from_pb
from prefill_node.servicer import _STATUS, WorkerServicer, abort_with
from proto import baton_pb2 as pb

logger = logging.getLogger(__name__)


class DecodeServicer(WorkerServicer):
    async def Decode(self, request: pb.DecodeRequest, context):
        try:
            async for response in self._decode(request):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            code = next((code for kind, code in _STATUS if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)
            self.node.metrics.request_error(code.name)
            await abort_with(context, exc)

    async def _decode(self, request: pb.DecodeRequest):
        node, rid = self.node, request.request_id
        params = sampling_from_pb(request.sampling)
        tokens = list(request.token_ids)
        prompt_len = request.prompt_len or len(tokens) - request.num_output_tokens_so_far
        prompt, outputs = tokens[:prompt_len], tokens[prompt_len:]
        kwargs = dict(priority=request.priority, cache_salt=request.cache_salt)
        timings = pb.Timings(decode_worker=node.worker_id)
        start = lambda e: e.add_request(rid, prompt, params, output_token_ids=outputs, **kwargs)  # noqa: E731
        if request.HasField("handle"):
            start = await self._import_kv(request, prompt, outputs, params, kwargs, timings) or start
        started = time.perf_counter()
        first = True
        async for delta in node.async_engine.stream(rid, start):
            yield _response(delta, timings if first else None, started)
            first = False

    async def _import_kv(self, request, prompt, outputs, params, kwargs, timings):
        """Reserve blocks, pull the missing ones; returns how to start the request (None: locally)."""
        node, rid, handle = self.node, request.request_id, request.handle
        reserved = await node.async_engine.call(
            lambda e: e.add_remote_request(rid, prompt, outputs, params, **kwargs))
        if reserved is None:
            timings.route_reason = "no free blocks for the pulled KV; prefilled locally"
            return None
        _, num_hit, dst_blocks = reserved
        src = list(handle.block_ids[num_hit:])
        dst = dst_blocks[num_hit : num_hit + len(src)]
        try:
            stats = await pull(handle.data_plane_uri, layout_from_pb(handle.layout), handle.lease_id, src,
                               node.kv_buffer, dst)
        except (KVTransferError, OSError, asyncio.TimeoutError) as exc:
            logger.warning("request_id=%s worker_id=%s KV pull failed (%s); recomputing locally", rid,
                           node.worker_id, exc)
            timings.route_reason = f"KV pull failed ({exc}); prefilled locally"
            return lambda e: e.fallback_remote(rid)
        except BaseException:
            node.async_engine.abort(rid)  # cancelled mid-pull: free the reservation
            raise
        timings.transfer_bytes, timings.transfer_ms = stats.num_bytes, stats.seconds * 1e3
        node.metrics.kv_transfer(stats.num_bytes, stats.seconds)
        timings.transfer_gbps, timings.transfer_blocks = stats.gbps, stats.num_blocks
        timings.transport = handle.data_plane_uri.split(":", 1)[0]
        return lambda e: e.activate_remote(rid)


def _response(delta: RequestDelta, timings: pb.Timings | None, started: float) -> pb.DecodeResponse:
    response = pb.DecodeResponse(token_ids=delta.new_token_ids, finish_reason=FINISH_TO_PB[delta.finish_reason],
                                 logprobs=logprobs_to_pb(delta.new_logprobs),
                                 num_cached_tokens=delta.num_cached_tokens)
    if timings is not None:
        response.timings.CopyFrom(timings)
    return response
