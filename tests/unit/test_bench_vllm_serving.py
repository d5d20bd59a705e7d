"""``python -m bench vllm-serving``'s pure parts: goodput against the SLOs, the table, the targets' names."""

from __future__ import annotations

import pytest

from bench.trace_replay.outcomes import Outcome, summarize
from bench.serving_targets import TARGETS, start
from bench.vllm_serving import serving_figures, table


def outcome(i: int, ttft_ms: float, itl_ms: float, ok: bool = True) -> Outcome:
    return Outcome(index=i, ok=ok, prompt_tokens=100, output_tokens=10, ttft_s=ttft_ms / 1e3, itl_ms=itl_ms,
                   error="" if ok else "HTTP 500")


def test_goodput_counts_the_completed_requests_within_both_slos():
    outcomes = [outcome(0, 100, 50), outcome(1, 5000, 50), outcome(2, 100, 900), outcome(3, 3000, 200),
                outcome(4, 10, 10, ok=False)]
    figures = serving_figures(outcomes, 10.0, slo_ttft_ms=3000, slo_itl_ms=200)
    assert figures["good_requests"] == 2 and figures["goodput_rps"] == pytest.approx(0.2)  # #0 and #3 (on the SLOs)
    assert figures["failed"] == 1 and figures["itl_ms"]["p50"] == pytest.approx(125.0)  # of 50, 50, 200, 900


def test_the_table_has_a_row_per_target_and_says_whether_its_texts_match_the_first():
    runs = []
    for name, equal in (("vllm", True), ("baton", False)):
        outcomes = [outcome(0, 100, 50)]
        run = summarize(outcomes, 1.0)
        run.update(target=name, loadavg_before="1.0 1.0 1.0", loadavg_after="2.0 1.0 1.0", probe_equal_to_first=equal,
                   **serving_figures(outcomes, 1.0, 3000, 200))
        runs.append(run)
    rows = table({"runs": runs}).splitlines()
    assert rows[2].startswith("| vllm | 1/1 | 0 |") and "| = |" in rows[2] and "| differs |" in rows[3]


def test_an_unknown_target_is_refused_by_name():
    assert "baton-vllm" in TARGETS and "vllm-router:kv_aware" in TARGETS
    with pytest.raises(SystemExit, match="unknown target 'sglang'"):
        start("sglang", None, None, None, "m", None)
