"""workload/trace.py: Mooncake-format traces read, scaled, and turned into token ids that share exactly what the trace's
hash ids share (the loader the simulator and trace replays use)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workload.trace import (
    TRACE_BLOCK_TOKENS, Scale, TraceError, TraceRequest, block_spans, block_token_ids, load_trace, parse_trace,
    prompt_token_ids,
)

SLICE = Path(__file__).resolve().parents[1] / "data" / "conversation_trace_head300.jsonl"


def _line(**fields) -> str:
    doc = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]} | fields
    return json.dumps(doc)


def test_the_committed_slice_loads_in_arrival_order():
    trace = load_trace(SLICE)
    assert len(trace) == 300
    assert trace[0] == TraceRequest(timestamp_ms=0, input_length=6758, output_length=500, hash_ids=tuple(range(14)))
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)
    assert load_trace(SLICE, limit=5) == trace[:5]


@pytest.mark.parametrize(("line", "why"), [
    ("not json", "not a Mooncake trace request"),
    (_line(hash_ids=[1]), "need 2 hash ids"),  # 600 tokens span two 512-token blocks
    (_line(input_length=0, hash_ids=[]), ">= 1"),
    ('{"timestamp": 0, "input_length": 3}', "not a Mooncake trace request"),
])
def test_a_bad_line_is_refused_naming_the_line(line, why):
    with pytest.raises(TraceError, match=why) as raised:
        parse_trace(["", _line(), line], name="t.jsonl")
    assert "t.jsonl:3" in str(raised.value)


def test_out_of_order_lines_are_sorted_stably():
    trace = parse_trace([_line(timestamp=5, output_length=1), _line(timestamp=1), _line(timestamp=5, output_length=2)])
    assert [(r.timestamp_ms, r.output_length) for r in trace] == [(1, 10), (5, 1), (5, 2)]


def test_scaling_divides_lengths_and_multiplies_time():
    request = TraceRequest(timestamp_ms=3000, input_length=1000, output_length=3, hash_ids=(7, 8))
    scale = Scale(length_scale=32, time_scale=0.5)
    assert scale.block_tokens == 16
    assert scale.arrival_s(request) == 1.5
    assert scale.input_tokens(request) == 32  # ceil(1000 / 32): still two blocks, the second partial
    assert scale.output_tokens(request) == 1  # never 0
    assert block_spans(request, scale) == [(7, 16), (8, 16)]
    assert block_spans(request, Scale()) == [(7, 512), (8, 488)]
    with pytest.raises(ValueError, match="divide"):
        Scale(length_scale=3)
    with pytest.raises(ValueError, match="time_scale"):
        Scale(time_scale=0)


def test_token_ids_depend_on_the_hash_id_alone():
    a = block_token_ids(42, TRACE_BLOCK_TOKENS, 1000)
    assert a.tolist() == block_token_ids(42, TRACE_BLOCK_TOKENS, 1000).tolist()
    assert block_token_ids(42, 100, 1000).tolist() == a[:100].tolist()  # a partial block is a prefix
    assert a.tolist() != block_token_ids(43, TRACE_BLOCK_TOKENS, 1000).tolist()
    assert 4 <= a.min() and a.max() < 1000
    assert len(set(a.tolist())) > 350  # spread like uniform draws (~400 distinct of 996), not a constant
    # pinned values: the mapping is part of what a replayed trace means; it must not change silently
    assert a[:4].tolist() == block_token_ids(42, 4, 1000).tolist() == [753, 512, 262, 812]


def test_requests_sharing_ids_share_exactly_those_tokens():
    scale = Scale(length_scale=32)
    first = TraceRequest(timestamp_ms=0, input_length=1500, output_length=1, hash_ids=(0, 1, 2))
    second = TraceRequest(timestamp_ms=0, input_length=1100, output_length=1, hash_ids=(0, 1, 9))
    a, b = prompt_token_ids(first, scale, 5000), prompt_token_ids(second, scale, 5000)
    assert (len(a), len(b)) == (47, 35)
    assert a[:32] == b[:32] and a[32:35] != b[32:35]
