"""Routing policy: pick the decode worker, then decide remote vs local prefill and pick the prefill worker.

Pure logic (no I/O, no asyncio, no proto): the shell hands in every live worker with its last reported
load and the number of leading prompt blocks the KV index says it holds; this returns a ``RouteDecision``.
This is the simple policy of issue 3 — least loaded, prefix overlap as the tie-break; the cost model of
DESIGN.md "Routing" replaces ``pick_decode`` / ``pick_prefill`` later without changing the shell.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from engine.errors import CapacityExceeded
from kv_transfer.registry import WorkerInfo, WorkerLoad
from router.errors import WorkerUnavailable


class RouteKind(enum.Enum):
    REMOTE = "remote"  # prefill on P, KV handed to D
    LOCAL = "local"  # D prefills itself


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    disagg_threshold_tokens: int = 64  # uncached prompt tokens at or below this always prefill locally
    max_queued_prefill_tokens: int | None = None  # a prefill worker queueing more is saturated (None: no cap)

    def __post_init__(self) -> None:
        if self.disagg_threshold_tokens < 0:
            raise ValueError(f"disagg_threshold_tokens must be >= 0, got {self.disagg_threshold_tokens}")
        if self.max_queued_prefill_tokens is not None and self.max_queued_prefill_tokens < 0:
            raise ValueError(f"max_queued_prefill_tokens must be >= 0, got {self.max_queued_prefill_tokens}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One live worker as routing sees it. ``load`` is None until its first heartbeat reports one."""

    info: WorkerInfo
    load: WorkerLoad | None
    cached_blocks: int = 0  # leading blocks of this prompt's hash chain the worker holds
    draining: bool = False
    inflight: int = 0  # requests this router sent here and that have not finished

    @property
    def num_active(self) -> int:
        """Running + waiting as last reported, or this router's own in-flight count when higher
        (the report lags a burst by up to a heartbeat)."""
        reported = 0 if self.load is None else self.load.running + self.load.waiting
        return max(reported, self.inflight)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def free_blocks(self) -> int:
        return self.info.total_blocks if self.load is None else self.load.free_blocks

    @property
    def queued_prefill_tokens(self) -> int:
        return 0 if self.load is None else self.load.queued_prefill_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteRequest:
    num_prompt_tokens: int
    block_size: int

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def blocks_to_admit(self) -> int:
        """Blocks a worker allocates to admit the request: the prompt plus its first output token."""
        return self.blocks_for(self.num_prompt_tokens + 1)

    def cached_tokens(self, candidate: Candidate) -> int:
        return min(candidate.cached_blocks * self.block_size, self.num_prompt_tokens)

    def uncached_tokens(self, candidate: Candidate) -> int:
        return self.num_prompt_tokens - self.cached_tokens(candidate)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteDecision:
    kind: RouteKind
    reason: str
    decode_id: str
    prefill_id: str | None  # set exactly when kind is REMOTE
    decode_cached_tokens: int = 0

    def __post_init__(self) -> None:
        assert (self.prefill_id is not None) == (self.kind is RouteKind.REMOTE), self


def route(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    config: PolicyConfig,
    *,
    exclude: Collection[str] = (),
) -> RouteDecision:
    """Decode worker first (it holds the request for its whole life), then where its prompt is computed."""
    decode, note = pick_decode(request, candidates, exclude)
    uncached = request.uncached_tokens(decode)
    threshold = config.disagg_threshold_tokens
    if uncached <= threshold:
        return _local(decode, request, f"{uncached} uncached prompt tokens <= threshold {threshold}{note}")
    prefill, why_not = pick_prefill(candidates, config, exclude)
    if prefill is None:
        return _local(decode, request, f"{why_not}{note}")
    return RouteDecision(
        kind=RouteKind.REMOTE, decode_id=decode.worker_id, prefill_id=prefill.worker_id,
        reason=f"{uncached} uncached prompt tokens > threshold {threshold}{note}",
        decode_cached_tokens=request.cached_tokens(decode),
    )


def pick_decode(
    request: RouteRequest, candidates: Sequence[Candidate], exclude: Collection[str] = ()
) -> tuple[Candidate, str]:
    """Fewest running + waiting among those whose free blocks hold the request; ties: more cached, then id.

    When none has the free blocks, the least loaded of those that could ever hold it (it queues there);
    the returned note says so. Raises WorkerUnavailable with no decode worker, CapacityExceeded when the
    prompt fits in none.
    """
    pool = _eligible(candidates, "decode", exclude)
    if not pool:
        raise WorkerUnavailable(_no_workers_message("decode", candidates, exclude))
    fits = [c for c in pool if c.free_blocks >= request.blocks_to_admit - c.cached_blocks]
    if fits:
        return min(fits, key=_decode_key), ""
    could_fit = [c for c in pool if c.info.total_blocks >= request.blocks_to_admit]
    if not could_fit:
        largest = max(c.info.total_blocks for c in pool)
        raise CapacityExceeded(
            f"prompt of {request.num_prompt_tokens} tokens needs {request.blocks_to_admit} KV blocks; "
            f"the largest decode worker has {largest}"
        )
    return min(could_fit, key=_decode_key), "; every decode worker is short of free blocks, queued"


def pick_prefill(
    candidates: Sequence[Candidate], config: PolicyConfig, exclude: Collection[str] = ()
) -> tuple[Candidate | None, str]:
    """Fewest queued prefill tokens; ties: more cached, then id. ``(None, reason)`` when none fits."""
    pool = _eligible(candidates, "prefill", exclude)
    if not pool:
        return None, "no prefill workers"
    limit = config.max_queued_prefill_tokens
    if limit is not None:
        pool = [c for c in pool if c.queued_prefill_tokens <= limit]
        if not pool:
            return None, f"prefill pool saturated (every worker queues > {limit} tokens)"
    return min(pool, key=_prefill_key), ""


def _eligible(candidates: Sequence[Candidate], role: str, exclude: Collection[str]) -> list[Candidate]:
    return [c for c in candidates if c.info.role == role and not c.draining and c.worker_id not in exclude]


def _decode_key(c: Candidate) -> tuple[int, int, str]:
    return c.num_active, -c.cached_blocks, c.worker_id


def _prefill_key(c: Candidate) -> tuple[int, int, str]:
    return c.queued_prefill_tokens, -c.cached_blocks, c.worker_id


def _local(decode: Candidate, request: RouteRequest, reason: str) -> RouteDecision:
    return RouteDecision(
        kind=RouteKind.LOCAL, decode_id=decode.worker_id, prefill_id=None, reason=reason,
        decode_cached_tokens=request.cached_tokens(decode),
    )


def _no_workers_message(role: str, candidates: Sequence[Candidate], exclude: Collection[str]) -> str:
    same_role = [c for c in candidates if c.info.role == role]
    draining = sum(c.draining for c in same_role)
    failed = sum(c.worker_id in exclude for c in same_role)
    details = [f"{n} {what}" for n, what in ((draining, "draining"), (failed, "failed")) if n]
    suffix = f" ({', '.join(details)})" if details else " registered"
    return f"no {role} workers{suffix}"
