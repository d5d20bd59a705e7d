"""The router's typed errors and the one table that maps every typed error to a gRPC status.

``status_for`` is the single place a Baton error becomes a status code (STYLE.md rule 4); the server's
interceptor (``router.server.ErrorInterceptor``) and the worker-call helpers both use it.
"""

from __future__ import annotations

import grpc

from engine.errors import BatonError, CapacityExceeded, InvalidRequest


class WorkerUnavailable(BatonError):
    """No worker can take the request, or the chosen worker failed: UNAVAILABLE."""


class DeadlineExceeded(BatonError):
    """The request ran past its deadline (the client's, or the router's request timeout)."""


_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WorkerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status of a typed error; INTERNAL for anything else (a bug)."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_status(code: grpc.StatusCode, message: str) -> BatonError:
    """A worker's status as the typed error the router re-raises to its client."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityExceeded(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    return WorkerUnavailable(message)
