"""bench.routers' figures: the peak of prompts waiting for their first token on one worker, and the summary."""

from __future__ import annotations

from bench.routers import Sent, peak_prefills, summarize


def sent(worker: str, at_s: float, ttft_s: float) -> Sent:
    return Sent(router=0, decode_worker=worker, route_kind="local", ttft_s=ttft_s, e2e_s=ttft_s + 1.0, sent_at_s=at_s)


def test_the_peak_counts_prompts_waiting_at_once_on_one_worker():
    burst = [sent("d0", 0.0, 0.5), sent("d0", 0.1, 0.5), sent("d1", 0.2, 0.1), sent("d0", 0.7, 0.1)]
    assert peak_prefills(burst) == 2  # the first two overlap on d0; the third d0 prompt came after both
    assert peak_prefills([sent("d0", 0.0, 0.1), sent("d0", 0.1, 0.1)]) == 1  # one answered as the next arrived


def test_the_summary_pools_runs_and_averages_their_peaks():
    runs = [[sent("d0", 0.0, 0.2), sent("d0", 0.0, 0.4)], [sent("d1", 0.0, 0.2), sent("d2", 0.0, 0.2)]]
    s = summarize([x for run in runs for x in run], runs)
    assert s["per_worker"] == {"d0": 2, "d1": 1, "d2": 1} and s["max_share"] == 0.5
    assert s["peak_prefills_mean"] == 1.5 and s["runs"] == 2 and s["requests"] == 4
    assert 200 <= s["ttft_p50_ms"] <= 400
