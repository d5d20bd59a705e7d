"""The SLO planner's math: known inputs give known counts, counts are monotone in rate and SLO, the
hysteresis band and cool-downs hold, never below one worker per pool, bad inputs are typed errors; the prefill
pool's queue (M/G/n pooled, n x M/G/1 split) by hand, a spread of prompt lengths sizing more workers than the same
mean alone, a policy's dispatch, and the prefill pool sized on its own traffic (remote share, cached tokens)."""

from __future__ import annotations

import math

import pytest

from engine.errors import InvalidRequest
from router.admin.planner import (
    Corrections, DecodeProfile, PlannerConfig, PoolState, PrefillProfile, RemotePrefill, Slo, Traffic,
    itl_row_at_context, max_batch_at_itl, plan_pools, prefill_ttft_p90_s, service_mix,
)
from router.admin.queueing import DISPATCH, dispatch_of, erlang_c, wait_phases, waiting
from router.routing.policy import POLICIES

# 10k tok/s at every length: a 1000-token prompt takes D = 100 ms.
PREFILL = PrefillProfile(prompt_lens=(128, 4096), tokens_per_s=(10_000.0, 10_000.0))
DECODE = DecodeProfile(batch_sizes=(1, 8, 32, 64), itl_s=(0.010, 0.012, 0.020, 0.036))
SLO = Slo(ttft_p90_s=0.300, itl_p90_s=0.020)


def traffic(rate: float, isl: float = 1000, osl: float = 200) -> Traffic:
    return Traffic(rate_per_s=rate, mean_isl=isl, mean_osl=osl)


def plan(rate: float, slo: Slo = SLO, **kwargs):
    return plan_pools(slo, traffic(rate), PREFILL, DECODE, **kwargs)


ONE = ((0.1, 1.0),)  # every prompt takes D = 100 ms


def test_mgn_p90_ttft_by_hand():
    # one worker, one length: M/D/1 -- waits with probability rho, then ~Exp(D / (2 (1 - rho)))
    rho, ttft_s = prefill_ttft_p90_s(5.0, ONE, 1)
    assert rho == 0.5 and ttft_s == pytest.approx(0.1 + 0.1 * math.log(5))
    # two workers behind one queue, offered 1 Erlang: Erlang C = 1/3, wait once waiting D / (2 * 2 * 0.5) = 50 ms
    rho, ttft_s = prefill_ttft_p90_s(10.0, ONE, 2)
    assert rho == 0.5 and ttft_s == pytest.approx(0.1 + 0.05 * math.log(10 / 3))
    assert prefill_ttft_p90_s(10.0, ONE, 1) == (1.0, math.inf)  # unstable
    assert prefill_ttft_p90_s(0.5, ONE, 1)[1] == 0.1  # rho 0.05: the p90 request does not wait


def test_a_spread_of_prompt_lengths_waits_longer_than_their_mean():
    # half 50 ms, half 150 ms: mean 100 ms, cs2 0.25; at rho 0.5 the wait once waiting is 100 * 1.25 / 1 = 125 ms
    # and P(TTFT > t) = 0.25 (e^-(t - .05)/.125 + e^-(t - .15)/.125) = 0.1 past 150 ms
    mix = ((0.05, 0.5), (0.15, 0.5))
    _, ttft_s = prefill_ttft_p90_s(5.0, mix, 1)
    assert ttft_s == pytest.approx(0.125 * math.log((math.exp(0.4) + math.exp(1.2)) / 0.4))
    assert ttft_s > prefill_ttft_p90_s(5.0, ONE, 1)[1]
    # the planner: 1,000-token prompts on average, but a tenth of them 5,500 tokens long
    spread = Traffic(rate_per_s=14.0, mean_isl=1000, mean_osl=200, isl_mix=((500.0, 0.9), (5500.0, 0.1)))
    assert plan_pools(SLO, traffic(14.0), PREFILL, DECODE).prefill == 2
    assert plan_pools(SLO, spread, PREFILL, DECODE).prefill > 2
    assert "service time cs2" in plan_pools(SLO, spread, PREFILL, DECODE).explain()


def test_known_counts():
    result = plan(10.0)
    # prefill: n=1 is unstable (rho 1), n=2 gives 100 + 50 ln(10/3) = 160 ms <= 300 ms.
    assert result.prefill_plan.raw == 2 and result.prefill == 2
    # decode: ITL 20 ms allows batch 32; Little: 10/s * 200 tok * 20 ms = 40 sequences -> 2 workers.
    assert result.decode_plan.raw == 2 and result.decode == 2
    assert result.feasible
    assert plan(16.0).prefill == 3  # rho 0.8 at n=2: C 0.711, wait 125 ms once waiting -> 100 + 245 ms > 300 ms
    assert plan(20.0).decode == 3  # 80 sequences / 32


def test_interpolates_the_decode_curve_and_never_extrapolates():
    assert max_batch_at_itl(DECODE, 0.016) == pytest.approx(20.0)  # halfway between 8 (12 ms) and 32 (20 ms)
    assert max_batch_at_itl(DECODE, 1.0) == 64.0
    assert max_batch_at_itl(DECODE, 0.005) is None
    result = plan_pools(Slo(ttft_p90_s=0.3, itl_p90_s=0.016), traffic(10.0), PREFILL, DECODE)
    assert result.decode == 2  # 10 * 200 * 16 ms = 32 sequences / 20


def test_kv_capacity_caps_the_batch():
    small_kv = DecodeProfile(batch_sizes=DECODE.batch_sizes, itl_s=DECODE.itl_s, kv_tokens_per_worker=12_000)
    result = plan_pools(SLO, traffic(10.0), PREFILL, small_kv)  # 12000 / 1200 = 10 sequences per worker
    # ITL(10) = 12 + 8 * 2/24 = 12.67 ms; Little: 10/s * 200 * 12.67 ms = 25.3 sequences / 10 -> 3 workers.
    assert result.decode == 3


def test_monotone_in_rate():
    counts = [(p.prefill, p.decode) for p in (plan(r) for r in [0.0, 0.5, 1, 2, 5, 8, 10, 15, 20, 40, 80])]
    assert counts[0] == (1, 1)
    for (p0, d0), (p1, d1) in zip(counts, counts[1:]):
        assert p1 >= p0 and d1 >= d0
    assert counts[-1][0] > counts[0][0] and counts[-1][1] > counts[0][1]


def test_monotone_in_slo():
    ttfts = [0.15, 0.2, 0.3, 0.5, 1.0, 5.0]
    prefill = [plan(20.0, Slo(ttft_p90_s=t, itl_p90_s=0.02)).prefill for t in ttfts]
    assert prefill == sorted(prefill, reverse=True) and prefill[0] > prefill[-1]
    itls = [0.011, 0.012, 0.016, 0.02, 0.03, 0.05]
    decode = [plan(20.0, Slo(ttft_p90_s=0.3, itl_p90_s=i)).decode for i in itls]
    assert decode == sorted(decode, reverse=True) and decode[0] > decode[-1]


def test_corrections_scale_the_prediction():
    base = plan(24.0)
    slow = plan(24.0, corrections=Corrections(prefill=1.5, decode=1.5))
    assert slow.prefill > base.prefill and slow.decode > base.decode


def test_unreachable_slo_is_best_effort_and_says_so():
    result = plan_pools(Slo(ttft_p90_s=0.05, itl_p90_s=0.005), traffic(10.0), PREFILL, DECODE)
    assert not result.feasible
    assert result.prefill == math.ceil(10 * 0.1 / 0.8)  # sized for rho <= 0.8
    assert result.decode >= 1
    assert "not reachable" in result.explain()


def test_hysteresis_band_and_cooldowns():
    config = PlannerConfig(down_cooldown_s=60.0, down_headroom=0.2)
    # Rate 14 needs 2 prefill (246 ms), but 1.2x (rate 16.8) would need 3 (418 ms at 2): a pool of 3 holds.
    assert plan(14.0, state=PoolState(prefill=3, decode=2, last_change_s=0.0), now_s=1000.0, config=config).prefill == 3
    # Rate 5 needs 1; 1.2x (rate 6) needs 2: shrink to 2, not 1, and only after the cool-down.
    state = PoolState(prefill=3, decode=2, last_change_s=0.0)
    assert plan(5.0, state=state, now_s=30.0, config=config).prefill == 3
    assert plan(5.0, state=state, now_s=61.0, config=config).prefill == 2
    # Growth is immediate.
    assert plan(16.0, state=PoolState(prefill=1, decode=1, last_change_s=0.0), now_s=1.0, config=config).prefill == 3


def test_noisy_rate_at_a_boundary_does_not_oscillate():
    config = PlannerConfig(down_cooldown_s=0.0)
    state, changes = PoolState(), 0
    for step, rate in enumerate([14.0, 16.5, 13.5, 16.2, 14.5, 15.9, 13.8, 16.4] * 3):  # 2 workers up to ~15.5
        result = plan(rate, state=state, now_s=float(step), config=config)
        if state.prefill is not None and result.prefill != state.prefill:
            changes += 1
        state = PoolState(prefill=result.prefill, decode=result.decode, last_change_s=float(step))
    assert changes <= 1


def test_reasoning_names_every_term():
    text = plan(10.0).explain()
    for name in ("service time D", "utilization rho", "predicted TTFT p90", "batch at ITL target",
                 "concurrent sequences", "decision"):
        assert name in text
    assert text.splitlines()[-1] == "plan: 2 prefill, 2 decode"


@pytest.mark.parametrize("bad", [
    lambda: PrefillProfile(prompt_lens=(), tokens_per_s=()),
    lambda: PrefillProfile(prompt_lens=(10, 5), tokens_per_s=(1.0, 2.0)),
    lambda: DecodeProfile(batch_sizes=(1, 2), itl_s=(0.02, 0.01)),
    lambda: DecodeProfile(batch_sizes=(1,), itl_s=(0.0,)),
    lambda: plan(-1.0),
    lambda: plan(1.0, Slo(ttft_p90_s=0.0, itl_p90_s=0.02)),
    lambda: plan_pools(SLO, traffic(1.0, isl=float("nan")), PREFILL, DECODE),
])
def test_bad_input_is_invalid_request(bad):
    with pytest.raises(InvalidRequest):
        bad()


def test_itl_row_at_context_interpolates_between_profiled_contexts():
    grid = (10.0, 12.0, 20.0, 24.0)  # contexts 100 and 1100, batches 1 and 8
    assert itl_row_at_context((100, 1100), grid, 2, 600) == (15.0, 18.0)
    assert itl_row_at_context((100, 1100), grid, 2, 50) == (10.0, 12.0)  # flat beyond the ends
    assert itl_row_at_context((100, 1100), grid, 2, 5000) == (20.0, 24.0)
    with pytest.raises(InvalidRequest, match="2 x 2 values"):
        itl_row_at_context((100, 1100), grid[:3], 2, 600)
    with pytest.raises(InvalidRequest, match="must increase"):
        itl_row_at_context((1100, 100), grid, 2, 600)


def test_erlang_c_is_stable_at_any_pool_size():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # one server: waits with probability rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert 0.0 <= erlang_c(512, 0.001) < 1e-12  # tiny offered load on a big pool: no wait, no underflow error
    assert 0.0 < erlang_c(800, 780.0) < 1.0  # a^k / k! would overflow a float here
    assert prefill_ttft_p90_s(0.001, ((0.1, 0.5), (0.3, 0.5)), 512)[1] == pytest.approx(0.3)  # the longer half


def test_split_p90_ttft_by_hand():
    # round_robin / random: 2 workers at 10/s are two M/D/1 queues at 5/s each, rho 0.5: a prompt waits with
    # probability 0.5, P-K's mean wait 0.5 * 100 * 1 / (2 * 0.5) = 50 ms, so 100 ms once waiting
    rho, ttft_s = prefill_ttft_p90_s(10.0, ONE, 2, "split")
    assert rho == 0.5 and ttft_s == pytest.approx(0.1 + 0.1 * math.log(10 * 0.5))
    assert ttft_s > prefill_ttft_p90_s(10.0, ONE, 2, "pooled")[1]  # 100 + 50 ln(10/3) ms: one queue waits less
    # half 50 ms, half 150 ms (cs2 0.25): P-K's mean wait 5/s * E[S^2] 12.5e-3 / (2 * 0.5) = 62.5 ms
    mix = ((0.05, 0.5), (0.15, 0.5))
    waits, once_s = waiting(5.0, 0.1, 0.25, 1, "split")
    assert waits * once_s == pytest.approx(5.0 * 0.0125 / (2 * 0.5))
    assert waiting(10.0, 0.1, 0.25, 2, "split") == pytest.approx((0.5, 0.125))  # each worker at rate / n
    # P(TTFT > t) = 0.5 * 0.5 (e^-(t - .05)/.125 + e^-(t - .15)/.125) = 0.1 past 150 ms
    _, mixed_s = prefill_ttft_p90_s(10.0, mix, 2, "split")
    assert mixed_s == pytest.approx(0.125 * math.log((math.exp(0.4) + math.exp(1.2)) / 0.4))
    assert prefill_ttft_p90_s(20.0, ONE, 2, "split") == (1.0, math.inf)


def test_a_heavy_tailed_split_wait_takes_its_second_moment():
    # one worker at 1/s: 99% of prompts take 0.1 s, 1% take 10 s: E[S] 0.199, E[S^2] 1.0099, E[S^3] 10.00099
    mix, rho = ((0.1, 0.99), (10.0, 0.01)), 0.199
    wait_s = 1.0099 / (2 * (1 - rho))  # P-K
    wait2 = 2 * wait_s ** 2 + 10.00099 / (3 * (1 - rho))  # Takacs
    once_s, once2 = wait_s / rho, wait2 / rho
    assert once2 / once_s ** 2 - 1 == pytest.approx(1.48, abs=0.01)  # more variable than an exponential
    (p1, m1), (p2, m2) = wait_phases(1.0, mix, 1, "split")
    assert p1 + p2 == pytest.approx(rho)
    assert p1 * m1 + p2 * m2 == pytest.approx(wait_s)  # the mean wait, as before
    assert 2 * (p1 * m1 ** 2 + p2 * m2 ** 2) == pytest.approx(wait2)  # and now its second moment
    assert p1 * m1 == pytest.approx(p2 * m2)  # balanced means
    # an exponential of the mean alone puts more of the wait at the p90: the fit predicts a lower one
    exponential = ((rho, once_s),)
    p90 = prefill_ttft_p90_s(1.0, mix, 1, "split")[1]
    above = lambda t, phases: sum(w * (1.0 if t < s else sum(p * math.exp(-(t - s) / m) for p, m in phases))  # noqa
                                  for s, w in mix)
    assert above(p90, wait_phases(1.0, mix, 1, "split")) == pytest.approx(0.1, abs=1e-6)
    assert above(p90, exponential) > 0.1
    # the pooled wait and a light-tailed split one stay one exponential
    assert len(wait_phases(1.0, mix, 1, "pooled")) == 1
    assert len(wait_phases(1.0, ((0.1, 0.9), (3.0, 0.1)), 1, "split")) == 1  # cv2 0.82 once waiting


def test_split_dispatch_needs_more_workers_than_pooled():
    spread = Traffic(rate_per_s=20.0, mean_isl=1000, mean_osl=200, isl_mix=((500.0, 0.9), (5500.0, 0.1)))
    slo = Slo(ttft_p90_s=0.6, itl_p90_s=0.02)  # a tenth of the prompts take 550 ms
    pooled = plan_pools(slo, spread, PREFILL, DECODE)
    split = plan_pools(slo, spread, PREFILL, DECODE, dispatch="split")
    assert (pooled.prefill, split.prefill) == (3, 5) and split.decode == pooled.decode
    assert "M/G/n (pooled: cost, least_loaded, prefix_overlap)" in pooled.explain()
    assert "n x M/G/1 (split: round_robin, random)" in split.explain()
    # at 10/s of 100 ms prompts: pooled 2 workers (160 ms), split 2 workers predict 261 ms <= 300, and 3 for 14/s
    assert (plan(10.0).prefill, plan(10.0, dispatch="split").prefill) == (2, 2)
    assert (plan(14.0).prefill, plan(14.0, dispatch="split").prefill) == (2, 3)


def test_a_policy_maps_to_its_dispatch():
    assert set(DISPATCH) == set(POLICIES)  # every routing policy has one
    # cost and least_loaded send each prompt to the prefill worker with the least queued; prefix_overlap weighs the
    # queued blocks too; round_robin and random ignore the queues
    assert [dispatch_of(p) for p in ("cost", "least_loaded", "prefix_overlap")] == ["pooled"] * 3
    assert [dispatch_of(p) for p in ("round_robin", "random")] == ["split"] * 2
    with pytest.raises(InvalidRequest):
        dispatch_of("fastest")


def test_cached_prompt_tokens_cost_what_is_left_of_the_prompt():
    # 10k tok/s up to 1,000 tokens, 5k tok/s at 4,000: T(4000) = 0.8 s, T(1000) = 0.1 s
    slowing = PrefillProfile(prompt_lens=(1000, 4000), tokens_per_s=(10_000.0, 5_000.0))
    assert service_mix(slowing, 4000.0) == ((pytest.approx(0.8), 1.0),)
    # a quarter cached: tokens [1000, 4000) cost T(4000) - T(1000) = 0.7 s (the last tokens are the dear ones),
    # not 3/4 of 0.8 s
    assert service_mix(slowing, 4000.0, (), 0.25) == ((pytest.approx(0.7), 1.0),)
    assert service_mix(PREFILL, 1000.0, ((500.0, 0.5), (1500.0, 0.5)), 0.5) == (
        (pytest.approx(0.025), 0.5), (pytest.approx(0.075), 0.5))
    full = Traffic(rate_per_s=16.0, mean_isl=1000, mean_osl=200)
    cached = Traffic(rate_per_s=16.0, mean_isl=1000, mean_osl=200,
                     remote=RemotePrefill(rate_per_s=16.0, mean_isl=1000, cached_fraction=0.3))
    assert plan_pools(SLO, full, PREFILL, DECODE).prefill == 3  # rho 0.8 at 2 workers: 345 ms
    result = plan_pools(SLO, cached, PREFILL, DECODE)
    assert result.prefill == 2  # 70 ms prompts: rho 0.56 at 2 workers
    assert "30.0% of tokens cached: T(L) - T(hL)" in result.explain()


def test_the_prefill_pool_is_sized_on_its_own_rate():
    # the cost policy kept half the requests on the decode workers: the prefill pool sees 10 of 20 per second
    half = Traffic(rate_per_s=20.0, mean_isl=1000, mean_osl=200, remote=RemotePrefill(rate_per_s=10.0, mean_isl=1000))
    result = plan_pools(SLO, half, PREFILL, DECODE)
    assert (result.prefill, result.decode) == (plan(10.0).prefill, plan(20.0).decode) == (2, 3)
    assert plan(20.0).prefill == 3
    # the hysteresis band scales the prefill pool's rate too: 1.2 x 14/s needs 3 workers
    busy = Traffic(rate_per_s=20.0, mean_isl=1000, mean_osl=200, remote=RemotePrefill(rate_per_s=14.0, mean_isl=1000))
    assert plan_pools(SLO, busy, PREFILL, DECODE).prefill_plan.sticky == 3
    # without the remote series the plan is today's, field for field
    same = Traffic(rate_per_s=20.0, mean_isl=1000, mean_osl=200, remote=RemotePrefill(rate_per_s=20.0, mean_isl=1000))
    assert plan_pools(SLO, same, PREFILL, DECODE).prefill_plan.raw == plan(20.0).prefill_plan.raw
    with pytest.raises(InvalidRequest):
        plan_pools(SLO, Traffic(rate_per_s=1.0, mean_isl=1000, mean_osl=200,
                                remote=RemotePrefill(rate_per_s=1.0, mean_isl=1000, cached_fraction=1.0)),
                   PREFILL, DECODE)
