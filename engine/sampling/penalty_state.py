"""PenaltyState: each penalised request's distinct tokens and output counts, kept on the device across
steps, so a step's penalties cost one small update, not a recount of every prompt and output.

A request's row is filled from its prompt and outputs the first time it samples, and again whenever its
outputs are not the ones counted (the count or the last counted token differs: a request that re-entered,
a reused id); otherwise the one token it gained since the last step is folded in, for all rows at once.
Rows are freed by ``forget`` (the engine calls it for finished and aborted requests; the runner for
preempted ones); when none is free, rows idle for ``idle_steps`` are evicted (refilling is always correct,
only slower), else the state grows. Nothing here reads a device value back to the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.sampling.penalties import SeenTokens, distinct_counts

_EMPTY_SLOT = 0  # a row that stays empty: what non-penalised rows of a batch read


@dataclass(slots=True)
class _Slot:
    index: int  # the request's row in the state tensors
    num_prompt_tokens: int
    num_outputs: int  # outputs counted so far
    last_output: int | None  # the last counted output token
    width_bound: int  # >= the row's number of distinct tokens
    last_step: int


class PenaltyState:
    def __init__(self, device: torch.device | str, *, num_slots: int = 16, width: int = 256,
                 idle_steps: int = 64) -> None:
        self.device = torch.device(device)
        self.idle_steps = idle_steps
        self.token_ids = torch.zeros(num_slots, width, dtype=torch.int64, device=self.device)  # [S, W]
        self.output_counts = torch.zeros(num_slots, width, dtype=torch.int32, device=self.device)  # [S, W]
        self.lengths = torch.zeros(num_slots, dtype=torch.int64, device=self.device)  # [S] distinct tokens
        self._slots: dict[str, _Slot] = {}
        self._free = list(range(num_slots - 1, _EMPTY_SLOT, -1))
        self._step = 0

    @property
    def num_requests(self) -> int:
        return len(self._slots)

    def seen_tokens(self, requests: Sequence[Request | None]) -> SeenTokens:
        """The batch's SeenTokens [B, W]: a Request for each penalised row, None for the others."""
        self._step += 1
        for request in requests:
            if request is not None and request.request_id in self._slots:
                self._slots[request.request_id].last_step = self._step
        refill: list[Request] = []
        advance: list[Request] = []
        for request in requests:
            if request is not None:
                self._classify(request, refill, advance)
        self._refill(refill)
        self._advance(advance)
        return self._gather(requests)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                self._free.append(slot.index)

    def _classify(self, request: Request, refill: list[Request], advance: list[Request]) -> None:
        slot = self._slots.get(request.request_id)
        outputs = request.output_token_ids
        if slot is None or slot.num_prompt_tokens != request.num_prompt_tokens:
            refill.append(request)
        elif len(outputs) == slot.num_outputs and _ends_with(outputs, slot.num_outputs, slot.last_output):
            return  # nothing new since the last step (its token was not kept)
        elif len(outputs) == slot.num_outputs + 1 and _ends_with(outputs, slot.num_outputs, slot.last_output):
            advance.append(request)
        else:
            refill.append(request)

    def _refill(self, requests: Sequence[Request]) -> None:
        """Counts each request's prompt and outputs from scratch into its (new or reused) row."""
        if not requests:
            return
        rows = [distinct_counts(r.prompt_token_ids, r.output_token_ids) for r in requests]
        width = max(len(ids) for ids, _ in rows)
        self._ensure_width(width)
        slots = [self._slot_for(r, len(ids)) for r, (ids, _) in zip(requests, rows)]
        index = self._tensor([slot.index for slot in slots])  # [R]
        columns = torch.arange(width, device=self.device)  # [w]
        self.token_ids.index_fill_(0, index, 0)  # [S, W]
        self.output_counts.index_fill_(0, index, 0)  # [S, W]
        self.token_ids[index[:, None], columns] = self._tensor([_pad(ids, width) for ids, _ in rows])  # [R, w]
        counts = torch.tensor([_pad(c, width) for _, c in rows], dtype=torch.int32, device=self.device)  # [R, w]
        self.output_counts[index[:, None], columns] = counts
        self.lengths[index] = self._tensor([len(ids) for ids, _ in rows])  # [R]

    def _advance(self, requests: Sequence[Request]) -> None:
        """Folds each request's newest output token into its row: one batched match, count and append."""
        if not requests:
            return
        slots = [self._slots[r.request_id] for r in requests]
        width = max(slot.width_bound for slot in slots) + 1
        self._ensure_width(width)
        index = self._tensor([slot.index for slot in slots])  # [P]
        new = self._tensor([r.output_token_ids[-1] for r in requests])  # [P]
        lengths = self.lengths[index]  # [P]
        live = torch.arange(width, device=self.device) < lengths[:, None]  # [P, w]
        match = (self.token_ids[:, :width].index_select(0, index) == new[:, None]) & live  # [P, w] <= 1 a row
        found = match.any(dim=-1)  # [P]
        column = torch.where(found, match.int().argmax(dim=-1), lengths)  # [P] its entry, or the next free one
        self.token_ids.index_put_((index, column), new)  # [S, W]
        ones = torch.ones_like(column, dtype=torch.int32)  # [P]
        self.output_counts.index_put_((index, column), ones, accumulate=True)  # [S, W]
        self.lengths.index_put_((index,), (~found).long(), accumulate=True)  # [S]
        for slot, request in zip(slots, requests):
            slot.num_outputs, slot.last_output = request.num_output_tokens, request.output_token_ids[-1]
            slot.width_bound += 1

    def _gather(self, requests: Sequence[Request | None]) -> SeenTokens:
        slots = [None if r is None else self._slots[r.request_id] for r in requests]
        width = max((slot.width_bound for slot in slots if slot is not None), default=1) or 1
        index = self._tensor([_EMPTY_SLOT if slot is None else slot.index for slot in slots])  # [B]
        lengths = self.lengths[index]  # [B]
        columns = torch.arange(width, device=self.device)  # [W]
        source = torch.where(columns < lengths[:, None], columns, 0)  # [B, W]: padding repeats entry 0
        return SeenTokens(
            token_ids=self.token_ids[:, :width].index_select(0, index).gather(1, source),  # [B, W]
            output_counts=self.output_counts[:, :width].index_select(0, index).gather(1, source),  # [B, W]
            nonempty=lengths > 0,  # [B]
        )

    def _slot_for(self, request: Request, num_distinct: int) -> _Slot:
        slot = self._slots.get(request.request_id)
        index = slot.index if slot is not None else self._take_free_index()
        outputs = request.output_token_ids
        slot = _Slot(index, request.num_prompt_tokens, len(outputs), outputs[-1] if outputs else None,
                     num_distinct, self._step)
        self._slots[request.request_id] = slot
        return slot

    def _take_free_index(self) -> int:
        if not self._free:
            idle = [rid for rid, slot in self._slots.items() if slot.last_step < self._step - self.idle_steps]
            self.forget(idle)
        if not self._free:
            self._grow_slots()
        return self._free.pop()

    def _grow_slots(self) -> None:
        old = self.token_ids.shape[0]
        self.token_ids = _grown(self.token_ids, 2 * old, self.token_ids.shape[1])
        self.output_counts = _grown(self.output_counts, 2 * old, self.output_counts.shape[1])
        self.lengths = torch.cat([self.lengths, torch.zeros_like(self.lengths)])  # [2S]
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _ensure_width(self, width: int) -> None:
        if width > self.token_ids.shape[1]:
            new_width = max(width, 2 * self.token_ids.shape[1])
            self.token_ids = _grown(self.token_ids, self.token_ids.shape[0], new_width)
            self.output_counts = _grown(self.output_counts, self.output_counts.shape[0], new_width)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def _ends_with(outputs: Sequence[int], num_counted: int, last: int | None) -> bool:
    """Whether the first ``num_counted`` outputs end with ``last`` (the counted prefix looks unchanged)."""
    return num_counted == 0 or outputs[num_counted - 1] == last


def _pad(row: list[int], width: int) -> list[int]:
    return [*row, *([0] * (width - len(row)))]


def _grown(table: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    out = table.new_zeros(rows, columns)  # [rows, columns]
    out[: table.shape[0], : table.shape[1]] = table
    return out
