"""Pre-selection (issue 23, item 4): in a large pool only the prefix holders, the least loaded and a few sampled
workers are priced. The decision is the one pricing everyone gives whenever the cheapest decode worker, the one
chosen and each priced decode worker's best prefill partner are in the set (random small clusters); the least
loaded are exactly the least loaded by the load ``Candidate`` reads (reports and this router's books); and at
1,000 workers the cost model prices a handful, not everyone."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.workers import WorkerInfo, WorkerLoad
from router.errors import WorkerUnavailable
from router.routing import cost_model
from router.routing.cost_model import CostConfig
from router.routing.directory import Snapshot
from router.routing.in_progress import InflightPrefills
from router.routing.index_mirror import IndexMirror
from router.routing.policy import Candidate, PolicyConfig, RouteRequest, RoutingState, route
from router.routing.preselect import Books, PoolView, PreselectConfig, _EffectiveLoad
from router.routing.rates import Rates

BLOCK_SIZE = 16
LAYOUT = ('{"model_fingerprint": "' + "ab" * 16 + '", "dtype": "bfloat16", "block_size": 16, "num_layers": 32, '
          '"num_kv_heads": 8, "head_dim": 128}')
EVERYONE = PolicyConfig(cost=CostConfig(power_of_two_above=10**6))  # the reference: every fitting decode priced
CHAIN = [bytes([i % 256, i // 256]) * 8 for i in range(64)]  # a 1,024-token prompt's chain


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def cluster(rng: random.Random, num_prefill: int, num_decode: int, *, draining: frozenset[str] = frozenset()
            ) -> Snapshot:
    entries = []
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(count):
            info = WorkerInfo(worker_id=f"{role[0]}{i}", role=role, grpc_address=f"h{i}:1", kv_uri=f"tcp://h{i}:2",
                              model_fingerprint="ab" * 16, layout_json=LAYOUT, total_blocks=4096)
            load = WorkerLoad(running=rng.randint(0, 40) if role == "decode" else rng.randint(0, 2),
                              waiting=rng.randint(0, 3), free_blocks=rng.randint(200, 4096),
                              queued_prefill_tokens=rng.choice([0, 0, rng.randint(0, 20_000)]),
                              prefill_tokens_per_s=10_000.0, decode_step_s=0.02)
            entries.append((info, load))
    return Snapshot(workers=tuple(entries), draining=draining, taken_at_s=0.0)


def books_for(rng: random.Random, snapshot: Snapshot, clock: Clock) -> Books:
    """This router's books: requests in flight on some decode workers, prompts sent to some workers to compute."""
    prefills = InflightPrefills(clock=clock)
    inflight = {}
    for info, _ in snapshot.workers:
        if rng.random() < 0.3:
            if info.role == "decode":
                inflight[info.worker_id] = rng.randint(1, 60)
            prefills.add(info.worker_id, f"r-{info.worker_id}", rng.randint(100, 30_000))
    return Books(inflight, prefills, {}, Rates(clock=clock))


def fill_index(rng: random.Random, snapshot: Snapshot) -> IndexMirror:
    mirror = IndexMirror()
    for info, _ in snapshot.workers:
        if rng.random() < 0.4:
            mirror.store(info.worker_id, CHAIN[: rng.randint(1, len(CHAIN))])
    return mirror


def best_remote_partner(request: RouteRequest, candidates: list[Candidate], decode: Candidate,
                        rates: Rates) -> str | None:
    prefills = [c for c in candidates if c.info.role == "prefill" and not c.draining]
    if not prefills:
        return None
    quotes = cost_model.quote_prefills(request, prefills, rates, EVERYONE.cost)
    return cost_model.remote_plan(request, quotes, decode, rates, EVERYONE.cost).prefill_id


def full_pricing_needs(request: RouteRequest, candidates: list[Candidate], rates: Rates) -> set[str]:
    """What the pre-selected set must hold for its decision to be the full one: the cheapest decode worker, each
    decode worker's best prefill partner, and the longest prefix's holder (the import source)."""
    fits = [c for c in candidates if c.info.role == "decode" and c.free_blocks >= request.blocks_to_admit
            - c.cached_blocks]
    quotes = cost_model.quote_prefills(request, [c for c in candidates if c.info.role == "prefill"], rates,
                                       EVERYONE.cost)
    source = cost_model.prefix_source(request, candidates)
    priced = [cost_model.price_decode(request, d, quotes, rates, EVERYONE.cost, source=source,
                                      floor_tokens=EVERYONE.disagg_threshold_tokens) for d in fits]
    cheapest = min(priced, key=lambda p: (p.cost_s, p.decode.worker_id))
    chosen = cost_model.choose(priced, EVERYONE.cost, random.Random(0))
    return {cheapest.decode.worker_id, chosen.decode.worker_id} | ({source.worker_id} if source else set())


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_property_the_preselected_decision_is_the_full_one_when_the_set_holds_the_optimum(seed):
    rng, clock = random.Random(seed), Clock()
    snapshot = cluster(rng, rng.randint(1, 8), rng.randint(2, 10))
    books, mirror = books_for(rng, snapshot, clock), fill_index(rng, snapshot)
    view = PoolView(snapshot)
    request = RouteRequest(num_prompt_tokens=len(CHAIN) * BLOCK_SIZE, block_size=BLOCK_SIZE, max_tokens=64)
    everyone, preselected = view.candidates(mirror.match(CHAIN), books, PreselectConfig(above=10**6), rng)
    assert not preselected and len(everyone) == len(snapshot.workers)
    few_config = PreselectConfig(above=0, holders=2, least_loaded=2, sampled=0)
    few, preselected = view.candidates(mirror.match(CHAIN), books, few_config, random.Random(0))
    assert preselected and {c.worker_id for c in few} <= {c.worker_id for c in everyone}
    by_id = {c.worker_id: c for c in everyone}
    assert all(c == by_id[c.worker_id] for c in few)  # the same figures, only fewer workers
    needs = full_pricing_needs(request, everyone, books.rates)
    partners = {best_remote_partner(request, everyone, c, books.rates) for c in few if c.info.role == "decode"}
    ids = {c.worker_id for c in few}
    full = route(request, everyone, EVERYONE, state=RoutingState.for_config(EVERYONE, seed=0))
    mine = route(request, few, EVERYONE, state=RoutingState.for_config(EVERYONE, seed=0), preselected=True)
    if needs | (partners - {None}) <= ids:
        assert (mine.decode_id, mine.prefill_id, mine.kind) == (full.decode_id, full.prefill_id, full.kind)


def test_the_condition_of_the_property_holds_often_enough_to_test_something():
    """The property above asserts only when the set holds the optimum: it must, in most random clusters."""
    held = 0
    for seed in range(200):
        rng, clock = random.Random(seed), Clock()
        snapshot = cluster(rng, rng.randint(1, 8), rng.randint(2, 10))
        books, mirror, view = books_for(rng, snapshot, clock), fill_index(rng, snapshot), PoolView(snapshot)
        request = RouteRequest(num_prompt_tokens=len(CHAIN) * BLOCK_SIZE, block_size=BLOCK_SIZE, max_tokens=64)
        everyone, _ = view.candidates(mirror.match(CHAIN), books, PreselectConfig(above=10**6), rng)
        few, _ = view.candidates(mirror.match(CHAIN), books, PreselectConfig(above=0, holders=2, least_loaded=2,
                                                                             sampled=0), rng)
        partners = {best_remote_partner(request, everyone, c, books.rates) for c in few if c.info.role == "decode"}
        held += full_pricing_needs(request, everyone, books.rates) | (partners - {None}) <= {c.worker_id for c in few}
    assert held >= 100, held


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 6))
def test_property_the_least_loaded_are_the_least_loaded_by_reports_and_books(seed, k):
    rng, clock = random.Random(seed), Clock()
    snapshot = cluster(rng, rng.randint(1, 30), rng.randint(1, 30))
    books = books_for(rng, snapshot, clock)
    clock.now_s += rng.uniform(0, 2)  # part of each prompt sent is computed by now
    everyone, _ = PoolView(snapshot).candidates(IndexMirror().match(CHAIN), books, PreselectConfig(above=10**6), rng)
    view = PoolView(snapshot)
    for role in ("decode", "prefill"):
        got = view.least_loaded(role, k, _EffectiveLoad(view, books))
        keys = {c.worker_id: (c.num_active, c.queued_prefill_tokens) if role == "decode"
                else (c.queued_prefill_tokens, c.num_active) for c in everyone if c.info.role == role}
        assert got == sorted(keys, key=lambda w: (keys[w], w))[:k]


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), holders=st.integers(0, 4), least=st.integers(1, 4))
def test_property_the_preselected_set_is_the_pending_the_deepest_and_the_least_loaded(seed, holders, least):
    """What the module's docs promise, unconditionally: with nothing sampled, the set priced is exactly every
    worker computing a prefix of the prompt for this router, then per role the ``holders`` deepest prefix holders
    (ties: the least loaded, then by id) and the ``least_loaded`` least loaded, read here from the figures full
    pricing gives each candidate (``tiered_blocks``, ``num_active``, ``queued_prefill_tokens``); a sampled worker
    only adds to it."""
    rng, clock = random.Random(seed), Clock()
    snapshot = cluster(rng, rng.randint(1, 12), rng.randint(1, 12))
    books, mirror = books_for(rng, snapshot, clock), IndexMirror()
    for info, _ in snapshot.workers:  # few depths: holders tie, and the least loaded of a tie must be taken
        if rng.random() < 0.5:
            mirror.store(info.worker_id, CHAIN[: rng.choice([8, 32, 64])])
    books.pending = {info.worker_id: rng.randint(1, 8) for info, _ in snapshot.workers if rng.random() < 0.15}
    view, match = PoolView(snapshot), mirror.match(CHAIN)
    everyone, _ = view.candidates(match, books, None, rng)
    expected = set(books.pending)
    for role in ("decode", "prefill"):
        mine = [c for c in everyone if c.info.role == role]
        load = {c.worker_id: (c.num_active, c.queued_prefill_tokens) if role == "decode"
                else (c.queued_prefill_tokens, c.num_active) for c in mine}
        expected.update(sorted(load, key=lambda w: (load[w], w))[:least])
        deep = [c.worker_id for c in mine if c.tiered_blocks > 0]
        by_depth = {c.worker_id: c.tiered_blocks for c in mine}
        expected.update(sorted(deep, key=lambda w: (-by_depth[w], load[w], w))[:holders])
    config = PreselectConfig(above=0, holders=holders, least_loaded=least, sampled=0)
    assert view.preselect(match, books, config, random.Random(0)) == expected
    sampled = view.preselect(match, books, PreselectConfig(above=0, holders=holders, least_loaded=least, sampled=1),
                             random.Random(seed))
    assert sampled is not None and expected <= sampled and len(sampled - expected) <= 2  # one per role at most


def test_a_thousand_workers_price_a_handful(monkeypatch):
    """500 prefill + 500 decode workers, a system prompt every worker holds and a conversation three hold: the
    cost model quotes and prices only the pre-selected few, the deepest holders among them, and decides."""
    rng = random.Random(7)
    snapshot = cluster(rng, 500, 500)
    mirror = IndexMirror()
    for info, _ in snapshot.workers:
        mirror.store(info.worker_id, CHAIN[:8])  # the system prompt
    for worker_id in ("d17", "d400", "p3"):
        mirror.store(worker_id, CHAIN)
    books = Books({}, InflightPrefills(), {"d9": 4}, Rates())  # d9 is computing 4 blocks of it for this router
    priced, quoted = [], []
    real_price, real_quote = cost_model.price_decode, cost_model.quote_prefills
    monkeypatch.setattr(cost_model, "price_decode", lambda r, d, *a, **kw: priced.append(d.worker_id) or
                        real_price(r, d, *a, **kw))
    monkeypatch.setattr(cost_model, "quote_prefills", lambda r, p, *a, **kw: quoted.extend(c.worker_id for c in p)
                        or real_quote(r, p, *a, **kw))
    config = PreselectConfig()
    candidates, preselected = PoolView(snapshot).candidates(mirror.match(CHAIN), books, config, random.Random(0))
    request = RouteRequest(num_prompt_tokens=len(CHAIN) * BLOCK_SIZE, block_size=BLOCK_SIZE)
    decision = route(request, candidates, PolicyConfig(), state=RoutingState.for_config(PolicyConfig(), seed=0),
                     preselected=preselected)
    per_role = config.holders + config.least_loaded + config.sampled
    assert preselected and 0 < len(priced) <= per_role + 1 and 0 < len(quoted) <= per_role
    assert {"d17", "d400", "d9"} <= set(priced) and "p3" in quoted
    assert {c.worker_id: c.cached_blocks for c in candidates}["d17"] == len(CHAIN)
    assert decision.decode_id in priced


def test_a_large_group_of_holders_gives_its_least_loaded():
    rng = random.Random(3)
    snapshot = cluster(rng, 100, 100)
    mirror = IndexMirror()
    for info, _ in snapshot.workers:
        mirror.store(info.worker_id, CHAIN[:8])
    view, books = PoolView(snapshot), Books({}, InflightPrefills(), {}, Rates())
    config = PreselectConfig(above=0, holders=3, least_loaded=1, sampled=0, large_group=16)
    chosen = view.preselect(mirror.match(CHAIN), books, config, rng)
    assert chosen is not None
    loads = {info.worker_id: (load.running + load.waiting, load.queued_prefill_tokens) for info, load in
             snapshot.workers if info.role == "decode"}
    least = sorted(loads, key=lambda w: (loads[w], w))[:3]
    assert set(least) <= chosen and len([w for w in chosen if w.startswith("d")]) == 3


def test_at_most_above_workers_everyone_is_priced_and_with_no_routable_decode_too():
    rng = random.Random(1)
    snapshot = cluster(rng, 4, 4)
    books = Books({}, InflightPrefills(), {}, Rates())
    candidates, preselected = PoolView(snapshot).candidates(IndexMirror().match(CHAIN), books, PreselectConfig(),
                                                            rng)
    assert not preselected and len(candidates) == 8
    draining = cluster(rng, 100, 4, draining=frozenset({"d0", "d1", "d2", "d3"}))
    candidates, preselected = PoolView(draining).candidates(IndexMirror().match(CHAIN), books,
                                                            PreselectConfig(above=10), rng)
    assert not preselected and len(candidates) == 104  # everyone: the error names the draining ones
    request = RouteRequest(num_prompt_tokens=100, block_size=BLOCK_SIZE)
    with pytest.raises(WorkerUnavailable, match="4 draining"):
        route(request, candidates, PolicyConfig(), preselected=preselected)


def test_a_view_updated_with_new_loads_ranks_as_a_fresh_one():
    rng = random.Random(5)
    snapshot = cluster(rng, 40, 40, draining=frozenset({"d3", "p7"}))
    view = PoolView(snapshot)
    workers = list(snapshot.workers)
    changed = set()
    for _ in range(30):
        i = rng.randrange(len(workers))
        info, _ = workers[i]
        workers[i] = (info, WorkerLoad(running=rng.randint(0, 40), waiting=0, free_blocks=1000,
                                       queued_prefill_tokens=rng.randint(0, 9000)))
        changed.add(info.worker_id)
    later = Snapshot(workers=tuple(workers), draining=snapshot.draining, taken_at_s=1.0)
    view.update(later, changed)
    fresh = PoolView(later)
    assert view._ranked == fresh._ranked and view._entry == fresh._entry  # noqa: SLF001
    books = Books({}, InflightPrefills(), {}, Rates())
    config = PreselectConfig(above=0)
    assert view.preselect(IndexMirror().match(CHAIN), books, config, random.Random(1)) == \
        fresh.preselect(IndexMirror().match(CHAIN), books, config, random.Random(1))


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_loaded", "prefix_overlap"])
def test_the_baselines_still_choose_among_every_worker(policy):
    from router.routing.preselect import preselect_for

    rng = random.Random(2)
    snapshot = cluster(rng, 100, 100)
    config = preselect_for(PolicyConfig(policy=policy), PreselectConfig())
    candidates, preselected = PoolView(snapshot).candidates(IndexMirror().match(CHAIN), Books(
        {}, InflightPrefills(), {}, Rates()), config, rng)
    assert config is None and not preselected and len(candidates) == 200
    assert preselect_for(PolicyConfig(), PreselectConfig()) == PreselectConfig()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_property_the_redis_answer_preselects_as_the_mirrors(seed):
    """While the mirror is not in sync the directory hands pre-selection the Redis script's ``TieredLookup``
    (``TieredMatch``): the same workers are pre-selected, with the same prefix counts."""
    from router.routing.chain_match import TieredMatch

    rng, clock = random.Random(seed), Clock()
    snapshot = cluster(rng, rng.randint(20, 60), rng.randint(20, 60))
    books, mirror, view = books_for(rng, snapshot, clock), fill_index(rng, snapshot), PoolView(snapshot)
    config = PreselectConfig(above=0, holders=3, least_loaded=2, sampled=1, large_group=rng.choice([4, 64]))
    match = mirror.match(CHAIN)
    tiered = TieredMatch(match.to_tiered())
    assert view.preselect(match, books, config, random.Random(seed)) == \
        view.preselect(tiered, books, config, random.Random(seed))
    assert view.candidates(match, books, config, random.Random(1)) == \
        view.candidates(tiered, books, config, random.Random(1))
