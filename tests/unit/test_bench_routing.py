"""The routing benchmark's pure parts: repeats, pooling, and the paired bootstrap that says what is noise."""

from __future__ import annotations

import random

from bench.routing import Outcome, figures, oracle_ttft_floor, paired_bootstrap, rotated, summarize


def outcome(ttft_s: float, cached: int = 0, itl_s: float = 0.03) -> Outcome:
    return Outcome(ttft_s=ttft_s, itl_s=[itl_s] * 3, prompt_tokens=100, cached_tokens=cached, output_tokens=4,
                   finished_s=1.0 + ttft_s, route_kind="remote", decode_worker="d0")


def test_rotation_puts_every_policy_first_once_per_cycle():
    policies = ["cost", "round_robin", "prefix_overlap"]
    assert [rotated(policies, r)[0] for r in range(4)] == ["cost", "round_robin", "prefix_overlap", "cost"]
    assert sorted(rotated(policies, 2)) == sorted(policies)


def test_pooled_figures_and_per_run_throughput():
    runs = [[outcome(0.1, 50), outcome(0.3, 0)], [outcome(0.2, 100), outcome(0.4, 50)]]
    s = summarize([o for run in runs for o in run], runs)
    assert s["requests"] == 4 and s["hit_rate"] == 200 / 400
    assert s["ttft_p50_ms"] == 300.0  # the pooled median (upper of the two middle values)
    assert s["output_tokens_per_s"] == (8 / 1.3 + 8 / 1.4) / 2  # the mean of the runs' rates


def test_a_clear_difference_is_outside_the_noise_and_identical_policies_are_within_it():
    rng = random.Random(1)
    base = [[rng.uniform(0.1, 1.0) for _ in range(40)] for _ in range(3)]
    slow = [[outcome(t + 0.5, cached=10) for t in run] for run in base]
    fast = [[outcome(t, cached=60) for t in run] for run in base]
    cmp = paired_bootstrap(fast, slow, samples=300)
    assert cmp["ttft_p50_ms"]["verdict"] == "better" and cmp["ttft_p50_ms"]["ci95"][1] < 0
    assert cmp["hit_rate"]["verdict"] == "better"  # higher is better for the hit rate
    assert paired_bootstrap(slow, fast, samples=300)["hit_rate"]["verdict"] == "worse"
    same = paired_bootstrap(fast, [[outcome(t, cached=60) for t in run] for run in base], samples=300)
    assert {c["verdict"] for c in same.values()} == {"within noise"}
    shuffled = [[outcome(t, cached=60) for t in rng.sample(run, len(run))] for run in base]  # same spread, unpaired
    assert paired_bootstrap(fast, shuffled, samples=300)["ttft_p90_ms"]["verdict"] == "within noise"


def test_figures_of_a_resample_match_the_definitions():
    f = figures([outcome(0.1, 100, itl_s=0.01), outcome(0.2, 0, itl_s=0.05)])
    assert f["hit_rate"] == 0.5 and f["itl_p50_ms"] == 50.0 and f["ttft_p90_ms"] == 200.0


def test_oracle_floor_prices_the_oracles_uncached_tokens_at_measured_ttfts():
    def req(computed: int, cached: int = 0) -> Outcome:  # ttft = 20 ms + 2 ms per computed token, exactly
        o = outcome((20 + 2 * computed) / 1e3, cached=cached)
        o.prompt_tokens = computed + cached
        return o

    a = [req(10, 90), req(50, 50), req(100, 0), req(30, 70), req(60, 40), req(400, 0)]
    floor = oracle_ttft_floor({"a": [a]}, oracles=[[96, 64, 0, 70, 96, 0]], neighbours=1)
    # the oracle leaves 4, 36, 100, 30, 4, 400 tokens: nearest measured 10, 30, 100, 30, 10, 400
    assert floor["ttft_p50_ms"] == 20 + 2 * 30 and floor["measured_requests"] == 6  # of 40, 40, 80, 80, 220, 820
    assert oracle_ttft_floor({"a": [a]}, [[0] * 6], neighbours=7) is None  # too few measurements


def _report(oracle: float, floor_ms: float | None, **policies: tuple[float, float]) -> dict:
    """A routing report with only what the sweep reads: per policy (hit rate, TTFT p50 ms)."""
    figs = {name: {"hit_rate": hit, "ttft_p50_ms": p50, "ttft_p90_ms": 2 * p50, "itl_p50_ms": 30.0,
                   "itl_p99_ms": 90.0} for name, (hit, p50) in policies.items()}
    return {"oracle_hit_rate": oracle, "policies": figs,
            "oracle_ttft_floor": None if floor_ms is None else {"ttft_p50_ms": floor_ms}}


def test_sweep_rows_take_ratios_over_the_baseline_at_each_size():
    from bench.routing_sweep import prompt_blocks_per_worker, sweep_rows

    reports = {1024: _report(0.8, 180.0, cost=(0.76, 200.0), round_robin=(0.72, 250.0)),
               320: _report(0.8, 180.0, cost=(0.74, 240.0), round_robin=(0.40, 2400.0))}
    rows = sweep_rows(reports)
    assert [(r["num_blocks"], r["policy"]) for r in rows] == [
        (320, "cost"), (320, "round_robin"), (1024, "cost"), (1024, "round_robin")]
    small_cost, _, big_cost, big_rr = rows
    assert small_cost["ttft_p50_vs_baseline"] == 0.1 and big_cost["ttft_p50_vs_baseline"] == 0.8
    assert big_rr["ttft_p50_vs_baseline"] == 1.0 and big_rr["floor_vs_baseline"] == 180.0 / 250.0
    assert small_cost["hit_of_oracle"] == 0.74 / 0.8
    no_baseline = sweep_rows({320: _report(0.8, None, cost=(0.7, 200.0))})
    assert no_baseline[0]["ttft_p50_vs_baseline"] is None and no_baseline[0]["floor_vs_baseline"] is None
    assert prompt_blocks_per_worker(8, 1000) == 8 * 63  # 1,000 tokens span 63 blocks of 16


def test_routing_out_names_the_results_file_and_stays_out_of_the_workload():
    from bench.routing import _parse

    assert _parse([]).out == "routing"
    assert _parse(["--out", "routing_sweep_320", "--num-blocks", "320"]).out == "routing_sweep_320"
