"""The cost policy and the baselines on hand-built pool states: exact choices, reasons and predictions.

Defaults priced with (RatesConfig / CostConfig): prefill 10,000 tok/s on P and 5,000 tok/s on D, decode step
0.010 s + 0.0005 s per sequence, link 10 GB/s, 131,072 KV bytes per token (the test layouts carry only the
block size), 64 decode steps (a request without max_tokens), ITL target 0.100 s, 512-token prefill chunks, a local
prefill's stall of D's running sequences weighted 1 (``running x uncached / 5,000``). The hand-computed
figures leave out the fixed per-route overhead and the KV-usage term of a decode step (``BASE`` zeroes
them); their own tests below price them. ``COST`` turns cross-worker prefix import off, so a worker lacking a
prefix recomputes it as the hand-computed figures say; the import's own tests turn it on.
"""

from __future__ import annotations

from dataclasses import replace

import dataclasses
import random

import pytest

from kv_transfer.workers import WorkerLoad
from router.routing.cost_model import CostConfig, decode_steps, local_plan, sample_decodes
from router.routing.policy import Candidate, PolicyConfig, RouteKind, RoutingState, route
from router.routing.rates import Rates, RatesConfig
from tests.unit.test_router_policy import req, worker

BASE = RatesConfig(remote_overhead_s=0.0, local_overhead_s=0.0, decode_step_per_kv_block_s=0.0)
COST = PolicyConfig(disagg_threshold_tokens=64, rates=BASE, cost=CostConfig(prefix_import=False))


def state(seed: int = 0, rates: Rates | None = None) -> RoutingState:
    return RoutingState(rates=rates or Rates(BASE), rng=random.Random(seed))


def with_cost(**changes: object) -> PolicyConfig:
    return dataclasses.replace(COST, cost=dataclasses.replace(COST.cost, **changes))


def test_cost_is_the_default_policy():
    assert PolicyConfig().policy == "cost"
    with pytest.raises(ValueError, match="policy must be one of"):
        PolicyConfig(policy="fastest")  # type: ignore[arg-type]


def test_long_shared_prefix_wins_despite_slightly_higher_load():
    # 2,000 tokens; d0 holds 100 blocks (1,600 tokens) and runs one more sequence than d1.
    # d0 local: 400/5000 + 1 chunk x 0.011 = 0.091 s (itl 0.091 < 0.1), but it stalls d0's 2 running
    #   sequences 400/5000 s each: 0.091 + 0.16 = 0.251; d0 remote: 0.2 + 400 x 131072 / 1e10 = 0.20524 wins.
    #   cost 0.20524 + 64 x 0.0115 = 0.94124
    # d1: local would push itl to 0.1129 > 0.1, remote 0.2 + 2000 x 131072 / 1e10 = 0.2262; cost 0.9302,
    #   1.2% below d0's: a near tie, won by the cached prefix (d0 pulls only the 400 uncached tokens' KV).
    cands = [worker("d0", running=2, cached=100, total=300, free=200), worker("d1", running=1, total=300, free=200),
             worker("p0", "prefill", total=300, free=300)]
    decision = route(req(2000), cands, COST, state=state())
    assert (decision.kind, decision.decode_id, decision.prefill_id) == (RouteKind.REMOTE, "d0", "p0")
    assert decision.predicted_ttft_s == pytest.approx(0.2 + 400 * 131072 / 1e10)
    assert decision.decode_cached_tokens == 1600
    assert decision.reason.startswith("cost: 1600 of 2000 prompt tokens cached on d0 (next: d1 cost 0.9302 s = "
                                      "ttft 0.2262 + stall 0.0000 + itl 0.0110, 0 cached); d0: cost 0.9412 s = "
                                      "ttft 0.2052 + stall 0.0000 + 64 x itl 0.0115; ")
    assert "local 0.0910 s = " in decision.reason and "(itl 0.0910, stall of running 0.1600)" in decision.reason
    assert decision.reason.endswith(
        "remote predicts the lower ttft + stall; 400 uncached prompt tokens > threshold 64")
    blind = route(req(2000), cands, with_cost(interference_weight=0.0), state=state())  # the stall unpriced
    assert (blind.kind, blind.decode_id, blind.predicted_ttft_s) == (RouteKind.LOCAL, "d0", pytest.approx(0.091))
    least_loaded = dataclasses.replace(COST, policy="least_loaded")
    assert route(req(2000), cands, least_loaded).decode_id == "d1"  # the simple policy ignores the prefix


def test_near_tie_goes_to_the_cached_prefix_and_a_clear_win_does_not():
    # 200 tokens, both remote-prefilled (0.0266 s). A stale report has d0 (the holder of 12 blocks) one
    # sequence busier: cost 0.0266 - small transfer saving + 64 x 0.0110 vs d1's 64 x 0.0105, ~4.5% apart.
    cands = [worker("d0", running=1, cached=12), worker("d1"), worker("p0", "prefill")]
    assert route(req(200), cands, COST, state=state()).decode_id == "d0"
    assert route(req(200), cands, with_cost(affinity_tolerance=0.0), state=state()).decode_id == "d1"
    busy = [worker("d0", running=40, cached=12), worker("d1"), worker("p0", "prefill")]
    assert route(req(200), busy, COST, state=state()).decode_id == "d1"  # 40 sequences: not a near tie
    with pytest.raises(ValueError):
        CostConfig(affinity_tolerance=-0.1)


def test_saturated_prefill_pool_sends_short_and_medium_prompts_local():
    idle = [worker("d0"), worker("p0", "prefill")]
    decision = route(req(300), idle, COST, state=state())
    # remote 300/10000 + 300 x 131072 / 1e10 = 0.0339 s beats local 300/5000 = 0.06 s
    assert (decision.kind, decision.prefill_id, decision.computed_tokens) == (RouteKind.REMOTE, "p0", 300)
    assert decision.predicted_ttft_s == pytest.approx(0.03 + 300 * 131072 / 1e10)
    assert decision.reason.endswith(
        "remote predicts the lower ttft + stall; 300 uncached prompt tokens > threshold 64")
    saturated = [worker("d0"), worker("p0", "prefill", queued=1_000_000)]  # 100 s of queue
    for num_tokens in (100, 300, 1000):
        decision = route(req(num_tokens), saturated, COST, state=state())
        assert decision.kind is RouteKind.LOCAL, num_tokens
        assert decision.predicted_ttft_s == pytest.approx(num_tokens / 5000)
        assert "queue 100.0000" in decision.reason
        assert decision.reason.endswith("local predicts the lower ttft + stall")


def test_a_remote_plan_pays_for_the_prompts_queued_on_its_decode_worker():
    # d0 and d1 alike but d0 has 5,000 prompt tokens queued (a local prefill): a 1,000-token prompt's remote plan
    # gets its first token from p0 either way, but d0 decodes the second only after 5000/5000 = 1 s
    cands = [worker("d0", queued=5000), worker("d1"), worker("p0", "prefill")]
    decision = route(req(1000), cands, COST, state=state())
    assert (decision.kind, decision.decode_id) == (RouteKind.REMOTE, "d1")
    assert "(next: d0 cost " in decision.reason
    only_d0 = route(req(1000), [cands[0], cands[2]], COST, state=state())
    assert only_d0.kind is RouteKind.REMOTE and "+ wait for D's queue 1.0000 + 64 x itl" in only_d0.reason


def test_least_queued_prefill_worker_is_the_remote_choice():
    cands = [worker("d0", running=30), worker("p0", "prefill", queued=3000), worker("p1", "prefill", queued=1000),
             worker("p2", "prefill", queued=2000)]
    decision = route(req(600), cands, COST, state=state())
    assert (decision.kind, decision.prefill_id) == (RouteKind.REMOTE, "p1")


def test_slow_link_makes_remote_lose_for_a_big_prompt():
    cands = [worker("d0", total=400, free=400), worker("p0", "prefill", total=400, free=400)]
    assert route(req(4000), cands, COST, state=state()).kind is RouteKind.REMOTE  # 0.452 s vs 0.8 s local
    rates = Rates(BASE)
    rates.observe_transfer("p0", "d0", num_bytes=100_000_000, transfer_ms=1000.0)  # 0.1 GB/s
    decision = route(req(4000), cands, COST, state=state(rates=rates))
    # remote 0.4 + 4000 x 131072 / 1e8 = 5.64 s; local 0.8 s
    assert decision.kind is RouteKind.LOCAL and decision.predicted_ttft_s == pytest.approx(0.8)
    assert "transfer 5.2429" in decision.reason


def test_layerwise_streaming_hides_the_pull_behind_the_prefill():
    cands = [worker("d0", total=400, free=400), worker("p0", "prefill", total=400, free=400)]
    rates = Rates(BASE)
    rates.observe_transfer("p0", "d0", num_bytes=100_000_000, transfer_ms=1000.0)  # 0.1 GB/s: 5.24 s pull
    decision = route(req(4000), cands, with_cost(kv_layerwise=True), state=state(rates=rates))
    # streamed while P computes for 0.4 s: only 5.2429 - 0.4 s of it is left after the last layer; local 0.8 s
    assert decision.kind is RouteKind.LOCAL and "transfer 4.8429" in decision.reason
    fast = Rates(BASE)
    fast.observe_transfer("p0", "d0", num_bytes=1_000_000_000, transfer_ms=500.0)  # 2 GB/s: 0.26 s < 0.4 s
    decision = route(req(4000), cands, with_cost(kv_layerwise=True), state=state(rates=fast))
    assert decision.kind is RouteKind.REMOTE and decision.predicted_ttft_s == pytest.approx(0.4)  # all hidden
    ucx_only = [worker("d0", total=400, free=400),
                dataclasses.replace(cands[1], info=dataclasses.replace(cands[1].info, kv_uri="ucx://x:3"))]
    decision = route(req(4000), ucx_only, with_cost(kv_layerwise=True), state=state(rates=fast))
    assert decision.predicted_ttft_s == pytest.approx(0.4 + 4000 * 131072 / 2e9)  # ucx does not stream


def test_local_prefill_that_breaks_the_itl_target_goes_remote_even_when_slower():
    # d0 runs 10: a 512-token chunk makes its step 0.015 + 0.1024 = 0.1174 s > 0.1 target. p0 queues 20,000
    # tokens: remote ttft 2.0 + 0.06 + 600 x 131072 / 1e10 = 2.0679 s, within a 3 s TTFT target.
    cands = [worker("d0", running=10), worker("p0", "prefill", queued=20_000)]
    decision = route(req(600), cands, with_cost(ttft_target_s=3.0), state=state())
    assert (decision.kind, decision.prefill_id) == (RouteKind.REMOTE, "p0")
    assert decision.predicted_ttft_s == pytest.approx(2.0 + 0.06 + 600 * 131072 / 1e10)
    assert "local would push itl past target 0.1000" in decision.reason
    relaxed = with_cost(itl_target_s=0.2)
    assert route(req(600), cands, relaxed, state=state()).kind is RouteKind.LOCAL


def test_past_both_targets_the_lower_ttft_plus_stall_wins():
    # as above, with the default 1 s TTFT target: remote (2.0679 s) breaks it, and local costs less:
    # 600/5000 + 2 chunks x 0.015 = 0.15 s ttft + a stall of 10 x 600/5000 = 1.2 s: 1.35 s < 2.0679 s
    cands = [worker("d0", running=10), worker("p0", "prefill", queued=20_000)]
    decision = route(req(600), cands, COST, state=state())
    assert decision.kind is RouteKind.LOCAL and decision.predicted_ttft_s == pytest.approx(0.15)
    assert decision.reason.endswith("local would push itl 1.2x past its target 0.1000, remote ttft 2.1x past its "
                                    "1.0000: local predicts the lower ttft + stall")
    # a remote plan past the TTFT target that still costs less than the local one keeps the ITL target
    busy = [worker("d0", running=20), worker("p0", "prefill", queued=10_000)]
    assert route(req(600), busy, COST, state=state()).kind is RouteKind.REMOTE  # 1.07 s vs 0.19 + 2.4
    # a long prompt: its chunks push d0's step 5.7x past a 20 ms target, the queue only 5.1x past the TTFT
    # target: remote (5.1 s), although local costs less (0.222 s + a stall of 2 x 0.2 s)
    long_wait = [worker("d0", running=2), worker("p0", "prefill", queued=50_000)]
    decision = route(req(1000), long_wait, with_cost(itl_target_s=0.02), state=state())
    assert decision.kind is RouteKind.REMOTE and "local would push itl past target 0.0200" in decision.reason
    with pytest.raises(ValueError, match="ttft_target_s"):
        CostConfig(ttft_target_s=0.0)


def test_threshold_stays_a_floor():
    # remote would be faster (p0 idle, d0 busy) but 64 uncached tokens always prefill locally.
    cands = [worker("d0", running=40), worker("p0", "prefill")]
    decision = route(req(64), cands, COST, state=state())
    assert decision.kind is RouteKind.LOCAL
    assert decision.reason.endswith("64 uncached prompt tokens <= threshold 64")


def test_decode_without_room_is_never_chosen():
    # 200 tokens + 1 -> 13 blocks; d0 is idle and holds a prefix but has 2 free blocks for the 8 it needs.
    cands = [worker("d0", free=2, cached=5), worker("d1", running=20, free=13), worker("p0", "prefill")]
    for seed in range(20):
        config = with_cost(temperature_s=10.0)
        assert route(req(200), cands, config, state=state(seed)).decode_id == "d1"
    short = [worker("d0", running=3, free=0), worker("d1", running=1, free=0)]
    decision = route(req(200), short, COST, state=state())
    assert decision.decode_id == "d1" and decision.reason.endswith("short of free blocks, queued")


def test_no_prefill_workers_or_a_capped_pool_means_local_with_the_reason():
    decision = route(req(500), [worker("d0")], COST, state=state())
    assert decision.kind is RouteKind.LOCAL and decision.reason.endswith("; no prefill workers")
    config = dataclasses.replace(COST, max_queued_prefill_tokens=1000)
    decision = route(req(500), [worker("d0"), worker("p0", "prefill", queued=1001)], config, state=state())
    assert decision.kind is RouteKind.LOCAL and "prefill pool saturated" in decision.reason


def test_temperature_zero_is_deterministic_and_positive_temperature_spreads():
    cands = [worker(f"d{i}") for i in range(4)] + [worker("p0", "prefill")]
    chosen = {route(req(300), cands, COST, state=state(seed)).decode_id for seed in range(50)}
    assert chosen == {"d0"}  # equal costs: the lowest id
    warm = with_cost(temperature_s=1.0)
    rng_state = state(seed=7)
    spread = [route(req(300), cands, warm, state=rng_state).decode_id for _ in range(200)]
    assert set(spread) == {"d0", "d1", "d2", "d3"}
    again = state(seed=7)
    assert [route(req(300), cands, warm, state=again).decode_id for _ in range(200)] == spread  # seeded


def test_temperature_still_prefers_the_cheaper_worker():
    cands = [worker("d0", cached=60, total=200, free=200), worker("d1", total=200, free=200)]
    config = with_cost(temperature_s=0.05)
    rng_state = state(seed=3)
    picks = [route(req(1000), cands, config, state=rng_state).decode_id for _ in range(300)]
    assert picks.count("d0") > 250


def test_power_of_two_prices_only_two_decode_workers_in_a_large_pool():
    pool = [worker(f"d{i:02}") for i in range(10)]
    config = COST.cost
    sampled = sample_decodes(pool, config, random.Random(1))
    assert len(sampled) == 2 and len({c.worker_id for c in sampled}) == 2
    assert sample_decodes(pool, config, random.Random(1)) == sampled
    assert sample_decodes(pool[:8], config, random.Random(1)) == pool[:8]  # small pools: all priced
    cached = [*pool, worker("d10", cached=3)]
    assert "d10" in {c.worker_id for c in sample_decodes(cached, config, random.Random(5))}
    decision = route(req(300), pool + [worker("p0", "prefill")], COST, state=state(seed=1))
    assert decision.reason.startswith("cost (2 of 10 decode workers priced): ")
    assert decision.decode_id in {c.worker_id for c in sampled}


def test_reported_rates_are_used_until_measured():
    fast_p = WorkerLoad(running=0, waiting=0, free_blocks=100, queued_prefill_tokens=0, prefill_tokens_per_s=40_000.0)
    p0 = Candidate(info=worker("p0", "prefill").info, load=fast_p)
    decision = route(req(400), [worker("d0"), p0], COST, state=state())
    assert decision.predicted_ttft_s == pytest.approx(400 / 40_000 + 400 * 131072 / 1e10)
    rates = Rates(BASE)
    rates.observe_prefill("p0", num_tokens=400, prefill_ms=100.0)  # measured 4,000 tok/s wins over the report
    # (and prices the unmeasured d0 at half of it: local 400 / 2,000 = 0.2 s loses to remote 0.1 + the pull)
    decision = route(req(400), [worker("d0"), p0], COST, state=state(rates=rates))
    assert decision.kind is RouteKind.REMOTE and decision.predicted_ttft_s == pytest.approx(
        400 / 4000 + 400 * 131072 / 1e10)


def test_rates_converge_to_measured_values_and_go_stale():
    now = [0.0]
    rates = Rates(RatesConfig(stale_after_s=60.0), clock=lambda: now[0])
    assert rates.prefill_tokens_per_s("p0", None) == 10_000.0
    assert rates.prefill_tokens_per_s("d0", None, on_decode=True) == 5_000.0
    for _ in range(60):
        rates.observe_prefill("p0", num_tokens=1000, prefill_ms=50.0)
        rates.observe_transfer("p0", "d0", num_bytes=2_000_000, transfer_ms=1.0, num_tokens=100)
        for batch in range(1, 9):
            rates.observe_decode_step("d0", batch, 0.020 + 0.001 * batch)
    assert rates.prefill_tokens_per_s("p0", None) == pytest.approx(20_000.0)
    assert rates.link_gb_per_s("p0", "d0") == pytest.approx(2.0)
    assert rates.link_gb_per_s("p1", "d0") == 10.0  # another pair keeps the default
    assert rates.kv_bytes_per_token(131_072.0) == pytest.approx(20_000.0)
    assert rates.decode_step_s("d0", None, 0) == pytest.approx(0.020, abs=2e-3)
    assert rates.decode_step_s("d0", None, 16) == pytest.approx(0.036, abs=2e-3)
    now[0] = 61.0
    assert rates.prefill_tokens_per_s("p0", None) == 10_000.0 and rates.link_gb_per_s("p0", "d0") == 10.0


def test_a_link_that_changed_is_learned_from_its_next_large_pull():
    now = [0.0]
    rates = Rates(RatesConfig(stale_after_s=60.0), clock=lambda: now[0])
    mib16 = 16 << 20
    rates.observe_transfer("p0", "d0", num_bytes=mib16, transfer_ms=mib16 / 0.5e6)  # 0.5 GB/s
    rates.observe_transfer("p0", "d0", num_bytes=mib16, transfer_ms=mib16 / 0.4e6)  # within 2x: averaged
    assert rates.link_gb_per_s("p0", "d0") == pytest.approx(0.5 + 0.2 * (0.4 - 0.5))
    rates.observe_transfer("p0", "d0", num_bytes=mib16, transfer_ms=mib16 / 0.0125e6)  # reshaped to 100 Mbit/s
    assert rates.link_gb_per_s("p0", "d0") == pytest.approx(0.0125)  # at once (alpha alone: 0.39 GB/s, 31x off)
    rates.observe_transfer("p0", "d0", num_bytes=64 << 10, transfer_ms=(64 << 10) / 0.1e6)  # a small pull: averaged
    assert rates.link_gb_per_s("p0", "d0") == pytest.approx(0.0125 + 0.2 * (0.1 - 0.0125))
    now[0] = 120.0  # stale: the next pull starts the estimate over, however close
    rates.observe_transfer("p0", "d0", num_bytes=mib16, transfer_ms=mib16 / 0.03e6)
    assert rates.link_gb_per_s("p0", "d0") == pytest.approx(0.03)
    rates.observe_transfer("p0", "d0", num_bytes=mib16, transfer_ms=mib16 / 1.25e6)  # faster again (10 Gbit/s)
    assert rates.link_gb_per_s("p0", "d0") == pytest.approx(1.25)


def test_a_prefill_of_a_few_tokens_teaches_no_rate():
    # 9 tokens in 15 ms is a step's fixed cost, not 600 tok/s: the rate keeps its default
    rates = Rates(BASE)
    rates.observe_prefill("d0", num_tokens=9, prefill_ms=15.0, on_decode=True)
    assert rates.prefill_tokens_per_s("d0", None, on_decode=True) == 5_000.0
    rates.observe_prefill("d0", num_tokens=64, prefill_ms=32.0, on_decode=True)
    assert rates.prefill_tokens_per_s("d0", None, on_decode=True) == pytest.approx(2_000.0)


def test_an_unmeasured_decode_worker_is_priced_like_its_measured_peers():
    # a CPU: P measured at 400 tok/s. An unmeasured D must not keep the 5,000 tok/s default (it would take
    # a 1,000-token prompt locally, predicted 0.2 s, measured 10 s): P's rate x decode_prefill_factor.
    rates = Rates(BASE)
    rates.observe_prefill("p0", num_tokens=1000, prefill_ms=2500.0)
    assert rates.prefill_tokens_per_s("d0", None, on_decode=True) == pytest.approx(200.0)
    assert rates.prefill_tokens_per_s("p1", None) == pytest.approx(400.0)
    rates.observe_prefill("d1", num_tokens=100, prefill_ms=1000.0, on_decode=True)  # a measured decode peer
    assert rates.prefill_tokens_per_s("d0", None, on_decode=True) == pytest.approx(100.0)
    assert rates.prefill_tokens_per_s("p1", None) == pytest.approx(400.0)  # decode workers' rates stay apart


def test_ewma_tracks_a_change():
    rates = Rates(RatesConfig(alpha=0.5))
    rates.observe_prefill("p0", 1000, 100.0)  # 10k
    rates.observe_prefill("p0", 1000, 50.0)  # 20k
    assert rates.prefill_tokens_per_s("p0", None) == pytest.approx(15_000.0)
    rates.observe_decode("d0", batch_size=4, tokens_per_s=50.0)  # one sample: default slope
    assert rates.decode_step_s("d0", None, 4) == pytest.approx(0.02)
    assert rates.decode_step_s("d0", None, 6) == pytest.approx(0.021)


def test_configs_reject_bad_values():
    with pytest.raises(ValueError, match="alpha"):
        RatesConfig(alpha=0.0)
    with pytest.raises(ValueError, match="link_gb_per_s"):
        RatesConfig(link_gb_per_s=0.0)
    with pytest.raises(ValueError, match="temperature_s"):
        CostConfig(temperature_s=-1.0)


# ---- baselines ---------------------------------------------------------------------------------


def test_round_robin_rotates_over_decode_workers_that_fit():
    config = dataclasses.replace(COST, policy="round_robin")
    cands = [worker("d1"), worker("d0"), worker("d2", free=0), worker("d3", running=50)]
    rr = state()
    assert [route(req(10), cands, config, state=rr).decode_id for _ in range(4)] == ["d0", "d1", "d3", "d0"]


def test_random_is_seeded():
    config = dataclasses.replace(COST, policy="random")
    cands = [worker(f"d{i}") for i in range(3)]
    first, second = state(seed=4), state(seed=4)
    picks = [route(req(10), cands, config, state=first).decode_id for _ in range(30)]
    assert picks == [route(req(10), cands, config, state=second).decode_id for _ in range(30)]
    assert set(picks) == {"d0", "d1", "d2"}


def test_prefix_overlap_is_dynamos_formula():
    # 320 tokens = 20 blocks. d0: 5 blocks to prefill + 20 active = 25; d1: 20 + 0 = 20.
    cands = [worker("d0", cached=15, free=80), worker("d1"), worker("p0", "prefill")]
    config = dataclasses.replace(COST, policy="prefix_overlap")
    decision = route(req(320), cands, config)
    assert (decision.decode_id, decision.kind) == ("d1", RouteKind.REMOTE)
    assert decision.reason == "prefix_overlap: 320 uncached prompt tokens > threshold 64"
    heavier = dataclasses.replace(config, overlap_weight=2.0)  # d0: 10 + 20 = 30; d1: 40
    assert route(req(320), cands, heavier).decode_id == "d0"


def test_round_robin_keeps_one_cursor_per_role():
    # remote decisions pick a decode and a prefill worker: each role must rotate on its own
    config = dataclasses.replace(COST, policy="round_robin")
    cands = [worker("d0"), worker("d1"), worker("p0", "prefill"), worker("p1", "prefill")]
    routing = state()
    picks = [route(req(500), cands, config, state=routing) for _ in range(4)]
    assert [d.decode_id for d in picks] == ["d0", "d1", "d0", "d1"]
    assert [d.prefill_id for d in picks] == ["p0", "p1", "p0", "p1"]


def test_learned_overhead_of_a_route_kind_flips_the_choice():
    # 400 tokens, both idle: remote 400/10,000 + 400 x 131,072 / 1e10 = 0.04524 s beats local 400/5,000 = 0.08 s.
    rates = Rates(BASE)
    cands = [worker("d0"), worker("p0", "prefill")]
    decision = route(req(400), cands, COST, state=state(rates=rates))
    assert decision.kind is RouteKind.REMOTE and decision.predicted_ttft_s == pytest.approx(0.04524288)
    rates.observe_ttft("remote", measured_s=0.10, prefill_s=0.04524288)  # 0.0548 s beside P's own time
    rates.observe_ttft("local", measured_s=0.01, prefill_s=0.02)  # clocks disagree: clamped to 0
    assert rates.overhead_s("remote") == pytest.approx(0.10 - 0.04524288) and rates.overhead_s("local") == 0.0
    decision = route(req(400), cands, COST, state=state(rates=rates))
    assert decision.kind is RouteKind.LOCAL and decision.predicted_ttft_s == pytest.approx(0.08)
    assert "remote on p0 0.1000 s = overhead 0.0548 + queue 0.0000" in decision.reason
    assert Rates().overhead_s("remote") == 0.005 and Rates().overhead_s("local") == 0.002  # defaults until learned


def test_decode_step_line_is_fitted_on_batch_and_kv_blocks():
    rates = Rates(RatesConfig(alpha=0.3))
    samples = [(batch, kv_blocks) for batch in range(1, 9) for kv_blocks in range(0, 1000, 170)]
    random.Random(0).shuffle(samples)  # as they come in real life: batch and KV use vary together
    for batch, kv_blocks in samples:
        rates.observe_decode_step("d0", batch, 0.010 + 0.001 * batch + 1e-5 * kv_blocks, kv_blocks)
    base_s, per_seq_s, per_block_s = rates._steps["d0"].line()
    assert (base_s, per_seq_s, per_block_s) == pytest.approx((0.010, 0.001, 1e-5), rel=1e-6)
    assert rates.decode_step_s("d0", None, 4, 500) == pytest.approx(0.010 + 0.004 + 0.005)
    # An unmeasured worker is priced like its measured peers, not at the default (0.010 + 0.0005 per seq).
    assert rates.decode_step_s("d9", None, 4, 500) == pytest.approx(0.019)
    # Too little spread in KV use: that slope keeps its default, the batch slope is still fitted.
    flat = Rates(RatesConfig(decode_step_per_kv_block_s=2e-6))
    for batch in range(1, 9):
        flat.observe_decode_step("d0", batch, 0.010 + 0.001 * batch + 2e-6 * 300, 300)
    assert flat._steps["d0"].line() == pytest.approx((0.010, 0.001, 2e-6))


def test_kv_usage_of_a_decode_worker_raises_its_predicted_itl():
    # Same batch; d0 holds 90 of its 100 blocks. itl d0 = 0.0105 + 1e-4 x (90 + 2) = 0.0197, d1 = 0.0107.
    config = dataclasses.replace(COST, rates=dataclasses.replace(BASE, decode_step_per_kv_block_s=1e-4))
    cands = [worker("d0", free=10), worker("d1", free=100)]
    decision = route(req(30), cands, config, state=state(rates=Rates(config.rates)))
    assert decision.decode_id == "d1" and "64 x itl 0.0107" in decision.reason
    assert route(req(30), cands, COST, state=state()).decode_id == "d0"  # without the term: a tie, won by id


def test_prefills_this_router_sent_count_as_queued_before_the_report_catches_up():
    # p0 reports an empty queue, but this router sent it 20,000 tokens that are not answered yet.
    idle = [worker("d0"), worker("p0", "prefill")]
    assert route(req(300), idle, COST, state=state()).kind is RouteKind.REMOTE  # 0.0339 s vs local 0.06 s
    busy = [worker("d0"), dataclasses.replace(worker("p0", "prefill"), inflight_prefill_tokens=20_000)]
    decision = route(req(300), busy, COST, state=state())
    assert decision.kind is RouteKind.LOCAL and decision.predicted_ttft_s == pytest.approx(0.06)
    assert "queue 2.0000" in decision.reason


def test_a_reported_decode_step_is_moved_to_the_batch_it_will_run():
    # d0 is idle now, but its engine measured 12 ms steps at a mean batch of 4: base 12 - 4 x 0.5 = 10 ms.
    rates = Rates(BASE)
    idle = WorkerLoad(running=0, waiting=0, free_blocks=100, queued_prefill_tokens=0, decode_step_s=0.012,
                      decode_batch_size=4.0)
    assert rates.decode_step_s("d0", idle, 1) == pytest.approx(0.0105)
    for batch in range(1, 9):  # a router-side fit does not override the engine's own timing ...
        rates.observe_decode_step("d0", batch, 0.030 + 0.002 * batch)
    assert rates.decode_step_s("d0", idle, 1) == pytest.approx(0.012 - 4 * 0.002 + 0.002)  # ... only its slope
    # d9 has not decoded yet: its peers' reported base (12 - 4 x 2 = 4 ms), its own default slope
    assert rates.decode_step_s("d9", None, 1) == pytest.approx(0.004 + 0.0005)
    fitted_only = Rates(BASE)
    for batch in range(1, 9):
        fitted_only.observe_decode_step("d0", batch, 0.030 + 0.002 * batch)
    assert fitted_only.decode_step_s("d0", None, 1) == pytest.approx(0.032)  # nobody reports: the fitted line


def test_an_unlearned_route_kind_borrows_the_learned_one_shifted_by_the_defaults():
    rates = Rates(RatesConfig(remote_overhead_s=0.005, local_overhead_s=0.002))
    rates.observe_ttft("local", measured_s=0.030, prefill_s=0.018)  # 12 ms measured beside the prefill
    assert rates.overhead_s("local") == pytest.approx(0.012)
    assert rates.overhead_s("remote") == pytest.approx(0.015)  # not 5 ms: local's 12 + the 3 ms difference


def test_a_reported_batch_slope_balances_decode_workers():
    # Both idle-measured at 20 ms (batch 1), 8 ms per extra sequence; d0 runs 3 more sequences than d1.
    load = dict(waiting=0, free_blocks=100, queued_prefill_tokens=0, decode_step_s=0.020, decode_batch_size=1.0,
                decode_step_per_seq_s=0.008)
    rates = Rates(BASE)
    d0 = Candidate(info=worker("d0").info, load=WorkerLoad(running=4, **load), cached_blocks=2)
    d1 = Candidate(info=worker("d1").info, load=WorkerLoad(running=1, **load))
    assert rates.decode_step_s("d0", d0.load, 5) == pytest.approx(0.020 + 4 * 0.008)
    decision = route(req(30), [d0, d1], COST, state=state(rates=rates))
    assert decision.decode_id == "d1"  # the holder of 2 cached blocks is 3 x 8 ms slower per token
    assert rates.decode_step_s("d9", None, 3) == pytest.approx(0.012 + 3 * 0.008)  # a new peer: reported line


# ---- output length, local-prefill stall, load against the cached prefix ----------------------------------


def test_decode_steps_are_the_requests_max_tokens_capped_by_the_default():
    config = COST.cost  # expected_output_tokens 64
    steps = {m: decode_steps(dataclasses.replace(req(100), max_tokens=m), config) for m in (1, 5, 65, 66, 10_000)}
    assert steps == {1: 0, 5: 4, 65: 64, 66: 64, 10_000: 64}  # the prefill samples the first token
    assert decode_steps(req(100), config) == 64  # no limit stated: the default
    assert decode_steps(dataclasses.replace(req(100), max_tokens=50), CostConfig(expected_output_tokens=16)) == 16


def test_a_short_request_is_priced_as_short():
    # 1,024 tokens; d0 holds 60 blocks (960 tokens) and runs 6, d1 is idle. 64 uncached on d0: local (the floor).
    # d0: ttft 64/5000 + 1 chunk x step(6) 0.013 = 0.0258, stall 6 x 64/5000 = 0.0768, itl step(7) = 0.0135
    # d1: remote 1024/10000 + 1024 x 131072 / 1e10 = 0.11582 (local 0.2048), itl step(1) = 0.0105
    cands = [worker("d0", running=6, cached=60), worker("d1"), worker("p0", "prefill")]
    short = route(dataclasses.replace(req(1024), max_tokens=5), cands, COST, state=state())
    # 4 steps: d0 0.1026 + 4 x 0.0135 = 0.1566 < d1 0.11582 + 4 x 0.0105 = 0.15782
    assert (short.decode_id, short.kind) == ("d0", RouteKind.LOCAL)
    assert "d0: cost 0.1566 s = ttft 0.0258 + stall 0.0768 + 4 x itl 0.0135; " in short.reason
    assert "(next: d1 cost 0.1578 s = ttft 0.1158 + stall 0.0000 + itl 0.0105, 0 cached)" in short.reason
    for max_tokens in (None, 10_000):  # 64 steps: d0 0.9666, 1.23 x d1's 0.7878
        decision = route(dataclasses.replace(req(1024), max_tokens=max_tokens), cands, COST, state=state())
        assert (decision.decode_id, decision.prefill_id) == ("d1", "p0")
        assert "d1: cost 0.7878 s = ttft 0.1158 + stall 0.0000 + 64 x itl 0.0105; " in decision.reason


def test_a_local_prefill_pays_for_stalling_the_running_sequences():
    # 300 tokens; p0 queues 5,000 tokens: remote 0.5 + 0.03 + 300 x 131072 / 1e10 = 0.53393 s.
    # Local on d0 running n: ttft 0.06 + step(n) = 0.07 + 0.0005 n, stall n x 0.06 (each sequence waits 300/5000).
    # Local while 0.07 + 0.0605 n < 0.53393: n <= 7.
    def pool(running: int) -> list[Candidate]:
        return [worker("d0", running=running), worker("p0", "prefill", queued=5000)]

    local = route(req(300), pool(7), COST, state=state())
    assert local.kind is RouteKind.LOCAL and local.predicted_ttft_s == pytest.approx(0.0735)  # the stall is no TTFT
    assert "(itl 0.0735, stall of running 0.4200)" in local.reason
    assert local.reason.endswith("local predicts the lower ttft + stall")
    remote = route(req(300), pool(8), COST, state=state())  # 0.074 + 0.48 = 0.554 > 0.53393, itl 0.074 < target
    assert (remote.kind, remote.prefill_id) == (RouteKind.REMOTE, "p0")
    assert remote.predicted_ttft_s == pytest.approx(0.53 + 300 * 131072 / 1e10)
    assert remote.reason.endswith("remote predicts the lower ttft + stall; 300 uncached prompt tokens > threshold 64")
    half = with_cost(interference_weight=0.5)  # 0.074 + 0.24 = 0.314: local again
    assert route(req(300), pool(8), half, state=state()).kind is RouteKind.LOCAL
    plan = local_plan(req(300), pool(8)[0], Rates(BASE), half.cost)
    assert (plan.stall_s, plan.ttft_s, plan.cost_s) == pytest.approx((0.24, 0.074, 0.314))
    with pytest.raises(ValueError, match="interference_weight"):
        CostConfig(interference_weight=-1.0)


def test_unmeasured_batch_slope_still_prefers_the_less_loaded_of_equal_prefixes():
    # 320 tokens, both hold the same 10 blocks; nothing measured or reported: default 0.0005 s per sequence.
    # Both remote: 320/10000 + 160 x 131072 / 1e10 = 0.0341. d0 runs 3: cost 0.0341 + 64 x 0.012 = 0.8021;
    # d1 runs 1: 0.0341 + 64 x 0.011 = 0.7381 -- within the 10% tolerance, but the prefixes are equal: cost decides.
    cands = [worker("d0", running=3, cached=10), worker("d1", running=1, cached=10), worker("p0", "prefill")]
    decision = route(req(320), cands, COST, state=state())
    assert (decision.decode_id, decision.prefill_id) == ("d1", "p0")
    assert "(next: d0 cost 0.8021 s = ttft 0.0341 + stall 0.0000 + itl 0.0120, 160 cached)" in decision.reason


def test_a_busy_prefix_holder_loses_past_the_computed_crossover():
    # 1,024 tokens; d0 holds 60 blocks (64 tokens uncached: local by the floor) and runs n; d1 is idle.
    # d0: 64/5000 + step(n) + n x 64/5000 (stall) + 64 x step(n + 1) = 0.6948 + 0.0453 n
    # d1: remote 0.1024 + 1024 x 131072 / 1e10 + 64 x step(1) = 0.78782
    # d0 keeps it while within the 10% affinity tolerance of d1: n <= (1.1 x 0.78782 - 0.6948) / 0.0453.
    d1_cost = 0.1024 + 1024 * 131072 / 1e10 + 64 * 0.0105
    crossover = int((1.1 * d1_cost - 0.6948) / 0.0453)
    assert crossover == 3

    def decide(running: int, config: PolicyConfig = COST):
        cands = [worker("d0", running=running, cached=60), worker("d1"), worker("p0", "prefill")]
        return route(req(1024), cands, config, state=state())

    kept = decide(crossover)
    assert (kept.decode_id, kept.kind) == ("d0", RouteKind.LOCAL)
    assert f"d0: cost {0.6948 + 0.0453 * crossover:.4f} s = " in kept.reason
    moved = decide(crossover + 1)
    assert (moved.decode_id, moved.kind, moved.prefill_id) == ("d1", RouteKind.REMOTE, "p0")
    assert f"d1: cost {d1_cost:.4f} s = " in moved.reason
    strict = with_cost(affinity_tolerance=0.0)  # without the tolerance: n <= (0.78782 - 0.6948) / 0.0453 = 2.05
    assert (decide(2, strict).decode_id, decide(3, strict).decode_id) == ("d0", "d1")


def test_a_prefix_holder_with_a_flat_measured_slope_is_still_bounded_by_the_stall():
    # Both engines report 10 ms steps and no slope (0 s per sequence): d0's ITL does not grow with its batch,
    # but each local prefill stalls its n sequences 64/5000 s: d0 costs 0.0128 + 0.010 + 0.0128 n + 64 x 0.010,
    # d1 0.11582 + 64 x 0.010 = 0.75582; d0 keeps it while n <= (1.1 x 0.75582 - 0.6628) / 0.0128 = 13.2.
    def decide(running: int) -> str:
        flat = dict(waiting=0, free_blocks=100, queued_prefill_tokens=0, decode_step_s=0.010, decode_batch_size=1.0,
                    decode_step_per_seq_s=0.0)
        d0 = Candidate(info=worker("d0").info, load=WorkerLoad(running=running, **flat), cached_blocks=60)
        d1 = Candidate(info=worker("d1").info, load=WorkerLoad(running=0, **flat))
        return route(req(1024), [d0, d1, worker("p0", "prefill")], COST, state=state()).decode_id

    assert int((1.1 * (0.1024 + 1024 * 131072 / 1e10 + 0.64) - 0.6628) / 0.0128) == 13
    assert (decide(13), decide(14)) == ("d0", "d1")


def test_router_flags_set_the_output_cap_and_the_interference_weight(tmp_path):
    from router.main import build_parser, config_from_args

    args = build_parser().parse_args(["--model", str(tmp_path), "--expected-output-tokens", "16",
                                      "--interference-weight", "0.25"])
    cost = config_from_args(args).policy.cost
    assert (cost.expected_output_tokens, cost.interference_weight) == (16, 0.25)
    defaults = config_from_args(build_parser().parse_args(["--model", str(tmp_path)])).policy.cost
    assert (defaults.expected_output_tokens, defaults.interference_weight) == (64, 1.0)


# ---- cross-worker prefix import -------------------------------------------------------------------
def test_a_local_plan_imports_a_longer_prefix_held_elsewhere_when_the_pull_is_cheaper():
    # 2,000 tokens; p0 holds 100 blocks (1,600 tokens), d0 none. Importing them: 0.005 + 1600 x 131072 / 1e10
    # = 0.02597 s against 1600 / 5000 = 0.32 s of compute on d0. d0 local then computes 400 tokens: 0.08 s,
    # ttft 0.10597; remote on p0 computes 400 (0.04 s) and moves all 2,000 tokens' KV (0.0262 s): 0.0662 s.
    cands = [worker("d0", total=300, free=300), worker("p0", "prefill", cached=100, total=300, free=300)]
    decision = route(req(2000), cands, with_cost(prefix_import=True), state=state())
    assert (decision.kind, decision.prefill_id, decision.prefix_source_id) == (RouteKind.REMOTE, "p0", None)
    assert "local 0.1060 s = " in decision.reason and "+ import 0.0260 (1600 tokens from p0)" in decision.reason
    # a busy p0 (4,000 queued tokens: 0.4 s) makes the local plan with the import the cheaper one
    cands[1] = worker("p0", "prefill", cached=100, total=300, free=300, queued=4000)
    decision = route(req(2000), cands, with_cost(prefix_import=True), state=state())
    assert (decision.kind, decision.prefix_source_id, decision.prefix_tokens) == (RouteKind.LOCAL, "p0", 1600)
    assert decision.predicted_ttft_s == pytest.approx(0.005 + 1600 * 131072 / 1e10 + 400 / 5000)


def test_no_import_when_the_link_is_too_slow_or_the_feature_is_off():
    # at 0.01 GB/s, 1,600 tokens' KV takes 21 s: recomputing them (0.32 s) is cheaper
    rates = Rates(dataclasses.replace(BASE, link_gb_per_s=0.01))
    source = worker("p0", "prefill", cached=100, total=300, free=300)
    decode = worker("d0", total=300, free=300)
    assert local_plan(req(2000), decode, rates, CostConfig(), source).import_from is None
    plan = local_plan(req(2000), decode, Rates(BASE), CostConfig(), source)
    assert (plan.import_from, plan.import_tokens, plan.uncached_tokens) == ("p0", 1600, 400)
    assert local_plan(req(2000), decode, Rates(BASE), CostConfig(prefix_import=False), source).import_from is None
    # a source holding no more than D itself: nothing to import
    assert local_plan(req(2000), worker("d0", cached=100, total=300, free=300), Rates(BASE), CostConfig(),
                      source).import_from is None
    with pytest.raises(ValueError, match="prefix_import_overhead_s"):
        CostConfig(prefix_import_overhead_s=-1.0)


def test_the_prefix_source_is_the_longest_holder_of_either_role():
    from router.routing.cost_model import prefix_source
    cands = [worker("d0", cached=10, total=300, free=300), worker("d1", cached=40, total=300, free=300),
             worker("p0", "prefill", cached=40, total=300, free=300, queued=100),
             worker("p1", "prefill", cached=40, total=300, free=300)]
    assert prefix_source(req(2000), cands).worker_id == "d1"  # 40 blocks, nothing queued, lowest id
    assert prefix_source(req(2000), [worker("d0", total=300, free=300)]) is None
    # a worker whose engine moves its own KV (vLLM's connector) leases no prefix to another worker
    vllm = replace(cands[1], info=replace(cands[1].info, kv_uri="vllm-nixl://127.0.0.1:5600"))
    assert prefix_source(req(2000), [cands[0], vllm]).worker_id == "d0"
    assert prefix_source(req(2000), [vllm]) is None


def test_a_prefix_being_computed_is_priced_as_cached_where_it_is_computed_but_never_imported_from_there():
    # d0 is computing this 2,000-token prompt's first 1,600 tokens for another request (its backlog drained,
    # not yet in the index): it waits for them and computes 400: 400/5000 + 1 chunk x 0.0105 (the other
    # request runs) = 0.0905 s, stall 0.08, cost 0.0905 + 0.08 + 64 x 0.011 = 0.8745; d1 computes all 2,000:
    # 0.4 + 64 x 0.0105 = 1.072.
    computing = dataclasses.replace(worker("d0", total=300, free=300), pending_blocks=100, inflight=1)
    cands = [computing, worker("d1", total=300, free=300)]
    decision = route(req(2000), cands, COST, state=state())
    assert (decision.kind, decision.decode_id, decision.computed_tokens) == (RouteKind.LOCAL, "d0", 400)
    assert decision.decode_cached_tokens == 0  # what d0 holds now: a prefix lease would have to go beyond it
    assert decision.reason.startswith("cost: 1600 of 2000 prompt tokens cached on d0 (d0 is computing 1600 of "
                                      "them) (next: d1 cost 1.0720 s"), decision.reason
    # without it, d0 is only the busier worker
    plain = route(req(2000), [dataclasses.replace(computing, pending_blocks=0), cands[1]], COST, state=state())
    assert plain.decode_id == "d1"

    # P computing it for another request: the remote plan there computes only the tail, but the blocks are not
    # there to pull yet, so no local plan imports them from P
    p0 = dataclasses.replace(worker("p0", "prefill", total=300, free=300), pending_blocks=100)
    decision = route(req(2000), [worker("d1", total=300, free=300), p0], with_cost(prefix_import=True), state=state())
    assert (decision.kind, decision.prefill_id, decision.prefix_source_id) == (RouteKind.REMOTE, "p0", None)
    assert decision.computed_tokens == 400 and "(p0 is computing 1600 of them)" in decision.reason


# ---- the host tier (issue 22): a prefix in a worker's host memory is copied up, not computed ------------
def tiered(worker_id: str, role: str = "decode", *, tiered_blocks: int, **kw) -> Candidate:
    return dataclasses.replace(worker(worker_id, role, **kw), tiered_blocks=tiered_blocks)


def test_a_prefix_in_host_memory_is_priced_as_a_copy_and_wins():
    # 2,000 tokens, threshold high (local only): d0 holds 100 blocks (1,600 tokens) in its host tier only.
    # d0: copy 1,600 x 131,072 B at 8 GB/s = 0.026214 s + compute 400 / 5,000 = 0.08 -> ttft 0.106214
    # d1: compute 2,000 / 5,000 = 0.4
    cands = [tiered("d0", tiered_blocks=100, total=300, free=300), worker("d1", total=300, free=300)]
    local_only = dataclasses.replace(COST, disagg_threshold_tokens=100_000)
    decision = route(req(2000), cands, local_only, state=state())
    assert (decision.kind, decision.decode_id) == (RouteKind.LOCAL, "d0")
    assert decision.predicted_ttft_s == pytest.approx(1600 * 131072 / 8e9 + 400 / 5000)
    assert "host copy 0.0262 (1600 tokens from host memory)" in decision.reason
    slow_copy = dataclasses.replace(local_only, cost=dataclasses.replace(COST.cost, host_copy_gb_per_s=0.01))
    recompute = route(req(2000), cands, slow_copy, state=state())  # copying slower than computing: computed
    assert recompute.predicted_ttft_s == pytest.approx(2000 / 5000) and "host copy" not in recompute.reason


def test_a_prefill_workers_host_prefix_shortens_its_quote():
    # remote only (no local: D's running sequences would stall): p0's host tier holds 1,600 of 2,000 tokens.
    # p0: copy 0.026214 + 400 / 10,000 = 0.066214; p1: 2,000 / 10,000 = 0.2; transfer 2,000 tokens either way.
    cands = [worker("d0", running=30, total=300, free=300), tiered("p0", "prefill", tiered_blocks=100, total=300),
             worker("p1", "prefill", total=300)]
    decision = route(req(2000), cands, COST, state=state())
    assert (decision.kind, decision.prefill_id) == (RouteKind.REMOTE, "p0")
    transfer = 2000 * 131072 / 1e10
    assert decision.predicted_ttft_s == pytest.approx(1600 * 131072 / 8e9 + 400 / 10_000 + transfer)
    assert decision.computed_tokens == 400


def test_own_host_memory_beats_importing_the_same_prefix_from_another_worker():
    # d0 holds 1,600 tokens in host memory; d1 holds them in its pool: d0's copy (0.026 s) beats a pull over
    # the 10 GB/s link (0.005 + 0.021 s) plus nothing; with a slow host copy the import wins.
    cands = [tiered("d0", tiered_blocks=100, total=300, free=300), worker("d1", "prefill", cached=100, total=300)]
    importing = dataclasses.replace(COST, disagg_threshold_tokens=100_000, cost=CostConfig(prefix_import=True))
    plan = local_plan(req(2000), cands[0], Rates(BASE), importing.cost, source=cands[1])
    assert (plan.host_tokens, plan.import_tokens) == (0, 1600)  # 0.026 s copy vs 0.005 + 0.021 s pull: import
    fast_host = dataclasses.replace(importing.cost, host_copy_gb_per_s=20.0)  # 0.0105 s: its own memory
    plan = local_plan(req(2000), cands[0], Rates(BASE), fast_host, source=cands[1])
    assert (plan.host_tokens, plan.import_tokens, plan.import_from) == (1600, 0, None)


def test_a_prefix_in_the_store_is_priced_as_a_fetch_past_the_workers_own_tiers():
    # the store holds 100 blocks (1,600 tokens) at 2 GB/s; d0 holds 40 of them in its pool: it fetches 60 blocks
    # (960 tokens x 131,072 B = 0.0629 s) and computes 400 (0.08 s); d1 fetches 1,600 tokens (0.1049 s) and
    # computes 400: d0 wins. At 0.05 GB/s a fetch is slower than computing: d0 computes its 1,360 (0.272 s).
    cands = [worker("d0", cached=40, total=300, free=300), worker("d1", total=300, free=300)]
    local_only = dataclasses.replace(COST, disagg_threshold_tokens=100_000,
                                     cost=dataclasses.replace(COST.cost, store_gb_per_s=2.0))
    request = dataclasses.replace(req(2000), store_blocks=100)
    decision = route(request, cands, local_only, state=state())
    assert decision.decode_id == "d0"
    assert decision.predicted_ttft_s == pytest.approx(960 * 131072 / 2e9 + 400 / 5000)
    assert "store fetch 0.0629 (960 tokens from the store)" in decision.reason
    slow = dataclasses.replace(local_only, cost=dataclasses.replace(COST.cost, store_gb_per_s=0.05))
    computed = route(request, cands, slow, state=state())
    assert computed.predicted_ttft_s == pytest.approx(1360 / 5000) and "store fetch" not in computed.reason
