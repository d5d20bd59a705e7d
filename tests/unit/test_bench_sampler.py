"""The sampler benchmark's core runs both samplers on tiny sizes and reports every cell (no timings asserted)."""

from __future__ import annotations

import torch

from bench import sampler as bench_sampler
from bench.__main__ import _BENCHMARKS


def test_grid_report_has_a_row_per_vocab_batch_and_mode_with_both_samplers():
    lines: list[str] = []
    with torch.inference_mode():
        cells = bench_sampler.run_grid([300, 520], [1, 3], list(bench_sampler.MODES), steps=1, budget_s=0.0,
                                       progress=lines.append)
    assert len(cells) == len(lines) == 2 * 2 * len(bench_sampler.MODES) * 2
    assert {c.impl for c in cells} == {"new", "old"} and all(c.steps >= 1 and c.total_ms > 0 for c in cells)
    result = bench_sampler.report(cells)
    rows = result["rows"]
    assert [(r["vocab"], r["batch"], r["mode"]) for r in rows] == [
        (v, b, m) for v in (300, 520) for b in (1, 3) for m in bench_sampler.MODES]
    assert all(r["new_over_new_greedy"] is not None and r["new_over_old"] > 0 for r in rows)
    assert result["targets"] == []  # the targets are for B32 at 49k / 152k vocabularies
    table = bench_sampler._table(result)
    assert len(table.splitlines()) == 2 + len(rows)


def test_registered_as_a_bench_command():
    assert _BENCHMARKS["sampler"] == "bench.sampler"
