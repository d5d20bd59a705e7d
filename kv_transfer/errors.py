"""Typed errors of the KV data plane; shells map them to gRPC status codes (STYLE.md rule 4).

``kv_transfer`` is the lowest layer and imports no other Baton package, so these do not derive from
``engine.errors.BatonError``. Every error here is a ``KVTransferError``: a caller that falls back to local
prefill when a pull fails catches just that one class.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """A KV transfer could not be done (bad request, unreachable or vanished peer, timeout)."""


class LayoutMismatch(KVTransferError):
    """Two KV layouts differ; the message names every differing field. Raised before any KV byte moves."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class TransportUnusable(KVTransferError):
    """This transport cannot work between these two workers, whatever the request: shown at the handshake,
    before any KV byte moves (e.g. a cma:// server in another PID namespace). The puller falls through to its
    next transport for the pair (``kv_transfer/pairs.py``). ``reason`` is a short label for metrics."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class PeerUnreachable(KVTransferError):
    """The serving worker's KV address cannot be connected to from here (refused, no route, no answer within
    the connect timeout): a wrong advertised address, a partition, or a dead peer. Raised before any KV byte
    moves."""


class LeaseNotFound(KVTransferError):
    """A transfer lease is unknown, released or expired."""


class ChecksumMismatch(KVTransferError):
    """Pulled blocks do not match the checksums the serving side computed from the bytes it sent."""

    def __init__(self, message: str, block_ids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.block_ids = block_ids  # destination block ids whose bytes are wrong
