"""The router, simulated: Baton's own routing objects, fed as ``router/relay.py`` feeds them.

Everything that decides is the real code, imported: ``router.routing.policy.route`` (the cost model of
``cost_model`` and the baselines), ``Rates`` (learned on the simulated clock), ``InflightPrefills`` and
``PendingPrefixes`` (the in-progress books), the in-flight counter, ``PoolView`` (the directory's pure part:
``served_scheme``, ``build_candidates`` and pre-selection at scale) and ``IndexMirror`` (the router's in-memory
KV index, which the modelled workers' block events fill). What this module re-does is the relay's glue, since the
relay itself is gRPC: each method names the relay lines it stands for, with the same arguments (``_Flow._route``,
``_prefill``, ``_on_prefilled``, ``_on_decode_progress``, ``_learn_overhead``, ``_cleanup``). Pure: no I/O, the
clock is injected.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kv_transfer.hashing import BlockHash
from kv_transfer.workers import WorkerInfo, WorkerLoad
from router.routing.cost_model import used_kv_blocks
from router.routing.directory import HashScheme, Snapshot, served_scheme
from router.routing.in_progress import InflightPrefills, PendingPrefixes
from router.routing.index_mirror import IndexMirror
from router.routing.preselect import Books, PoolView, PreselectConfig, preselect_for
from router.routing.policy import PolicyConfig, RouteDecision, RouteKind, RouteRequest, RoutingState, route
from router.routing.rates import Rates


@dataclass(slots=True)
class Routed:
    """What the relay's ``_Flow`` keeps of a request between its stages."""

    request_id: str
    decision: RouteDecision
    route_request: RouteRequest
    hashes: Sequence[BlockHash]
    routed_s: float
    decode_active: int  # the chosen decode candidate's num_active, as priced
    decode_used_blocks: int  # and its used KV blocks

    @property
    def computed_tokens(self) -> int:
        n = self.decision.computed_tokens
        return self.route_request.num_prompt_tokens if n is None else n


class SimRouter:
    def __init__(self, policy: PolicyConfig, workers: Sequence[WorkerInfo], *, clock: Callable[[], float],
                 seed: int, preselect: PreselectConfig | None = None) -> None:
        self.policy = policy
        self.preselect = preselect_for(policy, preselect if preselect is not None else PreselectConfig())
        self.routing = RoutingState(rates=Rates(policy.rates, clock=clock), rng=random.Random(seed))
        self.inflight: Counter[str] = Counter()
        self.inflight_prefills = InflightPrefills(clock=clock)
        self.pending_prefixes = PendingPrefixes(clock=clock)
        self.index = IndexMirror()
        self._clock = clock
        self._entries: dict[str, tuple[WorkerInfo, WorkerLoad | None]] = {w.worker_id: (w, None) for w in workers}
        self._draining: set[str] = set()
        self._snapshot: Snapshot | None = None
        self._view: PoolView | None = None
        self._reported: set[str] = set()  # workers whose load changed since the view was last brought up to date
        self._scheme: HashScheme | None = served_scheme(tuple(self._entries.values()))
        # wall time of each decision (index lookup, candidates, books, route()) and of route() alone: the real
        # router's cost per request at this scale
        self.decision_s: list[float] = []
        self.policy_s: list[float] = []
        self._pairs: set[tuple[str, str]] = set()  # (source, decode) pairs that moved KV

    # ---- what the workers tell it -------------------------------------------------------------
    def report(self, worker_id: str, load: WorkerLoad) -> None:
        """A heartbeat (``{ns}:load:{id}``)."""
        self._entries[worker_id] = (self._entries[worker_id][0], load)
        self._snapshot = None
        self._reported.add(worker_id)

    # ---- the registry's membership: a worker registers, drains, leaves (its index entries pruned) --------------
    def add(self, info: WorkerInfo, load: WorkerLoad) -> None:
        self._entries[info.worker_id] = (info, load)
        self._membership_changed()

    def drain(self, worker_id: str) -> None:
        self._draining.add(worker_id)
        self._membership_changed()

    def remove(self, worker_id: str) -> None:
        del self._entries[worker_id]
        self._draining.discard(worker_id)
        self.index.drop(worker_id)
        self._membership_changed()

    def idle(self, worker_id: str) -> bool:
        """No request this router sent there is in flight."""
        return not self.inflight.get(worker_id) and worker_id not in self.inflight_prefills

    def _membership_changed(self) -> None:
        self._snapshot, self._view = None, None  # a fresh view: PoolView.update keeps the same workers only
        self._reported.clear()

    def snapshot(self) -> Snapshot:
        if self._snapshot is None:
            self._snapshot = Snapshot(workers=tuple(self._entries.values()), draining=frozenset(self._draining),
                                      taken_at_s=self._clock())
        return self._snapshot

    def pool_view(self) -> PoolView:
        """The relay's ``Relay.pool_view``: the snapshot's workers ranked by load. The relay builds one per
        listing (every 0.5 s); here every heartbeat makes a new snapshot, so the view moves the workers that
        reported since the last decision (the same ranking a fresh view would build, without the sort)."""
        snapshot = self.snapshot()
        if self._view is None:
            self._view = PoolView(snapshot)
        elif self._view.snapshot is not snapshot:
            self._view.update(snapshot, self._reported)
        self._reported.clear()
        return self._view

    # ---- relay: _Flow._route (and _prefill's / _count_local_prefill's in-flight books) --------
    def route(self, request_id: str, hashes: Sequence[BlockHash], num_prompt_tokens: int,
              max_tokens: int) -> Routed:
        """Raises ``WorkerUnavailable`` / ``CapacityExceeded`` as the relay's routing stage does."""
        started = time.perf_counter()
        view, scheme = self.pool_view(), self.scheme
        books = Books(self.inflight, self.inflight_prefills, self.pending_prefixes.lookup(hashes), self.routing.rates)
        candidates, preselected = view.candidates(self.index.match(hashes), books, self.preselect, self.routing.rng)
        request = RouteRequest(num_prompt_tokens=num_prompt_tokens, block_size=scheme.block_size,
                               max_tokens=max_tokens)
        routing = time.perf_counter()
        decision = route(request, candidates, self.policy, state=self.routing, preselected=preselected)
        ended = time.perf_counter()
        self.decision_s.append(ended - started)
        self.policy_s.append(ended - routing)
        decode = next(c for c in candidates if c.worker_id == decision.decode_id)
        routed = Routed(request_id, decision, request, hashes, self._clock(), decode.num_active,
                        used_kv_blocks(decode))
        self.inflight[decision.decode_id] += 1
        self.pending_prefixes.add(request_id, decision.prefill_id or decision.decode_id, hashes)
        computing = decision.prefill_id if decision.kind is RouteKind.REMOTE else decision.decode_id
        self.inflight_prefills.add(computing, request_id, routed.computed_tokens)
        return routed

    # ---- relay: _prefill's finally + _on_prefilled ---------------------------------------------
    def prefill_answered(self, routed: Routed, *, computed_tokens: int, prefill_ms: float) -> None:
        """P answered: its prompt leaves P's queue; P's rate is learned from the call's time (queue included,
        as ``Timings.prefill_ms`` is measured by P's servicer)."""
        prefill_id = routed.decision.prefill_id or ""
        self.inflight_prefills.remove(prefill_id, routed.request_id)
        self.routing.rates.observe_prefill(prefill_id, computed_tokens, prefill_ms)

    # ---- relay: _on_decode_progress ----------------------------------------------------------
    def decode_answered(self, routed: Routed, *, local: bool) -> None:
        """D's first answer with tokens: a local prefill leaves D's queue; D holds the prompt's blocks now."""
        if local:
            self.inflight_prefills.remove(routed.decision.decode_id, routed.request_id)
        self.pending_prefixes.settle(routed.request_id, also=[routed.decision.decode_id])

    def transfer(self, source_id: str, decode_id: str, *, num_bytes: int, transfer_ms: float,
                 num_blocks: int) -> None:
        self._pairs.add((source_id, decode_id))
        self.routing.rates.observe_transfer(source_id, decode_id, num_bytes, transfer_ms,
                                            num_tokens=num_blocks * self.scheme.block_size)

    # ---- relay: _learn_overhead + _cleanup ----------------------------------------------------
    def finished(self, routed: Routed, *, ttft_s: float | None, prefill_ms: float, queue_ms: float,
                 cached_tokens: int, decode_tokens_per_s: float, same_route: bool) -> None:
        """The request ended. ``same_route``: it ran as decided (a fallback's figures teach nothing)."""
        decision, request, rates = routed.decision, routed.route_request, self.routing.rates
        if ttft_s is not None and same_route:
            rates.observe_ttft(decision.kind.value, ttft_s, prefill_ms * 1e-3)
            if decision.kind is RouteKind.LOCAL:
                computed = request.num_prompt_tokens - cached_tokens
                rates.observe_prefill(decision.decode_id, computed, prefill_ms - queue_ms, on_decode=True)
            if decode_tokens_per_s > 0:
                rates.observe_decode(decision.decode_id, routed.decode_active + 1, decode_tokens_per_s,
                                     routed.decode_used_blocks + request.blocks_to_admit)
        self.inflight_prefills.remove(decision.decode_id, routed.request_id)  # _settle_local_prefill
        if decision.prefill_id is not None:
            self.inflight_prefills.remove(decision.prefill_id, routed.request_id)
        self.pending_prefixes.finish(routed.request_id)
        self.inflight[decision.decode_id] -= 1
        if self.inflight[decision.decode_id] <= 0:
            del self.inflight[decision.decode_id]

    def learned(self) -> dict[str, dict[str, float]]:
        """What the rates hold at the end (min / mean / max over workers, or over the pairs that moved KV), read
        through ``Rates``' own estimates: a worker it never measured shows its fallback (report, peers, default)."""
        rates = self.routing.rates
        roles = {role: [w for w, (info, _) in self._entries.items() if info.role == role]
                 for role in ("prefill", "decode")}
        return {
            "prefill_tokens_per_s": _spread([rates.prefill_tokens_per_s(w, None) for w in roles["prefill"]]),
            "local_prefill_tokens_per_s": _spread([rates.prefill_tokens_per_s(w, None, on_decode=True)
                                                   for w in roles["decode"]]),
            "link_gb_per_s": _spread([rates.link_gb_per_s(a, b) for a, b in sorted(self._pairs)]),
            "overhead_ms": {kind: rates.overhead_s(kind) * 1e3 for kind in ("remote", "local")},
        }

    @property
    def scheme(self) -> HashScheme:
        assert self._scheme is not None
        return self._scheme

    def books_empty(self) -> bool:
        """Nothing in flight, no prompt counted as any worker's queue, no prefix pending past its grace."""
        return not self.inflight and not self.inflight_prefills.tokens()


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values), "count": len(values)}
