"""Routing policy: pick the decode worker, then decide remote vs local prefill and pick the prefill worker.

Pure logic (no I/O, no asyncio, no proto): the shell hands in every live worker with its last reported
load and the number of leading prompt blocks the KV index says it holds; this returns a ``RouteDecision``.
The default policy is the cost model of DESIGN.md "Routing" (``router.routing.cost_model``, rates learned online in
``router.routing.rates``); the baselines stay selectable for benchmarks: ``least_loaded`` (the simple policy of
issue 3: least loaded, prefix overlap as the tie-break, fixed threshold), ``round_robin``, ``random`` and
``prefix_overlap`` (Dynamo's ``overlap_weight * prefill_blocks + active_blocks``).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from engine.errors import CapacityExceeded
from kv_transfer.workers import WorkerInfo, WorkerLoad
from router.routing import cost_model
from router.routing.cost_model import CostConfig
from router.errors import WorkerUnavailable
from router.routing.rates import Rates, RatesConfig

PolicyName = Literal["cost", "least_loaded", "round_robin", "random", "prefix_overlap"]
POLICIES: tuple[str, ...] = ("cost", "least_loaded", "round_robin", "random", "prefix_overlap")


class RouteKind(enum.Enum):
    REMOTE = "remote"  # prefill on P, KV handed to D
    LOCAL = "local"  # D prefills itself


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    disagg_threshold_tokens: int = 64  # uncached prompt tokens at or below this always prefill locally
    max_queued_prefill_tokens: int | None = None  # a prefill worker queueing more is saturated (None: no cap)
    policy: PolicyName = "cost"
    overlap_weight: float = 1.0  # prefix_overlap: weight of the blocks still to prefill
    cost: CostConfig = field(default_factory=CostConfig)
    rates: RatesConfig = field(default_factory=RatesConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.disagg_threshold_tokens < 0:
            raise ValueError(f"disagg_threshold_tokens must be >= 0, got {self.disagg_threshold_tokens}")
        if self.max_queued_prefill_tokens is not None and self.max_queued_prefill_tokens < 0:
            raise ValueError(f"max_queued_prefill_tokens must be >= 0, got {self.max_queued_prefill_tokens}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One live worker as routing sees it. ``load`` is None until its first heartbeat reports one."""

    info: WorkerInfo
    load: WorkerLoad | None
    cached_blocks: int = 0  # leading blocks of this prompt's hash chain the worker holds in its KV pool
    tiered_blocks: int = 0  # ... in its KV pool or its host tier (the index's gpu_or_cpu; >= cached_blocks)
    draining: bool = False
    # requests this router sent here and that have not finished (plus the other routers', as of their last publish:
    # router.routing.shared_books)
    inflight: int = 0
    inflight_prefill_tokens: int = 0  # prompt tokens the routers sent here to compute (either role), not yet answered
    # leading blocks of this prompt the worker is computing for a request this router (or another) sent it, not yet in
    # the index (router.routing.in_progress.PendingPrefixes); the cost policy prices them as cached, behind its backlog
    pending_blocks: int = 0

    @property
    def num_active(self) -> int:
        """Running + waiting as last reported, or the routers' in-flight count when higher
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
        """As last reported, or the routers' unanswered prefills when more (reports lag a burst)."""
        reported = 0 if self.load is None else self.load.queued_prefill_tokens
        return max(reported, self.inflight_prefill_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteRequest:
    num_prompt_tokens: int  # the tokens to compute: a migrated request's prompt and the outputs it resumes after
    block_size: int
    max_tokens: int | None = None  # the request's output limit; None: unknown (the cost model prices its default)
    store_blocks: int = 0  # leading blocks of the prompt the shared store holds (the index's ``store`` holder)
    # of ``num_prompt_tokens``, outputs already sampled (a request migrating to another decode worker): only a
    # decode worker resumes them (a prefill worker samples output 0), so every plan is local
    num_resumed_outputs: int = 0

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

    def host_tokens(self, candidate: Candidate) -> int:
        """Prompt tokens past the worker's KV-pool prefix that its host tier holds (copied up, not computed)."""
        tiered = min(candidate.tiered_blocks * self.block_size, self.num_prompt_tokens - 1)  # the last: computed
        return max(tiered - self.cached_tokens(candidate), 0)

    def store_tokens(self, candidate: Candidate) -> int:
        """Prompt tokens past the worker's own tiers that the shared store holds (fetched, not computed)."""
        stored = min(self.store_blocks * self.block_size, self.num_prompt_tokens - 1)
        return max(stored - self.cached_tokens(candidate) - self.host_tokens(candidate), 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteDecision:
    kind: RouteKind
    reason: str
    decode_id: str
    prefill_id: str | None  # set exactly when kind is REMOTE
    decode_cached_tokens: int = 0
    predicted_ttft_s: float | None = None  # the cost policy's prediction
    # local only: pull this worker's cached prefix (LeasePrefix) of ``prefix_tokens`` before prefilling
    prefix_source_id: str | None = None
    prefix_tokens: int = 0
    # the prompt tokens the computing worker computes, per the index: P's for remote, D's (after any import)
    # for local; the router counts them as that worker's queue until it answers. None: the whole prompt
    computed_tokens: int | None = None

    def __post_init__(self) -> None:
        assert (self.prefill_id is not None) == (self.kind is RouteKind.REMOTE), self
        assert self.prefix_source_id is None or self.kind is RouteKind.LOCAL, self


@dataclass(slots=True, kw_only=True)
class RoutingState:
    """What one router process carries between decisions: learned rates, its RNG, the round-robin cursor."""

    rates: Rates = field(default_factory=Rates)
    rng: random.Random = field(default_factory=random.Random)
    next_index: dict[str, int] = field(default_factory=dict)  # round-robin cursor per role

    @classmethod
    def for_config(cls, config: PolicyConfig, *, seed: int | None = None) -> RoutingState:
        return cls(rates=Rates(config.rates), rng=random.Random(seed))


def route(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    config: PolicyConfig,
    *,
    exclude: Collection[str] = (),
    state: RoutingState | None = None,
    preselected: bool = False,
) -> RouteDecision:
    """Decode worker first (it holds the request for its whole life), then where its prompt is computed.

    ``state`` carries rates and randomness across calls; without one, defaults and a fixed seed.
    ``preselected``: ``candidates`` are the few that can win in a large pool (``router.routing.preselect``):
    the cost policy prices every one of them (no power-of-two sampling on top)."""
    state = RoutingState.for_config(config, seed=0) if state is None else state
    if config.policy == "cost":
        return route_by_cost(request, candidates, config, state, exclude, preselected=preselected)
    if config.policy == "least_loaded":
        return route_least_loaded(request, candidates, config, exclude)
    return _route_baseline(request, candidates, config, state, exclude)


def route_least_loaded(
    request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig, exclude: Collection[str] = ()
) -> RouteDecision:
    """The simple policy: least-loaded decode, fixed threshold, least-queued prefill."""
    decode, note = pick_decode(request, candidates, exclude)
    uncached = request.uncached_tokens(decode)
    threshold = config.disagg_threshold_tokens
    if uncached <= threshold:
        return _local(decode, request, f"{uncached} uncached prompt tokens <= threshold {threshold}{note}")
    prefill, why_not = pick_prefill(candidates, config, exclude, request)
    if prefill is None:
        return _local(decode, request, f"{why_not}{note}")
    return RouteDecision(
        kind=RouteKind.REMOTE, decode_id=decode.worker_id, prefill_id=prefill.worker_id,
        reason=f"{uncached} uncached prompt tokens > threshold {threshold}{note}",
        decode_cached_tokens=request.cached_tokens(decode), computed_tokens=request.uncached_tokens(prefill),
    )


def route_by_cost(
    request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig, state: RoutingState,
    exclude: Collection[str] = (), *, preselected: bool = False,
) -> RouteDecision:
    """Price each decode worker that fits (two of them in a large pool not ``preselected``) with its best
    prefill plan."""
    # a prefix hit may only be pulled from a worker that holds it now (the index), but is priced on one that
    # is computing it too: the second request waits for those blocks and computes its tail
    source = cost_model.prefix_source(request, [c for c in candidates if c.worker_id not in exclude])
    pending = {c.worker_id: c.cached_blocks for c in candidates if c.pending_blocks > c.cached_blocks}
    if pending:
        candidates = [replace(c, cached_blocks=c.pending_blocks) if c.worker_id in pending else c
                      for c in candidates]
    fits, note = _fitting_decodes(request, candidates, exclude)
    prefills, no_remote_reason = _usable_prefills(candidates, config, exclude, request)
    quotes = cost_model.quote_prefills(request, prefills, state.rates, config.cost)
    sampled = fits if preselected else cost_model.sample_decodes(fits, config.cost, state.rng)
    priced = [
        cost_model.price_decode(request, decode, quotes, state.rates, config.cost, source=source,
                                floor_tokens=config.disagg_threshold_tokens, no_remote_reason=no_remote_reason)
        for decode in sampled
    ]
    best = cost_model.choose(priced, config.cost, state.rng)
    sampled_note = f" ({len(sampled)} of {len(fits)} decode workers priced)" if len(sampled) < len(fits) else ""
    if preselected:
        sampled_note = f" ({len(sampled)} pre-selected decode workers priced)"
    others = sorted((p for p in priced if p is not best), key=lambda p: p.cost_s)
    runner_up = ""
    if others:  # what the choice was weighed against
        r = others[0]
        runner_up = (f" (next: {r.decode.worker_id} cost {r.cost_s:.4f} s = ttft {r.plan.ttft_s:.4f} + stall "
                     f"{r.plan.stall_s:.4f} + itl {r.itl_s:.4f}, {request.cached_tokens(r.decode)} cached)")
    plan = best.plan
    kind = RouteKind.REMOTE if plan.kind == "remote" else RouteKind.LOCAL
    indexed = {w: min(blocks * request.block_size, request.num_prompt_tokens) for w, blocks in pending.items()}
    chosen = (best.decode.worker_id, plan.prefill_id)
    computing = [f"{c.worker_id} is computing {request.cached_tokens(c) - indexed[c.worker_id]} of them"
                 for c in candidates if c.worker_id in indexed and c.worker_id in chosen]
    pending_note = f" ({'; '.join(computing)})" if computing else ""
    # what D holds now, which a prefix lease must go beyond
    decode_cached = indexed.get(best.decode.worker_id, request.cached_tokens(best.decode))
    return RouteDecision(
        kind=kind, decode_id=best.decode.worker_id, prefill_id=plan.prefill_id,
        reason=f"cost{sampled_note}: {request.cached_tokens(best.decode)} of {request.num_prompt_tokens} prompt "
               f"tokens cached on {best.decode.worker_id}{pending_note}{runner_up}; {best.describe()}{note}",
        decode_cached_tokens=decode_cached, predicted_ttft_s=plan.ttft_s,
        prefix_source_id=plan.import_from, prefix_tokens=plan.import_tokens,
        computed_tokens=plan.uncached_tokens,
    )


def _route_baseline(
    request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig, state: RoutingState,
    exclude: Collection[str],
) -> RouteDecision:
    """round_robin / random / prefix_overlap: the decode pick differs; threshold as the simple policy."""
    fits, note = _fitting_decodes(request, candidates, exclude)
    pick = _baseline_picker(request, config, state)
    decode = pick(fits, "decode")
    uncached, threshold = request.uncached_tokens(decode), config.disagg_threshold_tokens
    prefix = f"{config.policy}: "
    if uncached <= threshold:
        return _local(decode, request, f"{prefix}{uncached} uncached prompt tokens <= threshold {threshold}{note}")
    prefills, why_not = _usable_prefills(candidates, config, exclude, request)
    if not prefills:
        return _local(decode, request, f"{prefix}{why_not}{note}")
    prefill = pick(prefills, "prefill")
    return RouteDecision(
        kind=RouteKind.REMOTE, decode_id=decode.worker_id, prefill_id=prefill.worker_id,
        reason=f"{prefix}{uncached} uncached prompt tokens > threshold {threshold}{note}",
        decode_cached_tokens=request.cached_tokens(decode), computed_tokens=request.uncached_tokens(prefill),
    )


def _baseline_picker(
    request: RouteRequest, config: PolicyConfig, state: RoutingState
) -> Callable[[Sequence[Candidate], str], Candidate]:
    def round_robin(pool: Sequence[Candidate], role: str) -> Candidate:
        ordered = sorted(pool, key=lambda c: c.worker_id)
        index = state.next_index.get(role, 0)
        state.next_index[role] = index + 1
        return ordered[index % len(ordered)]

    def uniform(pool: Sequence[Candidate], role: str) -> Candidate:
        return state.rng.choice(sorted(pool, key=lambda c: c.worker_id))

    def prefix_overlap(pool: Sequence[Candidate], role: str) -> Candidate:
        def score(c: Candidate) -> tuple[float, str]:
            prefill_blocks = request.blocks_for(request.uncached_tokens(c))
            if role == "decode":
                active_blocks = c.info.total_blocks - c.free_blocks
            else:
                active_blocks = request.blocks_for(c.queued_prefill_tokens)
            return config.overlap_weight * prefill_blocks + active_blocks, c.worker_id

        return min(pool, key=score)

    return {"round_robin": round_robin, "random": uniform, "prefix_overlap": prefix_overlap}[config.policy]


def _fitting_decodes(
    request: RouteRequest, candidates: Sequence[Candidate], exclude: Collection[str]
) -> tuple[list[Candidate], str]:
    """Decode workers whose free blocks hold the request; when none, the one it queues on and a note."""
    pool = _eligible(candidates, "decode", exclude)
    fits = [c for c in pool if c.free_blocks >= request.blocks_to_admit - c.cached_blocks]
    if fits:
        return fits, ""
    decode, note = pick_decode(request, candidates, exclude)  # raises when none could ever hold it
    return [decode], note


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
    candidates: Sequence[Candidate], config: PolicyConfig, exclude: Collection[str] = (),
    request: RouteRequest | None = None,
) -> tuple[Candidate | None, str]:
    """Fewest queued prefill tokens; ties: more cached, then id. ``(None, reason)`` when none fits."""
    pool, why_not = _usable_prefills(candidates, config, exclude, request)
    return (min(pool, key=_prefill_key), "") if pool else (None, why_not)


def _usable_prefills(
    candidates: Sequence[Candidate], config: PolicyConfig, exclude: Collection[str],
    request: RouteRequest | None = None,
) -> tuple[list[Candidate], str]:
    """Prefill workers that may take the request, or ``([], why none)``."""
    if request is not None and request.num_resumed_outputs:
        return [], f"resumes after {request.num_resumed_outputs} outputs: only a decode worker can"
    pool = _eligible(candidates, "prefill", exclude)
    if not pool:
        return [], "no prefill workers"
    limit = config.max_queued_prefill_tokens
    if limit is not None:
        pool = [c for c in pool if c.queued_prefill_tokens <= limit]
        if not pool:
            return [], f"prefill pool saturated (every worker queues > {limit} tokens)"
    return pool, ""


def _eligible(candidates: Sequence[Candidate], role: str, exclude: Collection[str]) -> list[Candidate]:
    return [c for c in candidates if c.info.role == role and not c.draining and c.worker_id not in exclude]


def _decode_key(c: Candidate) -> tuple[int, int, str]:
    return c.num_active, -c.cached_blocks, c.worker_id


def _prefill_key(c: Candidate) -> tuple[int, int, str]:
    return c.queued_prefill_tokens, -c.cached_blocks, c.worker_id


def _local(decode: Candidate, request: RouteRequest, reason: str) -> RouteDecision:
    return RouteDecision(
        kind=RouteKind.LOCAL, decode_id=decode.worker_id, prefill_id=None, reason=reason,
        decode_cached_tokens=request.cached_tokens(decode), computed_tokens=request.uncached_tokens(decode),
    )


def _no_workers_message(role: str, candidates: Sequence[Candidate], exclude: Collection[str]) -> str:
    same_role = [c for c in candidates if c.info.role == role]
    draining = sum(c.draining for c in same_role)
    failed = sum(c.worker_id in exclude for c in same_role)
    details = [f"{n} {what}" for n, what in ((draining, "draining"), (failed, "failed")) if n]
    suffix = f" ({', '.join(details)})" if details else " registered"
    return f"no {role} workers{suffix}"
