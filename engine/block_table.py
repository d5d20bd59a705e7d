"""Each running request's block ids in one persistent host table, written incrementally.

A request's block list only grows while it runs (``KVCacheManager.allocate_slots`` appends); it is replaced
only when the request is preempted (its blocks freed, a new list at re-admission: ``num_preemptions`` counts
up) and dropped when it ends. So a step writes into a request's row just the blocks it gained since its last
step: none or one for a decode, not its whole table; the step's table is then one numpy gather of the
scheduled rows. A row is rewritten whole when its request was preempted since it was written (or, a cheap
guard besides, when the list no longer holds the row's last written block).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from engine.core.outputs import ScheduledSeq


class BlockTables:
    def __init__(self, width: int = 64, rows: int = 64) -> None:
        self.table = np.zeros((rows, width), np.int64)  # [rows, width] row r: its request's block ids
        self._lengths = [0] * rows  # blocks written per row
        self._epochs = [0] * rows  # the request's num_preemptions when its row was written
        self._freed = [0] * rows  # the request's num_window_freed when its row was written
        self._row_of: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))
        self.num_writes = 0  # block ids written since start (tests: a decode step writes almost none)

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    def rows(self, seqs: Sequence[ScheduledSeq]) -> np.ndarray:
        """[B] each scheduled sequence's row, its blocks written up to date."""
        return np.fromiter((self._sync(s.request, s.block_ids) for s in seqs), np.int64, len(seqs))

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """[B, width] the rows' first ``width`` block ids (entries past a row's blocks are stale, never read)."""
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], width)
        return self.table[rows, :width]

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget requests that ended or were preempted (unknown ids: no-op)."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._lengths[row] = 0
                self._free.append(row)

    def _sync(self, request, block_ids: Sequence[int]) -> int:
        row = self._row_of.get(request.request_id)
        if row is None:
            row = self._row_of[request.request_id] = self._take_row()
        written, total = self._lengths[row], len(block_ids)
        if written and (self._epochs[row] != request.num_preemptions or total < written
                        or self.table[row, written - 1] != block_ids[written - 1]):
            written = 0  # not the list it had: write it whole
        self._epochs[row] = request.num_preemptions
        freed = request.num_window_freed
        if freed != self._freed[row] and written:  # entries now pointing at the pad block (a sliding window)
            low, high = sorted((self._freed[row], freed))
            self.table[row, low:high] = block_ids[low:high]
        self._freed[row] = freed
        if total > written:
            if total > self.table.shape[1]:
                self._grow(self.table.shape[0], max(total, 2 * self.table.shape[1]))
            self.table[row, written:total] = block_ids[written:total]
            self.num_writes += total - written
            self._lengths[row] = total
        return row

    def _take_row(self) -> int:
        if not self._free:
            rows = self.table.shape[0]
            self._grow(2 * rows, self.table.shape[1])
            self._lengths.extend([0] * rows)
            self._epochs.extend([0] * rows)
            self._freed.extend([0] * rows)
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def _grow(self, rows: int, width: int) -> None:
        table = np.zeros((rows, width), np.int64)
        table[: self.table.shape[0], : self.table.shape[1]] = self.table
        self.table = table
