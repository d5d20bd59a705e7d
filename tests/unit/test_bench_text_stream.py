"""bench.text_stream at a small size on SmolLM2's tokenizer: a row per length, both streams timed."""

from __future__ import annotations

import json

from bench import text_stream


def test_the_text_stream_bench_writes_a_row_per_length(tmp_path):
    out = tmp_path / "text_stream.json"
    assert text_stream.main(["--tokens", "50", "200", "--runs", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["tokens"] for r in rows] == [50, 200]
    assert all(r["detokenizer_us"] > 0 and r["text_stream_us"] > 0 for r in rows)
