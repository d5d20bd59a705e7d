"""Where a layer-wise Decode waits for the prefill worker's first token (``FirstToken`` RPC).

With ``first_token_pending``, the router starts Decode as soon as P's KV handle exists, so the pull runs
while P still computes; P's first token comes later, from the router, by ``FirstToken``. The two calls
travel separately, so either may arrive first: a token delivered before its Decode waits is kept (for
``keep_s``) until it does. A delivery is a token id, or ``RECOMPUTE`` (P failed: D prefills itself).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kv_transfer.errors import KVTransferError

RECOMPUTE = -1  # no token: the prefill worker failed, prefill the prompt here


@dataclass(slots=True)
class _Slot:
    future: asyncio.Future
    created_s: float
    waited: bool = False  # a Decode is (or was) waiting on it


class FirstTokenMailbox:
    """Request id -> its first token, awaited by Decode; event loop only."""

    def __init__(self, keep_s: float = 60.0) -> None:
        self.keep_s = keep_s
        self._slots: dict[str, _Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def deliver(self, request_id: str, token: int) -> bool:
        """Hand ``token`` (or ``RECOMPUTE``) to ``request_id``'s Decode; True if one is waiting already."""
        slot = self._slot(request_id)
        if not slot.future.done():
            slot.future.set_result(token)
        return slot.waited

    async def wait(self, request_id: str, timeout_s: float) -> int:
        """The first token of ``request_id`` (or ``RECOMPUTE``); KVTransferError after ``timeout_s``."""
        slot = self._slot(request_id)
        slot.waited = True
        try:
            return await asyncio.wait_for(asyncio.shield(slot.future), timeout_s)
        except TimeoutError:
            raise KVTransferError(f"the first token of {request_id} did not arrive within {timeout_s:g} s") from None
        finally:
            self._slots.pop(request_id, None)

    def expire(self, now_s: float | None = None) -> int:
        """Drop deliveries nobody came for within ``keep_s``; how many were dropped."""
        now_s = time.monotonic() if now_s is None else now_s
        stale = [rid for rid, slot in self._slots.items() if not slot.waited and now_s - slot.created_s > self.keep_s]
        for rid in stale:
            del self._slots[rid]
        return len(stale)

    def _slot(self, request_id: str) -> _Slot:
        slot = self._slots.get(request_id)
        if slot is None:
            slot = self._slots[request_id] = _Slot(asyncio.get_running_loop().create_future(), time.monotonic())
        return slot
