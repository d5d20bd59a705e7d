"""A step's token ids, positions and logit rows in persistent buffers, instead of new tensors every step.

``ModelRunner`` used to build three tensors from Python lists per step (``torch.tensor(list)``: a host
allocation, a list walk per element, and on CUDA a copy from pageable memory). ``StepInputs`` keeps one
host buffer per input (in pinned memory on CUDA, so the copy is a real asynchronous DMA) and one device
buffer, both grown by doubling when a step has more tokens than they hold, and fills them per step with
numpy over whole arrays: the token ids are the only per-sequence work (one list slice per sequence,
flattened and converted at C speed); positions and logit rows come from the per-sequence starts and counts, vectorized.

Reuse: before the host buffers are overwritten, ``fill`` waits on an event recorded after the previous
step's copies out of them (a step that samples nothing ends without a host sync, so its copies may still
be pending); the device buffers are overwritten by copies on the same stream as every kernel reading them,
so in order. On CPU the host buffers are the inputs themselves (no copy, nothing to wait for).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from engine.core.outputs import ScheduledSeq

MIN_CAPACITY = 256  # tokens: a decode batch of up to 256 sequences never grows the buffers


class StepInputs:
    def __init__(self, device: torch.device, capacity: int = MIN_CAPACITY) -> None:
        self.device = device
        self.capacity = 0
        self.grown = 0  # times the buffers were (re)allocated, for tests and logs
        self._copied = None  # CUDA: an event recorded after the last step's host-to-device copies
        self._allocate(max(capacity, 1))

    def fill(self, seqs: Sequence[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input ids [T], positions [T], logit rows [S]) of the step, int64, on the device: views of the
        persistent buffers, valid until the next ``fill``."""
        counts = np.fromiter((s.num_new_tokens for s in seqs), np.int64, len(seqs))  # [B]
        starts = np.fromiter((s.start for s in seqs), np.int64, len(seqs))  # [B]
        num_tokens = int(counts.sum())
        if self._copied is not None:  # never run here (no GPU)
            self._copied.synchronize()  # the last step's copies out of the host buffers are done
        if num_tokens > self.capacity:
            self._allocate(max(num_tokens, 2 * self.capacity))
        ends = np.cumsum(counts)  # [B] one past each sequence's last row
        ids, pos, rows = self._host_np
        # a list slice per sequence, flattened and converted in C (no Python step per token)
        ids[:num_tokens] = list(chain.from_iterable(s.request.all_token_ids[s.start : s.end] for s in seqs))
        # position of row r of sequence i: starts[i] + (r - first row of i)
        np.subtract(np.arange(num_tokens), np.repeat(ends - counts - starts, counts), out=pos[:num_tokens])
        sampled = np.fromiter((s.samples for s in seqs), bool, len(seqs))  # [B]
        num_rows = int(sampled.sum())
        np.subtract(ends[sampled], 1, out=rows[:num_rows])
        return self._to_device(num_tokens, num_rows)

    def _to_device(self, num_tokens: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sizes = (num_tokens, num_tokens, num_rows)
        if self._device is None:
            return tuple(host[:n] for host, n in zip(self._host, sizes))  # type: ignore[return-value]
        out = []
        for host, device, n in zip(self._host, self._device, sizes):  # never run here (no GPU)
            device[:n].copy_(host[:n], non_blocking=True)
            out.append(device[:n])
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return tuple(out)  # type: ignore[return-value]

    def _allocate(self, capacity: int) -> None:
        # ids, positions, logit rows (at most one per token): ``capacity`` each
        self._host = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.device.type == "cuda") for _ in range(3)]
        self._host_np = [t.numpy() for t in self._host]
        self._device = None if self.device.type == "cpu" else [
            torch.empty(capacity, dtype=torch.int64, device=self.device) for _ in range(3)]
        self.capacity = capacity
        self.grown += 1
