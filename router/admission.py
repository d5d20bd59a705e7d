"""The router-wide admission limit (``--max-inflight-requests``): a counter of the requests this router
runs, owned by the ``Relay`` so the gRPC and the OpenAI HTTP fronts share it.

A request over the limit is refused at once with ``Overloaded`` (RESOURCE_EXHAUSTED / HTTP 429): nothing
is queued for it, so a burst costs the router memory for at most ``limit`` requests. The retry hint is the
expected wait for a slot: the mean duration of recent requests (EWMA) over the number in flight.
"""

from __future__ import annotations

from router.errors import Overloaded

DEFAULT_RETRY_AFTER_S = 1.0  # before any request has finished
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 0.05, 30.0


class AdmissionGate:
    """Counts requests in flight; ``limit`` None admits everything (and still counts)."""

    def __init__(self, limit: int | None, *, ewma_weight: float = 0.2) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"max_inflight_requests must be >= 1, got {limit}")
        self.limit = limit
        self.inflight = 0
        self.num_refused = 0
        self._ewma_weight = ewma_weight
        self._mean_duration_s: float | None = None

    def check(self) -> None:
        """Raise ``Overloaded`` when a new request would exceed the limit."""
        if self.limit is not None and self.inflight >= self.limit:
            self.num_refused += 1
            raise Overloaded(self.limit, self.retry_after_s())

    def enter(self) -> None:
        """Count one request in (``check`` first); pair with ``leave``."""
        self.check()
        self.inflight += 1

    def leave(self, duration_s: float | None = None) -> None:
        """Count one request out; ``duration_s`` (when it ran to its end) feeds the retry hint."""
        assert self.inflight > 0, "leave() without enter()"
        self.inflight -= 1
        if duration_s is not None and duration_s >= 0:
            mean = self._mean_duration_s
            self._mean_duration_s = duration_s if mean is None else mean + self._ewma_weight * (duration_s - mean)

    def retry_after_s(self) -> float:
        if self._mean_duration_s is None:
            return DEFAULT_RETRY_AFTER_S
        wait_s = self._mean_duration_s / max(self.inflight, 1)
        return min(max(wait_s, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)
