"""``baton bench compare``: core plans, the comparison's ratios and knee, and one tiny real run of both layouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import compare
from bench.launcher import Layout, core_plan, pinned


def test_core_plan_gives_each_worker_its_own_core_and_router_a_shared_one():
    agg = core_plan(Layout(name="aggregated", prefill=0, decode=2), [0, 1])
    assert agg.worker_cores == (("decode", "d0", 0), ("decode", "d1", 1))
    assert agg.router_core == 1  # no spare core: shares the last (decode) worker's
    disagg = core_plan(Layout(name="disaggregated", prefill=1, decode=1), [0, 1])
    assert disagg.worker_cores == (("prefill", "p0", 0), ("decode", "d0", 1))
    assert disagg.router_core == 1
    spare = core_plan(Layout(name="disaggregated", prefill=1, decode=2), [2, 3, 5, 7])
    assert [core for _, _, core in spare.worker_cores] == [2, 3, 5] and spare.router_core == 7
    assert core_plan(Layout(name="aggregated", prefill=0, decode=2), [0, 1], router_core=0).router_core == 0
    with pytest.raises(ValueError, match="needs 3 cores"):
        core_plan(Layout(name="aggregated", prefill=0, decode=3), [0, 1])


def test_pinned_processes_run_only_on_their_core():
    core = max(os.sched_getaffinity(0))
    cmd, preexec_fn = pinned([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], {core})
    out = subprocess.run(cmd, preexec_fn=preexec_fn, capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() == f"[{core}]"


def _run(rate: float, itl_p99: float, goodput: float, attainment: float) -> dict:
    return {"rate": rate, "itl_ms": {"p99": itl_p99}, "goodput": goodput, "slo_attainment": attainment}


def test_compare_reports_ratios_and_the_goodput_ratio_where_aggregated_first_misses():
    agg = [_run(1, 100.0, 1.0, 1.0), _run(2, 400.0, 1.5, 0.8), _run(4, 800.0, 0.0, 0.0)]
    disagg = [_run(1, 40.0, 1.0, 1.0), _run(2, 100.0, 1.9, 0.95), _run(4, 200.0, 2.0, 0.5)]
    result = compare.compare(agg, disagg, attainment=0.9)
    assert [row["p99_itl_ratio"] for row in result["per_rate"]] == pytest.approx([0.4, 0.25, 0.25])
    assert [row["goodput_ratio"] for row in result["per_rate"]][:2] == pytest.approx([1.0, 1.9 / 1.5])
    assert result["per_rate"][2]["goodput_ratio"] is None  # aggregated goodput 0: no finite ratio
    assert result["knee"]["rate"] == 2 and result["knee"]["goodput_ratio"] == pytest.approx(1.9 / 1.5)
    assert result["max_rate_meeting_attainment"] == {"aggregated": 1, "disaggregated": 2}
    calm = compare.compare(agg[:1], disagg[:1], attainment=0.9)
    assert calm["knee"] is None and calm["max_rate_meeting_attainment"]["aggregated"] == 1
    compare.print_table(result)  # formats None ratios without failing


def test_slo_grid_judges_stored_requests_by_other_slos():
    def run(rate: float, requests: list[tuple[float, float]]) -> dict:  # (ttft s, e2e s), 11 tokens each
        return {"rate": rate, "duration_s": 10.0, "requests": [
            {"ok": True, "ttft_s": t, "e2e_s": e, "output_tokens": 11} for t, e in requests]}
    fast, slow_start, slow_tokens = (0.5, 1.0), (4.0, 4.5), (0.5, 3.5)  # tpot 50, 50 and 300 ms
    agg = [run(1, [fast] * 10), run(2, [fast] * 8 + [slow_tokens] * 2)]
    disagg = [run(1, [fast] * 10), run(2, [fast] * 8 + [slow_start] * 2)]
    grid = compare.slo_grid(agg, disagg, [3000, 5000], [100], attainment=0.9)
    strict, loose = grid
    assert strict["knee_rate"] == 2 and strict["goodput_ratio_at_knee"] == pytest.approx(1.0)  # 8 vs 8 good
    assert strict["max_rate_meeting_attainment"] == {"aggregated": 1, "disaggregated": 1}
    # a 5 s TTFT SLO lets the slow starts through, not the slow tokens
    assert loose["goodput_ratio_at_knee"] == pytest.approx(10 / 8)
    assert loose["max_rate_meeting_attainment"] == {"aggregated": 1, "disaggregated": 2}
    assert loose["per_rate"][1]["disaggregated"] == {"attainment": 1.0, "goodput": 1.0}
    compare.print_slo_grid(grid)


def test_parse_rejects_a_layout_without_decode_cores():
    with pytest.raises(SystemExit):
        compare._parse(["--cores", "2", "--prefill", "2"])
    assert compare._parse(["--rates", "4,1"]).rates == [1.0, 4.0]


@pytest.mark.slow
def test_tiny_compare_writes_json_whose_counts_match_the_requests_sent(tmp_path, tmp_path_factory):
    from tests.tiny_model import shared_tiny
    from tests.redis_server import require_redis_server

    require_redis_server()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores (one per worker)")
    model_dir = shared_tiny(tmp_path_factory)
    out = tmp_path / "out"
    rc = compare.main(["--model", str(model_dir), "--rates", "2,4", "--num-requests", "5", "--max-output-len", "6",
                       "--long-tokens", "128", "--long-fraction", "0.5", "--policy", "least_loaded",
                       "--disagg-threshold-tokens", "16", "--warmup", "1", "--out", str(out)])
    report = json.loads((out / "compare.json").read_text())
    assert rc == 0
    assert set(report["layouts"]) == {"aggregated", "disaggregated"}
    assert report["layouts"]["aggregated"]["shape"] == "0P+2D"
    assert report["layouts"]["disaggregated"]["shape"] == "1P+1D"
    for layout in report["layouts"].values():
        assert [run["rate"] for run in layout["runs"]] == [2.0, 4.0]
        for run in layout["runs"]:
            assert (run["num_requests"], run["completed"], run["failed"]) == (5, 5, 0)
            assert len(run["requests"]) == 5 and all(0 < r["output_tokens"] <= 6 for r in run["requests"])
    agg_runs, disagg_runs = report["layouts"]["aggregated"]["runs"], report["layouts"]["disaggregated"]["runs"]
    for a, d in zip(agg_runs, disagg_runs):  # the same requests against both layouts
        assert [r["prompt_tokens"] for r in a["requests"]] == [r["prompt_tokens"] for r in d["requests"]]
    agg_routes = [run["route_kinds"] for run in report["layouts"]["aggregated"]["runs"]]
    assert agg_routes == [{"local": 5}, {"local": 5}]  # no prefill worker: every prompt prefills on decode
    assert all(run["route_kinds"].get("remote", 0) > 0 for run in report["layouts"]["disaggregated"]["runs"])
    assert [row["rate"] for row in report["per_rate"]] == [2.0, 4.0]
    assert (out / "compare_itl.png").stat().st_size > 0 and (out / "compare_goodput.png").stat().st_size > 0
