"""Cross-worker prefix reuse, router side: lease a cached prefix on its holder for the decode worker.

The cost policy may route a request local on D with ``prefix_source_id``: another worker X (either role)
holds a longer cached prefix of the prompt than D, and pulling it is predicted cheaper than computing it
(``router.routing.cost_model``). Before Decode the router asks X to lease that prefix (``Worker/LeasePrefix``);
D gets the handle as ``DecodeRequest.prefix_handle``, pulls the blocks it lacks over the KV data plane and
prefills the rest. The lease is released once D answered (its pull is over), or when the request ends —
after D confirmed an abort, like a remote prefill's lease — and otherwise by its TTL. A failure here costs
only the reuse: without a handle D computes the whole prompt, as the other policies have it do.
"""

from __future__ import annotations

import logging

import grpc

from proto import baton_pb2 as pb

log = logging.getLogger(__name__)

LEASE_TIMEOUT_S = 1.0  # LeasePrefix is a lookup and a pin: longer than this, recomputing is the safer bet


async def lease_prefix(stub, request_id: str, prompt: list[int], cache_salt: str, min_tokens: int,
                       timeout_s: float) -> pb.KVHandle | None:
    """X's lease on its cached prefix of ``prompt`` (at least ``min_tokens``), or None (none, or X failed)."""
    request = pb.LeasePrefixRequest(token_ids=prompt, cache_salt=cache_salt, min_tokens=min_tokens)
    try:
        response = await stub.LeasePrefix(request, timeout=min(timeout_s, LEASE_TIMEOUT_S))
    except grpc.aio.AioRpcError as exc:
        log.info("request_id=%s LeasePrefix failed (%s: %s); the decode worker computes the whole prompt",
                 request_id, exc.code().name, exc.details())
        return None
    return response.handle if response.HasField("handle") else None
