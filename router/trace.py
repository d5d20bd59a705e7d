"""Per-request timing: when tokens went out, what the workers reported, and the final ``Timings``."""

from __future__ import annotations

import time
from collections.abc import Callable

from proto import baton_pb2 as pb


class RequestTrace:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.start_s = clock()
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.num_tokens = 0
        self.token_gaps_s: list[float] = []  # per token after the first: the wait since the previous message
        self.route_kind = ""
        self.route_reason = ""
        self.predicted_ttft_s: float | None = None  # the cost policy's prediction, reported beside the measured
        self.end_s: float | None = None  # when the final Timings were cut (e2e_ms ends here)
        self._worker_notes: list[str] = []  # route_reason a worker reported, e.g. "KV pull failed; ..."
        self._timings = pb.Timings()  # workers' non-zero fields merged in

    def route(self, kind: str, reason: str, predicted_ttft_s: float | None = None) -> None:
        self.route_kind, self.route_reason, self.predicted_ttft_s = kind, reason, predicted_ttft_s

    def tokens_sent(self, num_tokens: int) -> None:
        now = self._clock()
        if self.first_token_s is not None and num_tokens > 0:
            self.token_gaps_s.extend([(now - self.last_token_s) / num_tokens] * num_tokens)
        self.first_token_s = self.first_token_s or now
        self.last_token_s = now
        self.num_tokens += num_tokens

    def merge(self, timings: pb.Timings, *, migrated: bool = False) -> None:
        """Workers' non-zero fields win (transfer figures, prefill_ms, ...); their notes are kept apart. From a
        decode worker a request migrated to (``migrated``), only its note and its speculation counts: the
        route's figures (prefill, queue, the KV handoff) stay those of the workers that produced the first token."""
        if timings.route_reason:
            self._worker_notes.append(timings.route_reason)
        if migrated:
            timings = pb.Timings(spec_draft_tokens=timings.spec_draft_tokens,
                                 spec_accepted_tokens=timings.spec_accepted_tokens)
        self._timings.MergeFrom(timings)

    def note(self, text: str) -> None:
        """A note of the router's own for the final ``route_reason`` (after the route's, with the workers')."""
        self._worker_notes.append(text)

    def now(self) -> float:
        """An instant on this trace's clock (the spans of router.tracing are cut at such instants)."""
        return self._clock()

    def elapsed_ms(self) -> float:
        return (self._clock() - self.start_s) * 1e3

    def final(self, *, prefill_worker: str, decode_worker: str) -> pb.Timings:
        t, now = pb.Timings(), self._clock()
        self.end_s = now
        t.CopyFrom(self._timings)
        first = self.first_token_s or now
        t.ttft_ms, t.e2e_ms = (first - self.start_s) * 1e3, (now - self.start_s) * 1e3
        t.route_kind, t.route_reason = self.route_kind, "; ".join([self.route_reason, *self._worker_notes])
        t.prefill_worker, t.decode_worker = prefill_worker, decode_worker
        if self.predicted_ttft_s is not None:
            t.predicted_ttft_ms = self.predicted_ttft_s * 1e3
        if not t.transfer_gbps and t.transfer_ms > 0:
            t.transfer_gbps = t.transfer_bytes / (t.transfer_ms * 1e-3) / 1e9
        if self.num_tokens > 1 and self.last_token_s > first:
            t.decode_tokens_per_s = (self.num_tokens - 1) / (self.last_token_s - first)
        return t
