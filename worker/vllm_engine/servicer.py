"""``baton.v1.Worker`` served by a vLLM engine, for both roles (the shell's calls are ``worker.servicer``'s).

- ``Prefill`` (prefill role): vLLM computes the prompt with NixlConnector's ``do_remote_decode``; the first token
  and a ``KVHandle`` go back, the handle carrying vLLM's ``kv_transfer_params`` in ``engine_params`` and a Baton lease
  over them (``worker.vllm_engine.leases``). ``PrefillStream`` answers with that one final message (vLLM's connector
  does not stream layers to a reader).
- ``Decode`` (decode role): with a vLLM handle, the prompt and the tokens so far go to vLLM with the handle's
  ``kv_transfer_params``: vLLM's connector reads the blocks from P (notifying P, which frees them), computes the
  last token and decodes; the lease is then released on P as read. Without a handle (or with one this engine cannot
  read) vLLM prefills locally, and an unread handle's blocks are released on P.
- ``LeasePrefix``: vLLM's cached blocks are not leased to other workers (no handle); ``FirstToken``: UNIMPLEMENTED
  (no layer-wise decode).

Sampling values are validated as Baton's engine validates them, prompts refused for the same reasons, so the same
bad input gets the same status whichever engine a worker runs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc

from engine.core.request import FinishReason
from engine.errors import CapacityExceeded, InvalidRequest
from proto import baton_pb2 as pb
from worker.convert import FINISH_TO_PB, layout_to_pb, logprobs_to_pb, sampling_from_pb
from worker.servicer import WorkerServicer, abort_with, status_of
from worker.vllm_engine.params import (
    PREFILL_KV_PARAMS, decode_kv_params, encode_kv_params, prefill_max_tokens, sampling_kwargs,
)

if TYPE_CHECKING:
    from worker.vllm_engine.node import VLLMNode

logger = logging.getLogger(__name__)
TRANSPORT = "vllm-nixl"  # what Timings.transport says of a pull vLLM's NixlConnector made


class VLLMServicer(WorkerServicer):
    node: VLLMNode

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        if self.node.config.role != "prefill":
            await self._not_served(context)
        try:
            return await self._prefill(request)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await abort_with(context, exc)

    async def _prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        node, engine, rid = self.node, self.node.engine, request.request_id
        params, prompt = sampling_from_pb(request.sampling), list(request.token_ids)
        kwargs = sampling_kwargs(params, max_tokens=prefill_max_tokens(len(prompt), engine.vllm_block_size))
        kwargs["min_tokens"] = min(params.min_tokens, 1)
        started = time.perf_counter()
        tokens, finish, kv_params, last, cached = [], None, None, None, 0
        async for delta, kv in engine.stream(rid, prompt, kwargs, kv_params=dict(PREFILL_KV_PARAMS),
                                             cache_salt=request.cache_salt, priority=request.priority):
            tokens += delta.new_token_ids
            if delta.new_logprobs and len(tokens) == len(delta.new_token_ids):
                last = delta.new_logprobs[0]
            finish, kv_params, cached = delta.finish_reason, kv or kv_params, max(cached, delta.num_cached_tokens)
        if finish is FinishReason.ABORT or not tokens:
            raise CapacityExceeded(f"prefill of {rid} was aborted")
        real = _real_finish(finish, len(tokens), params, len(prompt), engine.max_model_len)
        response = pb.PrefillResponse(
            first_token=tokens[0], finish_reason=FINISH_TO_PB[real], num_cached_tokens=cached,
            timings=pb.Timings(prefill_ms=(time.perf_counter() - started) * 1e3, prefill_worker=node.worker_id,
                               prefill_end_unix_ms=time.time() * 1e3))
        if last is not None:
            response.logprobs.CopyFrom(logprobs_to_pb([last])[0])
        if kv_params is None:
            return response  # vLLM kept no blocks for a reader: the decode worker prefills
        lease = node.leases.open(rid, kv_params)
        if real is not None:
            node.leases.release(lease.lease_id)  # nothing left to decode
        else:
            response.handle.CopyFrom(self._handle(lease, len(prompt)))
        return response

    def _handle(self, lease, num_tokens: int) -> pb.KVHandle:
        node = self.node
        return pb.KVHandle(
            worker_id=node.worker_id, data_plane_uri=node.kv_uri, lease_id=lease.lease_id, num_tokens=num_tokens,
            layout=layout_to_pb(node.layout), lease_expires_unix_ms=node.leases.expiry_unix_ms(lease),
            grpc_address=node.grpc_address, engine="vllm", engine_params=encode_kv_params(lease.kv_params))

    async def PrefillStream(self, request: pb.PrefillRequest, context):
        yield await self.Prefill(request, context)

    async def LeasePrefix(self, request: pb.LeasePrefixRequest, context) -> pb.LeasePrefixResponse:
        return pb.LeasePrefixResponse()  # vLLM's cached blocks are not leased to other workers

    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context) -> pb.ReleaseLeaseResponse:
        return pb.ReleaseLeaseResponse(found=self.node.leases.release(request.lease_id, read=request.read))

    async def Decode(self, request: pb.DecodeRequest, context):
        if self.node.config.role != "decode":
            await self._not_served(context)
        try:
            async for response in self._decode(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            self.node.metrics.request_error(status_of(exc).name)
            await abort_with(context, exc)

    async def _decode(self, request: pb.DecodeRequest, context):
        node, engine, rid = self.node, self.node.engine, request.request_id
        params, tokens = sampling_from_pb(request.sampling), list(request.token_ids)
        num_out = request.num_output_tokens_so_far if not request.prompt_len else len(tokens) - request.prompt_len
        if request.first_token_pending:
            raise InvalidRequest("first_token_pending: a vLLM decode worker does not decode layer-wise")
        if num_out >= params.max_tokens:
            raise InvalidRequest(f"{num_out} tokens were generated already of max_tokens {params.max_tokens}")
        kwargs = sampling_kwargs(params, max_tokens=params.max_tokens - num_out)
        kwargs["min_tokens"] = max(0, params.min_tokens - num_out)
        timings = pb.Timings(decode_worker=node.worker_id)
        kv_params, handle = self._kv_params(request, timings)
        external_before, started = engine.external_tokens, time.perf_counter()
        first = True
        async for delta, _ in engine.stream(rid, tokens, kwargs, kv_params=kv_params, cache_salt=request.cache_salt,
                                            priority=request.priority):
            if first and delta.new_token_ids:
                first = False
                self._first_timings(timings, handle, rid, started, engine.external_tokens - external_before)
                yield _response(delta, timings)
            elif not first or delta.finished:
                yield _response(delta, None)

    def _kv_params(self, request: pb.DecodeRequest, timings: pb.Timings):
        """vLLM's kv_transfer_params from the request's handle (None: prefill here, said in ``timings``)."""
        handle = request.handle if request.HasField("handle") else None
        if request.HasField("prefix_handle"):
            self._fall_back(timings, "prefix_unusable", "a vLLM engine does not import another worker's prefix")
            self.node.releaser.release(request.prefix_handle.grpc_address, request.prefix_handle.lease_id)
        if handle is None:
            return None, None
        if handle.engine != "vllm":
            self._fall_back(timings, "handle_unusable", f"the handle's blocks are {handle.engine or 'baton'}'s KV, "
                            "which a vLLM engine does not read")
            self.node.releaser.release(handle.grpc_address, handle.lease_id)
            return None, None
        params = decode_kv_params(handle.engine_params)
        theirs, ours = params.get("connector", "nixl"), self.node.options.kv_connector
        if theirs != ours:
            self._fall_back(timings, "handle_unusable", f"the handle's blocks move by the {theirs} connector; this "
                            f"worker's is {ours}")
            self.node.releaser.release(handle.grpc_address, handle.lease_id)
            return None, None
        return params, handle

    def _first_timings(self, timings: pb.Timings, handle, request_id: str, started_s: float,
                       external_tokens: int) -> None:
        """The first response's timings: the pull (Baton's connector times each one; under NIXL, vLLM's connector
        read ``external_tokens`` prompt tokens from P, counted by its iteration stats, concurrent pulls may blur
        which request read which, and the time is to the first token), or the local prefill."""
        elapsed_ms = (time.perf_counter() - started_s) * 1e3
        if handle is None:
            timings.prefill_ms = elapsed_ms
            return
        self.node.releaser.release(handle.grpc_address, handle.lease_id, read=True)
        timings.lease_released = True
        num_bytes, transport = external_tokens * self.node.engine.bytes_per_token, TRANSPORT
        if (pull := self.node.engine.pull_of(request_id)) is not None:  # Baton's connector: the pull as timed
            num_bytes, elapsed_ms, transport = pull.num_bytes, pull.seconds * 1e3, f"vllm-baton+{pull.transport}"
        timings.transfer_bytes, timings.transfer_ms, timings.transport = num_bytes, elapsed_ms, transport
        timings.transfer_blocks = -(-external_tokens // self.node.layout.block_size)
        timings.transfer_gbps = num_bytes / elapsed_ms / 1e6 if elapsed_ms > 0 else 0.0
        self.node.metrics.kv_transfer(num_bytes, elapsed_ms / 1e3, transport)

    def _fall_back(self, timings: pb.Timings, reason: str, why: str) -> None:
        timings.route_reason, timings.local_fallback = f"{why}; prefilled locally", True
        self.node.metrics.kv_pull_fallback(reason)

    async def FirstToken(self, request, context):
        await self._not_served(context)


def _real_finish(finish: FinishReason | None, num_tokens: int, params, num_prompt_tokens: int,
                 max_model_len: int) -> FinishReason | None:
    """Did the request itself end with its first token? (P may have computed a second one: dropped.)"""
    if finish is FinishReason.STOP and num_tokens == 1:
        return FinishReason.STOP  # an EOS / stop token (min_tokens already honoured)
    if params.max_tokens == 1 or num_prompt_tokens + 1 >= max_model_len:
        return FinishReason.LENGTH
    return None


def _response(delta, timings: pb.Timings | None) -> pb.DecodeResponse:
    response = pb.DecodeResponse(token_ids=delta.new_token_ids, finish_reason=FINISH_TO_PB[delta.finish_reason],
                                 logprobs=logprobs_to_pb(delta.new_logprobs),
                                 num_cached_tokens=delta.num_cached_tokens)
    if timings is not None:
        response.timings.CopyFrom(timings)
    return response
