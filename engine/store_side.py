"""The engine's side of the shared store tier: what the worker shell's store tier (``worker/store_tier.py``, which
does every store call, off this thread) asks of the engine, each on the engine thread (``AsyncEngine.call``).

Writes: the books (``engine.core.store_writes``) queue copies of blocks leaving the worker (or committed, under
write-through) into write slots; ``copy`` makes them with the step's other tier copies and tells the shell
(``on_ready``); the shell takes them (``take_writes``), writes them to the store and gives the slots back
(``written``). Reads: the shell asks which of a prompt's blocks lie past what this worker holds
(``candidates``), reserves the request's blocks (``Engine.add_prefix_request``), reads the store into read slots
and, once verified, has them copied into the reserved blocks (``fill``) before activating the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.core.kv_cache_manager import KVCacheManager
from engine.store_buffer import StoreBuffer
from kv_transfer.hashing import BlockHash


class EngineStore:
    def __init__(self, manager: KVCacheManager, buffer: StoreBuffer) -> None:
        assert manager.store is not None
        self.manager, self.books, self.buffer = manager, manager.store, buffer
        self.on_ready: Callable[[], None] | None = None  # engine thread: write slots were filled

    def copy(self) -> bool:
        """Make the queued copies into write slots (before the host tier's copies); whether there were any."""
        copies = self.manager.take_store_copies()
        if not copies:
            return False
        self.buffer.spill(copies)
        if self.on_ready is not None:
            self.on_ready()
        return True

    def take_writes(self) -> list[tuple[BlockHash, int]]:
        """(hash, write slot) of each block copied and not yet handed out; the copies are complete."""
        ready = self.books.take_ready()
        if ready:
            self.buffer.sync()
        return ready

    def written(self, slots: Sequence[int], stored: Sequence[BlockHash]) -> None:
        self.books.written(slots, stored)

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """The store lost ``hashes``: write them again when they next leave this worker."""
        self.books.forget(hashes)

    def candidates(self, token_ids: Sequence[int], cache_salt: str) -> tuple[int, list[BlockHash]]:
        """(how many leading full blocks of ``token_ids`` this worker holds in its pool or host tier, the hashes of
        the blocks after them that a request may reuse: all but the last token's block)."""
        size = self.manager.block_size
        max_blocks = (len(token_ids) - 1) // size
        hashes = self.manager.prompt_hashes(token_ids[: max_blocks * size], cache_salt)
        num_local = self.manager.num_local_prefix(hashes)
        return num_local, hashes[num_local:]

    def fill(self, slots: Sequence[int], block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Copy verified read slots into a reservation's blocks; the store holds ``hashes`` (no need to write them)."""
        self.buffer.fill(list(slots), list(block_ids))
        self.books.remember(hashes)

    @property
    def read_slots(self) -> range:
        return self.buffer.read_slots
