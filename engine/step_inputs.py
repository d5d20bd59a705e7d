"""A step's inputs in persistent buffers, instead of new tensors every step.

``ModelRunner`` used to build its tensors from Python lists per step (``torch.tensor(list)``: a host
allocation, a list walk per element, and on CUDA a copy from pageable memory), and the attention backend
padded every sequence's block list into a new table. ``StepInputs`` keeps one host buffer (pinned on CUDA,
so the copy is a real asynchronous DMA) and one device buffer, grown by doubling when a step needs more,
and packs the whole step into them with numpy over whole arrays: token ids, positions, KV slots, logit rows,
context lengths and the step's block table (gathered from ``BlockTables``, where each request's row is
written incrementally). One host-to-device copy per step moves it all. The token ids are the only
per-sequence work (one list slice per sequence, flattened and converted at C speed).

Reuse: before the host buffer is overwritten, ``fill`` waits on an event recorded after the previous step's
copy out of it (a step that samples nothing ends without a host sync, so its copy may still be pending); the
device buffer is overwritten by a copy on the same stream as every kernel reading it, so in order. On CPU
the host buffer is the inputs themselves (no copy, nothing to wait for).

Tensor parallelism: the packed host buffer is the step, whole (``packed``: the buffer and its ``StepHeader``);
rank 0 broadcasts it and the other ranks rebuild the same batch from it (``unpack``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.attention.base import StepBatch
from engine.block_table import BlockTables
from engine.core.outputs import ScheduledSeq

MIN_CAPACITY = 4096  # int64 entries: a decode batch of 64 sequences with 60 blocks each never grows the buffers


@dataclass(frozen=True, slots=True)
class StepHeader:
    """The sizes of a packed step: T tokens, S logit rows, B sequences, block tables W wide."""

    num_tokens: int
    num_rows: int
    num_seqs: int
    width: int

    @property
    def sizes(self) -> tuple[int, ...]:
        """The packed sections: ids, positions, slots [T]; logit rows [S]; context lengths, starts [B]; table [B*W]."""
        t, b = self.num_tokens, self.num_seqs
        return t, t, t, self.num_rows, b, b, b * self.width

    @property
    def total(self) -> int:
        return sum(self.sizes)


class StepInputs:
    def __init__(self, device: torch.device, block_size: int, capacity: int = MIN_CAPACITY) -> None:
        self.device = device
        self.block_size = block_size
        self.tables = BlockTables()
        self.capacity = 0
        self.grown = 0  # times the buffers were (re)allocated, for tests and logs
        self._copied = None  # CUDA: an event recorded after the last step's host-to-device copy
        self._allocate(max(capacity, 1))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that ended or were preempted give up their block-table rows."""
        self.tables.drop(request_ids)

    def fill(self, seqs: Sequence[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
        """(input ids [T], logit rows [S], the batch) of the step, int64, on the device: views of the
        persistent buffers, valid until the next ``fill``."""
        counts = np.fromiter((s.num_new_tokens for s in seqs), np.int64, len(seqs))  # [B]
        starts = np.fromiter((s.start for s in seqs), np.int64, len(seqs))  # [B]
        row_counts = np.fromiter((s.num_rows for s in seqs), np.int64, len(seqs))  # [B] logit rows per sequence
        contexts = starts + counts  # [B]
        table = self.tables.gather(self.tables.rows(seqs), int(-(-contexts.max() // self.block_size)))  # [B, W]
        num_tokens, num_rows, (num_seqs, width) = int(counts.sum()), int(row_counts.sum()), table.shape
        self.header = StepHeader(num_tokens, num_rows, num_seqs, width)
        sizes = self.header.sizes
        ids, pos, slots, rows, ctx, starts_out, flat_table = self._host_sections(sizes)
        # a list slice per sequence, flattened and converted in C (no Python step per token)
        ids[:] = list(chain.from_iterable(_tokens(s) for s in seqs))
        ends = np.cumsum(counts)  # [B] one past each sequence's last row
        # position of row r of sequence i: starts[i] + (r - first row of i)
        np.subtract(np.arange(num_tokens), np.repeat(ends - counts - starts, counts), out=pos)
        seq_of_token = np.repeat(np.arange(num_seqs), counts)  # [T]
        slots[:] = table[seq_of_token, pos // self.block_size] * self.block_size + pos % self.block_size
        # a sequence's logit rows are its last row_counts[i] rows (its last known token's, then its drafts')
        row_ends = np.cumsum(row_counts)  # [B]
        np.add(np.repeat(ends - row_ends, row_counts), np.arange(num_rows), out=rows)
        ctx[:] = contexts
        starts_out[:] = starts
        flat_table[:] = table.reshape(-1)
        d_ids, d_pos, d_slots, d_rows, d_ctx, _, d_table = self._to_device(sizes)
        batch = StepBatch(d_pos, d_slots, d_table.view(num_seqs, width), d_ctx, starts, counts, table, self.block_size)
        return d_ids, d_rows, batch

    def packed(self) -> tuple[torch.Tensor, StepHeader]:
        """The last ``fill``'s step, whole: its packed host buffer [total] int64 and header."""
        return self._host[: self.header.total], self.header

    def _host_sections(self, sizes: tuple[int, ...]) -> list[np.ndarray]:
        if self._copied is not None:  # never run here (no GPU)
            self._copied.synchronize()  # the last step's copy out of the host buffer is done
        if sum(sizes) > self.capacity:
            self._allocate(max(sum(sizes), 2 * self.capacity))
        return _split(self._host_np, sizes)

    def _to_device(self, sizes: tuple[int, ...]) -> list[torch.Tensor]:
        if self._device is None:
            return _split(self._host, sizes)
        total = sum(sizes)  # never run here (no GPU): one copy of the whole step
        self._device[:total].copy_(self._host[:total], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return _split(self._device, sizes)

    def _allocate(self, capacity: int) -> None:
        self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._device = None if self.device.type == "cpu" else torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.capacity = capacity
        self.grown += 1


def unpack(host: torch.Tensor, header: StepHeader, device: torch.device,
           block_size: int) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
    """(input ids [T], logit rows [S], the batch) of a packed step (``StepInputs.packed``, or ``pack``), on
    ``device``: what a tensor-parallel rank runs. ``host`` [total] int64 on the CPU."""
    arrays = _split(host.numpy(), header.sizes)
    flat = host if device.type == "cpu" else host.to(device)  # never run here (no GPU): one copy of the step
    ids, pos, slots, rows, ctx, _, table = _split(flat, header.sizes)
    starts, table_host = arrays[5], arrays[6].reshape(header.num_seqs, header.width)
    counts = arrays[4] - starts  # [B]
    batch = StepBatch(pos, slots, table.view(header.num_seqs, header.width), ctx, starts, counts, table_host,
                      block_size)
    return ids, rows, batch


def pack(input_ids: Sequence[int], batch: StepBatch, logit_rows: Sequence[int]) -> tuple[torch.Tensor, StepHeader]:
    """A batch built outside ``StepInputs`` (scoring, calibration; ``StepBatch.from_slices``) packed as a step."""
    header = StepHeader(len(input_ids), len(logit_rows), batch.num_seqs, batch.block_table_host.shape[1])
    host = torch.empty(header.total, dtype=torch.int64)
    ids, pos, slots, rows, ctx, starts, table = _split(host.numpy(), header.sizes)
    ids[:], rows[:] = input_ids, logit_rows
    pos[:], slots[:] = batch.positions.cpu().numpy(), batch.slots.cpu().numpy()
    ctx[:], starts[:], table[:] = batch.context_lens_host, batch.starts, batch.block_table_host.reshape(-1)
    return host, header


def _tokens(seq: ScheduledSeq):
    """The slice's token ids: its known tokens, then its speculative drafts (usually none)."""
    if not seq.draft_token_ids:
        return seq.request.all_token_ids[seq.start : seq.end]
    return seq.request.all_token_ids[seq.start : seq.end - len(seq.draft_token_ids)] + list(seq.draft_token_ids)


def _split(buffer, sizes: tuple[int, ...]) -> list:
    """Consecutive sections of ``buffer`` (a tensor or an array) of the given sizes."""
    out, offset = [], 0
    for size in sizes:
        out.append(buffer[offset : offset + size])
        offset += size
    return out
