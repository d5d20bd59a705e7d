"""Request migration: a decode worker failed after tokens were streamed, and the request goes on on another one
(DESIGN.md "Request path" 6: "or migration, replaying the tokens").

The relay (``router.relay``, ``_Flow._migrate``) sends the new decode worker ``Worker/Decode`` with the prompt plus
every token the client already has (``prompt_len`` marks where the outputs start, ``num_output_tokens_so_far`` how
many); it computes their KV (or first imports a cached prefix of them from a holder, ``Worker/LeasePrefix``, when
the cost model says the pull is cheaper) and samples the next output position. Sampling draws its randomness from
(seed, output position, token id) and the router drew the seed of an unseeded request before any worker saw it, so
that token is the one the failed worker would have sent: the client's stream goes on exactly, no token repeated
and none missing, greedy and seeded alike. Stop strings, ``max_tokens`` (the engine counts the outputs it resumes
after), usage and logprobs are per token or the router's own books, and run on.

A request moves at most ``limit`` times; past that, or when no other decode worker can take it, the client gets
UNAVAILABLE naming the failure. ``Migrations`` keeps one request's books: the moves, and how long the client waited
for its next token across them (``Timings.migrations``, ``Timings.migration_ms``). Pure logic: the caller passes
the instants.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


@dataclass(slots=True)
class Migrations:
    limit: int  # moves allowed (RouterConfig.max_migrations)
    count: int = 0  # moves made
    stalled_s: float = 0.0  # from each failure to the first token after it, summed
    _failed_s: float | None = None  # a failure's instant, until a token arrives from the next worker

    @property
    def exhausted(self) -> bool:
        return self.count >= self.limit

    def moved(self, now_s: float) -> None:
        """The request moves to another decode worker (its last one failed at about ``now_s``)."""
        assert not self.exhausted, "moved past the limit"
        self.count += 1
        if self._failed_s is None:  # a worker that fails before its first token extends the same wait
            self._failed_s = now_s

    def resumed(self, now_s: float) -> None:
        """A token arrived: the wait since the failure, if any, ends."""
        if self._failed_s is not None:
            self.stalled_s += max(now_s - self._failed_s, 0.0)
            self._failed_s = None


def failure_text(worker_id: str, num_tokens: int, code: grpc.StatusCode, details: str) -> str:
    """``decode worker d0 failed after 12 tokens were streamed: UNAVAILABLE: ...``, as the client reads it."""
    after = {0: "", 1: " after 1 token was streamed"}.get(num_tokens, f" after {num_tokens} tokens were streamed")
    return f"decode worker {worker_id} failed{after}: {code.name}: {details}"
