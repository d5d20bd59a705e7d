"""``engine.step_inputs.StepInputs``: a step's inputs in persistent buffers, equal to building them from lists;
``engine.block_table.BlockTables``: each request's row written incrementally."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from engine.attention.base import SeqSlice, StepBatch
from engine.block_table import BlockTables
from engine.core.outputs import ScheduledSeq
from engine.step_inputs import StepInputs

BS = 4  # block size


def _seq(rid: str, tokens: list[int], start: int, count: int, samples: bool, blocks=None,
         preemptions: int = 0) -> ScheduledSeq:
    blocks = tuple(blocks) if blocks is not None else tuple(range(100, 100 + -(-(start + count) // BS)))
    request = SimpleNamespace(request_id=rid, all_token_ids=tokens, num_preemptions=preemptions, num_window_freed=0)
    return ScheduledSeq(request, start, count, blocks, samples)


def _from_lists(seqs: list[ScheduledSeq]) -> tuple[list[int], list[int], list[int], list[int]]:
    """What the runner built before: one list walk per token (ids, positions, logit rows, KV slots)."""
    ids, positions, rows, slots = [], [], [], []
    for s in seqs:
        ids.extend(s.request.all_token_ids[s.start : s.end])
        positions.extend(range(s.start, s.end))
        slots.extend(s.block_ids[p // BS] * BS + p % BS for p in range(s.start, s.end))
        if s.samples:
            rows.append(len(ids) - 1)
    return ids, positions, rows, slots


MIXED = [
    _seq("a", list(range(100, 140)), 16, 24, True, [7, 3, 9, 1, 12, 5, 6, 2, 8, 4]),  # last chunk, 16 cached
    _seq("b", list(range(200, 210)), 9, 1, True, [11, 13, 10]),  # a decode
    _seq("c", list(range(300, 364)), 0, 32, False, range(20, 28)),  # a first chunk: samples nothing
    _seq("d", [7, 8, 9], 2, 1, True, [14]),  # another decode
]


def _got(inputs: StepInputs, seqs) -> tuple[list[int], ...]:
    ids, rows, batch = inputs.fill(seqs)
    assert {t.dtype for t in (ids, rows, batch.positions, batch.slots)} == {torch.int64}
    return ids.tolist(), batch.positions.tolist(), rows.tolist(), batch.slots.tolist()


def test_fill_equals_the_inputs_built_from_lists():
    inputs = StepInputs(torch.device("cpu"), BS)
    assert _got(inputs, MIXED) == _from_lists(MIXED)
    _, _, batch = inputs.fill(MIXED)
    assert batch.context_lens.tolist() == [40, 10, 32, 3] and batch.counts.tolist() == [24, 1, 32, 1]
    assert batch.block_table.shape == (4, 10)  # the longest context's blocks
    for row, s in zip(batch.block_table.tolist(), MIXED):
        assert row[: len(s.block_ids)] == list(s.block_ids)[:10]
    assert np.array_equal(batch.block_table_host, batch.block_table.numpy())


def test_fill_equals_a_batch_built_from_slices():
    _, _, batch = StepInputs(torch.device("cpu"), BS).fill(MIXED)
    slices = [SeqSlice(s.start, s.num_new_tokens, s.block_ids) for s in MIXED]
    reference = StepBatch.from_slices(slices, BS, torch.device("cpu"))
    for name in ("positions", "slots", "context_lens", "block_table"):
        assert torch.equal(getattr(batch, name), getattr(reference, name)), name


def test_buffers_are_reused_and_grow_only_when_a_step_needs_more():
    inputs = StepInputs(torch.device("cpu"), BS, capacity=256)
    first = inputs.fill(MIXED)[0]
    decodes = [s for s in MIXED if s.num_new_tokens == 1]
    again = inputs.fill(decodes)[0]
    assert again.data_ptr() == first.data_ptr() and inputs.grown == 1  # same memory, no allocation
    assert _got(inputs, decodes) == _from_lists(decodes)

    big = [_seq("e", list(range(1000)), 0, 1000, True), *MIXED]
    assert _got(inputs, big) == _from_lists(big)
    assert inputs.grown == 2 and inputs.capacity >= 3 * 1057
    assert _got(inputs, MIXED) == _from_lists(MIXED)  # smaller again: stale tail unused


def test_a_step_where_nothing_samples_has_no_logit_rows():
    ids, positions, rows, _ = _got(StepInputs(torch.device("cpu"), BS), [MIXED[2]])
    assert ids == list(range(300, 332)) and positions == list(range(32)) and rows == []


def test_block_tables_write_only_the_blocks_a_request_gained():
    tables = BlockTables(width=2, rows=1)  # both grow on demand
    a = _seq("a", [], 0, 1, True, [5, 6, 7])
    rows = tables.rows([a])
    assert tables.gather(rows, 3).tolist() == [[5, 6, 7]] and tables.num_writes == 3
    tables.rows([_seq("a", [], 0, 1, True, [5, 6, 7])])  # a decode step in the same blocks: nothing written
    assert tables.num_writes == 3
    b = _seq("b", [], 0, 1, True, [1])
    rows = tables.rows([_seq("a", [], 0, 1, True, [5, 6, 7, 8]), b])  # a gained one block; b is new
    assert tables.num_writes == 5 and tables.num_rows_in_use == 2
    assert tables.gather(rows, 4).tolist()[0] == [5, 6, 7, 8] and tables.gather(rows, 1).tolist()[1] == [1]


def test_a_replaced_block_list_is_written_whole_and_dropped_rows_are_reused():
    tables = BlockTables(width=4, rows=2)
    tables.rows([_seq("a", [], 0, 1, True, [5, 6, 7])])
    # preempted and re-admitted without the runner being told: a new list ending in the same block
    rows = tables.rows([_seq("a", [], 0, 1, True, [1, 2, 7], preemptions=1)])
    assert tables.gather(rows, 3).tolist() == [[1, 2, 7]]
    rows = tables.rows([_seq("a", [], 0, 1, True, [5, 9, 3], preemptions=1)])  # the guard: another last block
    assert tables.gather(rows, 3).tolist() == [[5, 9, 3]]
    rows = tables.rows([_seq("a", [], 0, 1, True, [2], preemptions=1)])  # shorter: written whole too
    assert tables.gather(rows, 1).tolist() == [[2]]
    tables.drop(["a", "unknown"])
    assert tables.num_rows_in_use == 0
    rows = tables.rows([_seq("b", [], 0, 1, True, [4, 4])])  # b gets a's row back, written from scratch
    assert tables.gather(rows, 2).tolist() == [[4, 4]] and tables.table.shape[0] == 2
