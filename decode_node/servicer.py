"""The decode role: ``Decode`` adopts a prompt's KV pulled from a prefill worker (or prefills
locally), then streams tokens from the continuous batch. With a ``prefix_handle`` (cross-worker prefix
reuse) it pulls only the leased cached prefix from the worker holding it and prefills the rest itself.

The handoff is direct: the moment a pull ends (done or failed), or D knows it will not pull, D releases the
handle's lease on its holder (``Worker/ReleaseLease`` to ``KVHandle.grpc_address``), so P unpins the blocks
then rather than after D's first decode step; the first response says so (``Timings.lease_released``) and
the router, which only learns of it, releases the lease itself only when D could not.

The first response carries this worker's ``Timings``: the pull (``transfer_*``), and for a local prefill
``queue_ms``, the engine's wait before the first scheduled step. With tracing on (``proto.tracing``) the
call leaves the spans ``decode`` > ``kv.transfer``, ``prefill.queue`` (local only), ``decode.first_token``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from decode_node.first_tokens import RECOMPUTE
from decode_node.handles import handle_problem, prefix_problem, prefix_reason
from engine.core.outputs import RequestDelta
from engine.errors import InvalidRequest
from kv_transfer.errors import KVTransferError, PeerUnreachable
from kv_transfer.transport import TransferStats, uri_kind
from proto import baton_pb2 as pb
from proto import tracing
from worker.convert import FINISH_TO_PB, layout_from_pb, logprobs_to_pb, sampling_from_pb
from worker.servicer import WorkerServicer, abort_with, status_of
from worker.store_tier import store_hint

logger = logging.getLogger(__name__)
MAX_FIRST_TOKEN_WAIT_S = 600.0  # a layer-wise Decode without a deadline waits at most this for P's first token
RELEASE_WAIT_S = 0.25  # the first response waits at most this for the holder to confirm the release (it runs
# concurrently with the first step, so it is done by then unless the holder is slow; then the router releases too)


class DecodeServicer(WorkerServicer):
    async def Decode(self, request: pb.DecodeRequest, context):
        marks = _Marks(time.perf_counter())
        try:
            async for response in self._decode(request, marks, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            code = status_of(exc)
            self.node.metrics.request_error(code.name)
            marks.error = code.name
            await abort_with(context, exc)
        finally:
            if self.tracer is not None:
                decode_spans(self.tracer, tracing.extract(context.invocation_metadata()), marks,
                             request_id=request.request_id, worker_id=self.node.worker_id)

    async def FirstToken(self, request: pb.FirstTokenRequest, context) -> pb.FirstTokenResponse:
        mailbox = self.node.first_tokens
        mailbox.expire()
        token = RECOMPUTE if request.recompute else request.token_id
        return pb.FirstTokenResponse(found=mailbox.deliver(request.request_id, token))

    async def _decode(self, request: pb.DecodeRequest, marks: _Marks, context):
        node, rid = self.node, request.request_id
        params = sampling_from_pb(request.sampling)
        tokens = list(request.token_ids)
        prompt_len = request.prompt_len or len(tokens) - request.num_output_tokens_so_far
        prompt, outputs = tokens[:prompt_len], tokens[prompt_len:]
        kwargs = dict(priority=request.priority, cache_salt=request.cache_salt)
        timings = pb.Timings(decode_worker=node.worker_id)
        start = lambda e: e.add_request(rid, prompt, params, output_token_ids=outputs, **kwargs)  # noqa: E731
        fetched = None
        if request.HasField("prefix_handle"):
            _check_prefix_request(request)
            imported = await self._import_prefix(request, prompt, outputs, params, kwargs, timings, marks)
            self._done_with(request.prefix_handle, marks)
            start = imported or start
        elif request.HasField("handle"):
            start = await self._import_kv(request, prompt, outputs, params, kwargs, timings, marks, context) or start
        elif request.first_token_pending:
            raise InvalidRequest("first_token_pending needs a KV handle")
        elif fetched := await node.admit_from_store(rid, prompt, outputs, params, store_blocks=store_hint(request),
                                                    **kwargs):
            start = fetched  # part of the prefix came from the store tier
        marks.timings, marks.started_s = timings, time.perf_counter()
        first = True
        async for delta in node.async_engine.stream(rid, start):
            if first:
                marks.first_token_s = time.perf_counter()
                if fetched:
                    timings.route_reason = fetched.why  # what the start did (set on the engine thread before)
                timings.lease_released = await _released(marks.release)
                if delta.queue_s is not None:
                    timings.queue_ms = delta.queue_s * 1e3
                if not request.HasField("handle"):  # D computed the prompt: queue + compute, as P reports it
                    timings.prefill_ms = (marks.first_token_s - marks.started_s) * 1e3
            yield _response(delta, timings if first else None)
            first = False

    async def _import_kv(self, request, prompt, outputs, params, kwargs, timings, marks, context):
        """Reserve blocks, pull the missing ones; returns how to start the request (None: locally)."""
        node, rid, handle = self.node, request.request_id, request.handle
        reserved = await self._reserve(rid, handle, prompt, outputs, params, kwargs, timings)
        if reserved is None:
            self._done_with(handle, marks)
            if not request.first_token_pending:
                return None
            first = await self._first_token(request, context)  # P's first token is the client's already: keep it
            known = outputs if first == RECOMPUTE else [*outputs, first]
            return lambda e: e.add_request(rid, prompt, params, output_token_ids=known, **kwargs)
        _, num_hit, dst_blocks = reserved  # num_hit >= first_block: the blocks before it are not sent
        src = list(handle.block_ids[num_hit - handle.first_block :])
        dst = dst_blocks[num_hit : num_hit + len(src)]
        marks.pull_s = time.perf_counter()
        try:
            try:
                stats, kind = await self._pull(handle, src, dst)
            except (KVTransferError, OSError, asyncio.TimeoutError) as exc:
                logger.warning("request_id=%s worker_id=%s KV pull failed (%s); recomputing locally", rid,
                               node.worker_id, exc)
                self._fall_back(timings, _failure_reason(exc), f"KV pull failed ({exc})")
                self._done_with(handle, marks)
                first = await self._first_token(request, context) if request.first_token_pending else None
                return lambda e: e.fallback_remote(rid, None if first == RECOMPUTE else first)
            self._done_with(handle, marks)
            first = await self._first_token(request, context) if request.first_token_pending else None
        except BaseException:
            node.async_engine.abort(rid)  # cancelled mid-pull or while waiting: free the reservation
            raise
        timings.kv_layerwise = request.first_token_pending
        if first == RECOMPUTE:  # P failed after the pull: its first token never came
            self._fall_back(timings, "prefill_failed", "prefill worker failed")
            return lambda e: e.fallback_remote(rid)
        _record_transfer(node, timings, stats, kind)
        return lambda e: e.activate_remote(rid, first)

    async def _reserve(self, rid, handle, prompt, outputs, params, kwargs, timings):
        """Blocks for the prompt, the leading ones ``handle`` does not send (cached here, or out of the sliding
        window) among them: (request, how many need no pull, block ids); None (said in ``timings``) when the
        handle cannot fill them or the pool cannot hold them now."""
        node = self.node
        problem = handle_problem(handle, len(prompt), node.engine.scheduler_config.sliding_window,
                                 node.layout.block_size)
        if problem is not None:
            self._fall_back(timings, "handle_unusable", f"KV handle unusable ({problem})")
            return None
        reserved = await node.async_engine.call(
            lambda e: e.add_remote_request(rid, prompt, outputs, params, first_block=handle.first_block, **kwargs))
        if reserved is None:
            self._fall_back(timings, "no_free_blocks", "no free blocks for the pulled KV")
        return reserved

    async def _import_prefix(self, request, prompt, outputs, params, kwargs, timings, marks):
        """Reserve the request's blocks, pull the leased prefix blocks this worker lacks; returns how to start
        the request (None: prefill it all locally). Any failure recomputes the prefix here."""
        node, rid, handle = self.node, request.request_id, request.prefix_handle
        problem = prefix_problem(handle, len(prompt) + len(outputs), node.layout.block_size)
        if problem is not None:
            self._fall_back(timings, "prefix_unusable", f"prefix handle unusable ({problem})")
            return None
        try:
            reservation = await node.async_engine.call(
                lambda e: e.add_prefix_request(rid, prompt, outputs, params, **kwargs))
            if reservation is None:
                self._fall_back(timings, "no_free_blocks", "no free blocks for the imported prefix")
                return None
            return await self._pull_prefix(rid, handle, reservation, timings, marks)
        except BaseException:
            node.async_engine.abort(rid)  # cancelled while reserving or mid-pull: free the reservation
            raise

    async def _pull_prefix(self, rid: str, handle: pb.KVHandle, reservation, timings, marks):
        node, n = self.node, len(handle.block_hashes)
        if reservation.block_hashes[:n] != tuple(handle.block_hashes):
            self._fall_back(timings, "prefix_mismatch",
                            f"prefix from {handle.worker_id} is not this prompt's (block hashes differ)")
            return lambda e: e.fallback_remote(rid)
        local = min(reservation.num_local_blocks, n)
        src, dst = list(handle.block_ids[local:n]), list(reservation.block_ids[local:n])
        if src:
            marks.pull_s = time.perf_counter()
            try:
                stats, kind = await self._pull(handle, src, dst)
            except (KVTransferError, OSError, asyncio.TimeoutError) as exc:
                logger.warning("request_id=%s worker_id=%s prefix pull from %s failed (%s); recomputing locally",
                               rid, node.worker_id, handle.worker_id, exc)
                self._fall_back(timings, _failure_reason(exc), f"prefix pull from {handle.worker_id} failed ({exc})")
                return lambda e: e.fallback_remote(rid)
            _record_transfer(node, timings, stats, kind)
        block_size = node.layout.block_size
        timings.route_reason = prefix_reason(len(src) * block_size, local * block_size, handle.worker_id)
        return lambda e: e.activate_prefix(rid, n * block_size)

    def _fall_back(self, timings: pb.Timings, reason: str, why: str) -> None:
        """This request prefills here instead of importing: said in its timings, counted by ``reason``."""
        timings.route_reason, timings.local_fallback = f"{why}; prefilled locally", True
        self.node.metrics.kv_pull_fallback(reason)

    def _done_with(self, handle: pb.KVHandle, marks: _Marks) -> None:
        """This call will read no more of ``handle``'s blocks: its holder may unpin them now."""
        if marks.release is None and handle.grpc_address:
            marks.release = self.node.release_remote_lease(handle.grpc_address, handle.lease_id)

    async def _pull(self, handle: pb.KVHandle, src: list[int], dst: list[int]) -> tuple[TransferStats, str]:
        """Pull ``handle``'s leased blocks ``src`` into this worker's blocks ``dst`` over the pair's transport
        (the first of this worker's kinds the peer serves that its handshake accepts: ``kv_transfer/pairs.py``; every
        rank of a tensor-parallel peer over that kind); the layouts are compared before any byte moves."""
        node, layout, offered = self.node, layout_from_pb(handle.layout), handle.data_plane_uri
        stats, uri = await node.kv_pairs.pull(handle.worker_id, offered,
                                              lambda uri: node.pull_kv(uri, offered, layout, handle.lease_id, src, dst))
        return stats, uri_kind(uri)

    async def _first_token(self, request: pb.DecodeRequest, context) -> int:
        """Layer-wise: wait for P's first token (the router's FirstToken) while the call lives: the router
        cancels this call when the request ends, and gRPC does when the router goes away."""
        left_s = context.time_remaining()
        return await self.node.first_tokens.wait(request.request_id, MAX_FIRST_TOKEN_WAIT_S if left_s is None
                                                 else min(left_s, MAX_FIRST_TOKEN_WAIT_S))


def _failure_reason(exc: BaseException) -> str:
    """``kv_pull_fallbacks_total``'s reason for a failed pull."""
    return "peer_unreachable" if isinstance(exc, PeerUnreachable) else "pull_failed"


def _check_prefix_request(request: pb.DecodeRequest) -> None:
    if request.HasField("handle"):
        raise InvalidRequest("prefix_handle and handle are exclusive: a prompt's KV comes from one place")
    if request.first_token_pending:
        raise InvalidRequest("first_token_pending needs a KV handle, not a prefix_handle")


def _record_transfer(node, timings: pb.Timings, stats: TransferStats, kind: str) -> None:
    timings.transfer_bytes, timings.transfer_ms = stats.num_bytes, stats.seconds * 1e3
    timings.transfer_gbps, timings.transfer_blocks = stats.gbps, stats.num_blocks
    timings.transport = kind
    if stats.first_layer_s is not None:
        timings.kv_first_layer_unix_ms = (stats.started_unix_s + stats.first_layer_s) * 1e3
    node.metrics.kv_transfer(stats.num_bytes, stats.seconds, kind)


async def _released(release: asyncio.Task | None) -> bool:
    """Did the holder confirm the release (waiting at most ``RELEASE_WAIT_S``)?"""
    if release is None:
        return False
    await asyncio.wait({release}, timeout=RELEASE_WAIT_S)
    return release.done() and not release.cancelled() and release.exception() is None and release.result()


def _response(delta: RequestDelta, timings: pb.Timings | None) -> pb.DecodeResponse:
    response = pb.DecodeResponse(token_ids=delta.new_token_ids, finish_reason=FINISH_TO_PB[delta.finish_reason],
                                 logprobs=logprobs_to_pb(delta.new_logprobs),
                                 num_cached_tokens=delta.num_cached_tokens)
    if timings is not None:
        response.timings.CopyFrom(timings)
    if delta.num_draft_tokens:  # the finishing delta of a request that speculated
        response.timings.spec_draft_tokens = delta.num_draft_tokens
        response.timings.spec_accepted_tokens = delta.num_accepted_tokens
    return response


@dataclass(slots=True)
class _Marks:
    """The instants (``time.perf_counter()``) a Decode call's spans are cut at."""

    call_s: float
    pull_s: float | None = None
    started_s: float | None = None  # the request entered the engine
    first_token_s: float | None = None
    timings: pb.Timings | None = None
    error: str | None = None
    release: asyncio.Task | None = None  # the ReleaseLease sent to the handle's holder (``_done_with``)


def decode_spans(tracer: Any, parent: Any, marks: _Marks, **ids: str) -> None:
    """``decode`` (the whole call) > ``kv.transfer`` (``transfer_ms``), ``prefill.queue`` (``queue_ms``, local
    prefill), ``decode.first_token`` (engine start -> first token)."""
    instants, t = tracing.Instants(marks.call_s), marks.timings or pb.Timings()
    attributes = {f"baton.{key}": value for key, value in ids.items()}
    span = tracing.start_span(tracer, "decode", instants.ns(marks.call_s), parent, kind="server",
                              attributes=attributes)
    if marks.pull_s is not None and t.transfer_ms:
        tracing.record_span(tracer, "kv.transfer", instants.ns(marks.pull_s), tracing.ms_to_ns(t.transfer_ms), span,
                            **{"baton.transfer_bytes": t.transfer_bytes, "baton.transfer_blocks": t.transfer_blocks,
                               "baton.transport": t.transport})
    if marks.started_s is not None and t.queue_ms:
        tracing.record_span(tracer, "prefill.queue", instants.ns(marks.started_s), tracing.ms_to_ns(t.queue_ms), span)
    if marks.started_s is not None and marks.first_token_s is not None:
        start_ns = instants.ns(marks.started_s)
        tracing.record_span(tracer, "decode.first_token", start_ns, instants.ns(marks.first_token_s) - start_ns, span)
    if marks.error is not None:
        tracing.fail(span, marks.error)
    span.end(end_time=instants.ns(time.perf_counter()))
