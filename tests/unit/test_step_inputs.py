"""``engine.step_inputs.StepInputs``: a step's inputs in persistent buffers, equal to building them from lists."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.core.outputs import ScheduledSeq
from engine.step_inputs import StepInputs


def _seq(tokens: list[int], start: int, count: int, samples: bool) -> ScheduledSeq:
    return ScheduledSeq(SimpleNamespace(all_token_ids=tokens), start, count, (0,), samples)


def _from_lists(seqs: list[ScheduledSeq]) -> tuple[list[int], list[int], list[int]]:
    """What the runner built before: one list walk per token."""
    ids, positions, rows = [], [], []
    for s in seqs:
        ids.extend(s.request.all_token_ids[s.start : s.end])
        positions.extend(range(s.start, s.end))
        if s.samples:
            rows.append(len(ids) - 1)
    return ids, positions, rows


MIXED = [
    _seq(list(range(100, 140)), 16, 24, True),  # the last chunk of a prefill, prefix of 16 cached
    _seq(list(range(200, 210)), 9, 1, True),  # a decode
    _seq(list(range(300, 364)), 0, 32, False),  # a first chunk: computes KV, samples nothing
    _seq([7, 8, 9], 2, 1, True),  # another decode
]


def test_fill_equals_the_inputs_built_from_lists():
    inputs = StepInputs(torch.device("cpu"))
    got = inputs.fill(MIXED)
    for tensor, expected in zip(got, _from_lists(MIXED)):
        assert tensor.dtype == torch.int64 and tensor.tolist() == expected


def test_buffers_are_reused_and_grow_only_when_a_step_needs_more():
    inputs = StepInputs(torch.device("cpu"), capacity=64)
    first = inputs.fill(MIXED)
    pointers = [t.data_ptr() for t in first]
    decodes = [s for s in MIXED if s.num_new_tokens == 1]
    again = inputs.fill(decodes)
    assert [t.data_ptr() for t in again] == pointers and inputs.grown == 1  # same memory, no allocation
    assert [t.tolist() for t in again] == list(_from_lists(decodes))

    big = [_seq(list(range(1000)), 0, 1000, True), *MIXED]
    grown = inputs.fill(big)
    assert inputs.grown == 2 and inputs.capacity >= 1057
    assert [t.tolist() for t in grown] == list(_from_lists(big))
    assert [t.tolist() for t in inputs.fill(MIXED)] == list(_from_lists(MIXED))  # smaller again: stale tail unused


def test_a_step_where_nothing_samples_has_no_logit_rows():
    ids, positions, rows = StepInputs(torch.device("cpu")).fill([MIXED[2]])
    assert ids.tolist() == list(range(300, 332)) and positions.tolist() == list(range(32)) and rows.numel() == 0
