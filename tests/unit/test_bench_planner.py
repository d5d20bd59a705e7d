"""The pure parts of ``bench/planner.py``: schedule, interval bucketing, attainment, worker-seconds."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.planner import (Phase, PoolSample, Trace, arrival_offsets, attainment, bucket, clamp, p90, parse_phases,
                           rate_at, target, total_s, worker_seconds)

PHASES = (Phase(2.0, 20.0), Phase(8.0, 30.0), Phase(2.0, 20.0))


def test_parse_phases_reads_rate_and_seconds() -> None:
    assert parse_phases("2:20,8:30,2:20") == PHASES
    assert total_s(PHASES) == 70.0


@pytest.mark.parametrize("text", ["", "2", "2:0", "-1:10", "a:b", "inf:10"])
def test_parse_phases_refuses_malformed(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_phases(text)


def test_rate_at_follows_the_phases_and_is_zero_past_the_end() -> None:
    assert [rate_at(PHASES, t) for t in (0.0, 19.9, 20.0, 49.9, 50.0, 69.9, 70.0)] == [2, 2, 8, 8, 2, 2, 0]


def test_arrivals_stay_inside_their_phase_and_follow_its_rate() -> None:
    phases = (Phase(5.0, 100.0), Phase(0.0, 50.0), Phase(20.0, 100.0))
    offsets = arrival_offsets(phases, seed=3)
    assert offsets == sorted(offsets) and offsets == arrival_offsets(phases, seed=3)
    counts = [sum(lo <= t < hi for t in offsets) for lo, hi in ((0, 100), (100, 150), (150, 250))]
    assert counts[1] == 0
    assert 400 <= counts[0] <= 600 and 1700 <= counts[2] <= 2300  # Poisson: mean 500 and 2000
    assert max(offsets) < 250


def test_p90_is_infinite_when_failures_reach_it() -> None:
    assert p90([]) is None
    assert p90([float(i) for i in range(1, 11)]) == pytest.approx(9.1)
    assert p90([1.0] * 10 + [math.inf]) == 1.0  # the 90th of 11 is the 10th value
    assert math.isinf(p90([1.0] * 9 + [math.inf]))  # the 90th of 10 lies between the 9th and the failure


def test_bucket_puts_ttft_by_send_time_and_itl_by_gap_end() -> None:
    traces = [Trace(1.0, (1.1, 1.15, 1.2), True),  # interval 0: TTFT 100 ms, gaps 50 ms
              Trace(9.0, (10.5, 10.6), True),  # sent in interval 0, its gap ends in interval 1
              Trace(12.0, (), False)]  # failed in interval 1: infinite TTFT
    rows = bucket(traces, (Phase(1.0, 20.0), Phase(3.0, 5.0)), interval_s=10.0, ttft_slo_ms=2000.0,
                  itl_slo_ms=60.0)
    assert [(r.start_s, r.rate_per_s, r.num_requests) for r in rows] == [(0.0, 1.0, 2), (10.0, 1.0, 1), (20.0, 3.0, 0)]
    assert rows[0].ttft_p90_ms == pytest.approx(100 + 0.9 * 1400)  # p90 of 100 and 1500 ms
    assert rows[0].itl_p90_ms == pytest.approx(50.0) and rows[0].met is True
    assert math.isinf(rows[1].ttft_p90_ms) and rows[1].itl_p90_ms == pytest.approx(100.0) and rows[1].met is False
    assert rows[2].met is None and rows[2].ttft_p90_ms is None


def test_attainment_counts_only_intervals_with_traffic() -> None:
    rows = bucket([Trace(1.0, (1.1, 1.12), True), Trace(11.0, (13.0, 13.01), True)], (Phase(1.0, 30.0),),
                  interval_s=10.0, ttft_slo_ms=500.0, itl_slo_ms=60.0)
    assert [r.met for r in rows] == [True, False, None]
    assert attainment(rows) == 0.5
    assert attainment(rows[2:]) is None


def test_worker_seconds_integrates_the_step_function_up_to_the_end() -> None:
    samples = [PoolSample(0.0, {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}),
               PoolSample(10.0, {"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 2}),
               PoolSample(30.0, {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}),
               PoolSample(50.0, {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1})]  # past the end
    assert worker_seconds(samples, end_s=40.0) == 2 * 10 + 3 * 20 + 2 * 10
    assert worker_seconds([], end_s=40.0) == 0.0


def test_clamp_and_target() -> None:
    assert [clamp(n, 2) for n in (0, 1, 2, 12)] == [1, 1, 2, 2]
    assert target({"attainment": 0.92, "worker_seconds": 450.0}, {"attainment": 1.0, "worker_seconds": 570.0}) == {
        "attainment_met": True, "ratio": pytest.approx(450 / 570), "met": True}
    assert target({"attainment": 0.85, "worker_seconds": 450.0}, {"worker_seconds": 570.0})["met"] is False
    assert target({"attainment": 1.0, "worker_seconds": 600.0}, {"worker_seconds": 570.0})["met"] is False
