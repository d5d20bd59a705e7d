"""`bench decision-latency --workers`: both paths decide on the same filled index, the new one prices a handful
past ``PreselectConfig.above`` workers, and memory is measured for both mirrors (a small, in-memory run)."""

from __future__ import annotations

import argparse
import random

from bench import decision_scale


def test_a_small_sweep_reports_both_paths_and_both_mirrors(capsys):
    args = argparse.Namespace(workers=[8, 100], index_entries=4_000, scale_decisions=10, memory_entries=40_000,
                              no_redis=True, lookups=10)
    rng = random.Random(0)
    report = decision_scale.run(args, rng, rng.randbytes(32))
    small, large = report["rows"]
    assert small["decision"]["old"]["candidates"] == small["decision"]["new"]["candidates"] == 8
    assert large["decision"]["old"]["candidates"] == 100 and large["decision"]["new"]["candidates"] <= 22
    assert large["index_entries"] >= 3_900
    memory = report["memory_bytes_per_entry"]
    assert 0 < memory["new_bitmap_mirror"] < memory["old_set_mirror"]
    decision_scale.print_table(report)
    assert "priced old/new" in capsys.readouterr().out
