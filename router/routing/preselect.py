"""Pre-selection: in a large cluster, price only the workers that can win (issue 23, item 4).

The cost model prices a worker in tens of microseconds; pricing all of 1,000 per request cannot hold a
millisecond. Which workers can be the cheapest? A worker's price falls with the prompt blocks it holds (the
index, and this router's pending prefixes) and rises with its load; so, per role, the set priced is

- every worker computing a prefix of this prompt for this router (``PendingPrefixes``: few);
- the ``holders`` deepest prefix holders (``PrefixMatch.groups``, deepest first; in a group too large to take
  whole, its least loaded members);
- the ``least_loaded`` least loaded workers by the load the cost model reads (decode: running + waiting, then
  queued prompt tokens; prefill: queued prompt tokens, then running + waiting; each the larger of the
  heartbeat's figure and this router's own books, as ``Candidate`` reads them);
- ``sampled`` more at random (a worker the rates know little about gets priced now and then).

With the cheapest worker and its best partner in that set, the decision is the one pricing everyone gives
(tests/unit/test_router_preselect.py checks this on random clusters). Not guaranteed where workers differ in
what load does not rank: a worker of another speed or link with no prefix and more load than ``least_loaded``
others (the ``sampled`` ones cover it sometimes).

Cost per decision: the ranking by *reported* load is built once per registry snapshot (``PoolView``); a
decision walks it from the least loaded, reading this router's books for the workers walked, and stops when
no later worker can be among the least loaded (a book only ever adds to a reported load). At most
``above`` workers, everyone is priced, as before. Pure logic, no I/O.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kv_transfer.workers import WorkerLoad
from router.routing.chain_match import PrefixMatch
from router.routing.directory import HashScheme, Snapshot, WorkerEntry, build_candidates, scheme_of, served_scheme
from router.routing.in_progress import PrefillBook
from router.routing.policy import Candidate, PolicyConfig
from router.routing.rates import Rates

LoadKey = tuple[int, int]
ROLES = ("decode", "prefill")


@dataclass(frozen=True, slots=True, kw_only=True)
class PreselectConfig:
    above: int = 64  # served workers up to this many: price everyone
    holders: int = 4  # per role: the deepest prefix holders priced
    least_loaded: int = 4  # per role: the least loaded priced
    sampled: int = 1  # per role: priced at random
    large_group: int = 64  # a depth group with more holders than this is searched in load order, not listed

    def __post_init__(self) -> None:
        if min(self.above, self.holders, self.least_loaded, self.sampled) < 0 or self.least_loaded < 1:
            raise ValueError(f"PreselectConfig: counts must be >= 0 and least_loaded >= 1: {self}")


def preselect_for(policy: PolicyConfig, config: PreselectConfig) -> PreselectConfig | None:
    """Pre-selection serves the cost policy; the baselines (round-robin, random, least loaded, prefix overlap)
    are benchmarks of a choice over every worker and keep it (None: price everyone)."""
    return config if policy.policy == "cost" else None


@dataclass(slots=True)
class Books:
    """What this router sent and has not seen finish (``router.relay``'s books), as pre-selection reads them; with
    several routers, the others' beside them (``router.routing.shared_books.with_others``)."""

    inflight: Mapping[str, int]  # decode worker -> requests in flight
    prefills: PrefillBook  # prompt tokens sent to compute
    pending: Mapping[str, int]  # worker -> leading blocks of this prompt it is computing (PendingPrefixes.lookup)
    rates: Rates


class PoolView:
    """The served workers of one registry snapshot, each role ranked by its reported load (built once per
    snapshot, read by every decision until the next; ``update`` re-ranks the workers whose load changed)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.scheme: HashScheme | None = served_scheme(snapshot.workers)
        served = [(i, e) for i, e in enumerate(snapshot.workers) if scheme_of(e[0]) == self.scheme]
        self._position = {info.worker_id: i for i, (info, _) in served}  # in snapshot.workers
        self._entry: dict[str, WorkerEntry] = {entry[0].worker_id: entry for _, entry in served}
        routable = [(info, load) for _, (info, load) in served if info.worker_id not in snapshot.draining]
        self._role = {info.worker_id: info.role for info, _ in routable}
        self._key = {info.worker_id: _reported_key(info.role, load) for info, load in routable}
        self._ranked: dict[str, list[tuple[LoadKey, str]]] = {
            role: sorted((self._key[w], w) for w, r in self._role.items() if r == role) for role in ROLES
        }
        self._ids: dict[str, list[str]] = {role: [w for w, r in self._role.items() if r == role] for role in ROLES}

    def __len__(self) -> int:
        """Served workers."""
        return len(self._entry)

    def update(self, snapshot: Snapshot, changed: Iterable[str]) -> None:
        """``snapshot`` lists the same workers (same order, same registrations, same draining set) with new loads
        for ``changed``: move only those in their role's ranking (a bisect and a memmove each, no sort)."""
        self.snapshot = snapshot
        for worker_id in changed:
            position = self._position.get(worker_id)
            if position is None:
                continue
            entry = snapshot.workers[position]
            assert entry[0].worker_id == worker_id, "update needs the same workers in the same order"
            self._entry[worker_id] = entry
            role = self._role.get(worker_id)
            if role is None:  # draining: not ranked
                continue
            ranked, old = self._ranked[role], (self._key[worker_id], worker_id)
            del ranked[bisect.bisect_left(ranked, old)]
            self._key[worker_id] = key = _reported_key(role, entry[1])
            bisect.insort(ranked, (key, worker_id))

    def candidates(self, match: PrefixMatch, books: Books, config: PreselectConfig | None,
                   rng: random.Random) -> tuple[list[Candidate], bool]:
        """The candidates to price and whether they were pre-selected (False: every served worker, as always
        with ``config`` None)."""
        assert self.scheme is not None
        chosen = None
        if config is not None and len(self) > config.above:
            chosen = self.preselect(match, books, config, rng)
        if chosen is None:
            tiered = match.to_tiered()
            backlogs = books.prefills.backlogs(self.snapshot.workers, books.rates)
            return build_candidates(self.snapshot, self.scheme, tiered.gpu, books.inflight, backlogs, books.pending,
                                    tiered.gpu_or_cpu), False
        workers = [self._entry[w] for w in sorted(chosen, key=self._position.__getitem__)]
        depths = {info.worker_id: match.depths(info.worker_id) for info, _ in workers}
        cached = {w: gpu for w, (gpu, _) in depths.items() if gpu}
        tiered = {w: local for w, (_, local) in depths.items() if local}
        backlogs = books.prefills.backlogs(workers, books.rates)
        return build_candidates(self.snapshot, self.scheme, cached, books.inflight, backlogs, books.pending, tiered,
                                workers=workers), True

    def preselect(self, match: PrefixMatch, books: Books, config: PreselectConfig,
                  rng: random.Random) -> set[str] | None:
        """The worker ids to price, or None when no decode worker could be chosen from them (then everyone is
        priced: the no-worker and capacity errors name the whole pool)."""
        effective = _EffectiveLoad(self, books)
        chosen: set[str] = {w for w in books.pending if w in self._role}
        for role in ROLES:
            chosen.update(self._deepest(role, match, config, effective))
            chosen.update(self.least_loaded(role, config.least_loaded, effective))
            ids = self._ids[role]
            chosen.update(rng.sample(ids, min(config.sampled, len(ids))))
        if not any(self._role[w] == "decode" for w in chosen):
            return None
        return chosen

    def least_loaded(self, role: str, k: int, effective: Callable[[str], LoadKey],
                     accept: Callable[[str], bool] | None = None) -> list[str]:
        """The ``k`` least loaded of ``role`` (that ``accept`` takes) by effective load, ties by id. Walks the
        reported ranking and stops where the next reported load exceeds the k-th effective one found."""
        top: list[tuple[LoadKey, str]] = []
        for reported in self._ranked[role]:
            if len(top) == k and reported > top[-1]:
                break
            worker_id = reported[1]
            if accept is not None and not accept(worker_id):
                continue
            bisect.insort(top, (effective(worker_id), worker_id))
            del top[k:]
        return [w for _, w in top]

    def _deepest(self, role: str, match: PrefixMatch, config: PreselectConfig,
                 effective: Callable[[str], LoadKey]) -> list[str]:
        """Up to ``config.holders`` holders of ``role``, deepest prefix first; of the group that does not fit
        whole, its least loaded. A group of more than ``config.large_group`` is searched in load order (its
        holders are not listed); groups are listed up to ``4 * large_group`` holders in all."""
        out: list[str] = []
        listed = 0
        for _, group in match.groups():
            room = config.holders - len(out)
            if room <= 0 or listed > 4 * config.large_group:
                break
            if len(group) > config.large_group:
                out += self.least_loaded(role, room, effective, group.__contains__)
                continue
            mine = [w for w in group if self._role.get(w) == role]
            listed += len(group)
            if len(mine) > room:
                mine = sorted(mine, key=lambda w: (effective(w), w))[:room]
            out += mine
        return out


class _EffectiveLoad:
    """A worker's load as ``Candidate`` reads it: the heartbeat's figures or this router's books, the larger;
    memoized for one decision."""

    def __init__(self, view: PoolView, books: Books) -> None:
        self._view, self._books, self._memo = view, books, {}

    def __call__(self, worker_id: str) -> LoadKey:
        key = self._memo.get(worker_id)
        if key is None:
            info, load = self._view._entry[worker_id]  # noqa: SLF001 - one module's pair
            books = self._books
            queued = 0 if load is None else load.queued_prefill_tokens
            if worker_id in books.prefills:
                rate = books.rates.prefill_tokens_per_s(worker_id, load, on_decode=info.role == "decode")
                queued = max(queued, books.prefills.backlog(worker_id, rate))
            active = max(0 if load is None else load.running + load.waiting, books.inflight.get(worker_id, 0))
            key = self._memo[worker_id] = (active, queued) if info.role == "decode" else (queued, active)
        return key


def _reported_key(role: str, load: WorkerLoad | None) -> LoadKey:
    """The heartbeat's part of ``_EffectiveLoad`` (never above it: the ranking's walk stops on that)."""
    active = 0 if load is None else load.running + load.waiting
    queued = 0 if load is None else load.queued_prefill_tokens
    return (active, queued) if role == "decode" else (queued, active)
