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


class Overloaded(CapacityExceeded):
    """The router already runs its limit of requests (``--max-inflight-requests``): RESOURCE_EXHAUSTED,
    with a hint of when to retry (in the message; as ``retry-after-ms`` trailing metadata on gRPC and a
    ``Retry-After`` header on HTTP, see ``retry_metadata``)."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        super().__init__(f"the router is at its limit of {limit} requests in flight; "
                         f"retry after {retry_after_ms(retry_after_s)} ms")
        self.limit, self.retry_after_s = limit, retry_after_s


def retry_after_ms(retry_after_s: float) -> int:
    return max(1, round(retry_after_s * 1e3))


def retry_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a status for ``exc`` carries: ``retry-after-ms`` for an ``Overloaded``."""
    if isinstance(exc, Overloaded):
        return (("retry-after-ms", str(retry_after_ms(exc.retry_after_s))),)
    return ()


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
