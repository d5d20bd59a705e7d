"""bench.kv_staging end to end at a small size: both pulls run (the staged one checked byte for byte against the
in-place one inside the bench) and the JSON holds one row per size."""

from __future__ import annotations

import json

from bench import kv_staging


def test_the_staging_bench_writes_a_row_per_size(tmp_path):
    out = tmp_path / "kv_staging.json"
    assert kv_staging.main(["--tokens", "64", "256", "--runs", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["tokens"] for r in rows] == [64, 256]
    assert all(r["in_place_gbps"] > 0 and r["staged_gbps"] > 0 for r in rows)
