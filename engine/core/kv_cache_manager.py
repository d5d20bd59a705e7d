"""KVCacheManager: maps requests to block lists on top of the BlockPool (vLLM v1's layering), and keeps the
books of the tiers below the pool: the host tier's (``engine.core.host_tier``), to which every block the pool
evicts is offered, and the store tier's writes (``engine.core.store_writes``), to which every block leaving
this worker for good is offered (the host tier's LRU drops it, or the pool evicts it with no host tier to take
it), and every block the pool commits under write-through."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import CacheConfig
from engine.core.block_pool import TIER_HOST, TIER_POOL, BlockEvent, BlockPool
from engine.core.host_tier import HostCopies, HostTier
from engine.core.request import Request
from engine.core.store_writes import StoreCopy, StoreWrites
from kv_transfer.hashing import BlockHash, hash_blocks, root_hash


def window_start(num_computed_tokens: int, window: int | None, block_size: int) -> int:
    """The first block the token after ``num_computed_tokens`` attends to when every layer attends within
    ``window`` tokens (the token itself included); 0 without a window."""
    return 0 if window is None else max(num_computed_tokens - window + 1, 0) // block_size


class KVCacheManager:
    def __init__(self, config: CacheConfig, model_fingerprint: bytes) -> None:
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, enable_caching=config.enable_prefix_caching)
        self.host = HostTier(config.num_host_blocks) if config.num_host_blocks and self.enable_caching else None
        self.store = (StoreWrites(config.num_store_slots, write_through=config.store_write_through)
                      if config.num_store_slots and self.enable_caching else None)
        self._fingerprint = model_fingerprint
        self._roots: dict[str, BlockHash] = {}
        self._blocks: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}

    def root(self, cache_salt: str) -> BlockHash:
        root = self._roots.get(cache_salt)
        if root is None:
            root = self._roots[cache_salt] = root_hash(self._fingerprint, self.block_size, cache_salt)
        return root

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of ``request`` (not yet referenced).

        At least the last token is always recomputed so the step has logits to sample from.
        """
        if not self.enable_caching:
            return []
        request.update_block_hashes(self.root(request.cache_salt), self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.pool.longest_cached_prefix(request.block_hashes[:max_blocks])

    def host_prefix(self, request: Request, num_pool_blocks: int) -> list[int]:
        """Host blocks continuing ``request``'s cached prefix past its first ``num_pool_blocks`` (held in the
        pool), within ``get_computed_blocks``' limit, pinned until ``load_from_host`` or ``unpin_host``; empty
        without a host tier."""
        if self.host is None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        host_ids = self.host.prefix(request.block_hashes[num_pool_blocks:max_blocks])
        self.host.pin(host_ids)
        return host_ids

    def num_local_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` this worker holds, in its pool and then its host tier (nothing pinned)."""
        num_pool = len(self.pool.longest_cached_prefix(hashes))
        return num_pool + (len(self.host.prefix(hashes[num_pool:])) if self.host is not None else 0)

    def unpin_host(self, host_ids: Sequence[int]) -> None:
        if host_ids:
            self.host.unpin(host_ids)

    def load_from_host(self, host_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Queue copies of ``host_ids`` (a ``host_prefix``) up into fresh blocks of the request they continue."""
        self.host.load(host_ids, block_ids)

    def allocate_scratch(self, num_blocks: int) -> list[int]:
        """Blocks outside any request (scoring, calibration); free them with ``release``. Take the host copies
        (``take_host_copies``) before writing into them: an evicted block's bytes go down first."""
        block_ids = self.pool.allocate(num_blocks)
        self._offer_evicted()
        return block_ids

    def take_store_copies(self) -> tuple[StoreCopy, ...]:
        """The store-tier copies queued since the last call; the caller makes them before the host copies."""
        return self.store.take_copies() if self.store is not None else ()

    def take_host_copies(self) -> HostCopies:
        """The host-tier copies queued since the last call; the caller makes them before anything else writes
        into the pool blocks they name."""
        return self.host.take_copies() if self.host is not None else HostCopies()

    def take_events(self) -> list[BlockEvent]:
        """The pool's block events, then the host tier's."""
        events = self.pool.take_events()
        return events if self.host is None else events + self.host.take_events()

    def _offer_evicted(self) -> None:
        for block_hash, block_id in self.pool.take_evicted():
            kept = self.host is not None and self.host.save(block_hash, block_id)
            if not kept and self.store is not None:
                self.store.offer(block_hash, TIER_POOL, block_id)
        if self.host is not None:
            for block_hash, host_id in self.host.take_dropped():
                if self.store is not None:
                    self.store.offer(block_hash, TIER_HOST, host_id)

    def prompt_hashes(self, token_ids: Sequence[int], cache_salt: str) -> list[BlockHash]:
        """The full blocks' hashes of ``token_ids``, as a request with ``cache_salt`` computes them."""
        return hash_blocks(token_ids, self.block_size, self.root(cache_salt))

    def hold_cached_prefix(self, token_ids: Sequence[int], cache_salt: str) -> tuple[list[int], list[BlockHash]]:
        """Pin (one more reference each) the longest cached prefix of ``token_ids``, at most
        ``(len - 1) // block_size`` blocks like a local hit; the caller frees them with ``release``."""
        if not self.enable_caching:
            return [], []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self.prompt_hashes(token_ids[: max_blocks * self.block_size], cache_salt)
        block_ids = self.pool.longest_cached_prefix(hashes)
        self.pool.touch(block_ids)
        return block_ids, hashes[: len(block_ids)]

    def record_prefix_lookup(self, request: Request, num_hit_blocks: int) -> None:
        """Count one admission's prefix-cache lookup (once per admission, not per attempt)."""
        if self.enable_caching:
            self.pool.record_lookup((request.num_tokens - 1) // self.block_size, num_hit_blocks)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens; None when the pool cannot."""
        blocks = self._blocks.setdefault(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = self.blocks_needed(num_tokens) - len(blocks) - len(computed_blocks)
        num_evictable_hits = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self._blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        self._offer_evicted()
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        self._num_committed[request.request_id] = max(
            self._num_committed.get(request.request_id, 0), len(computed_blocks)
        )
        return new_blocks

    def commit(self, request: Request) -> None:
        """Publish the request's full, computed blocks to the prefix cache."""
        if not self.enable_caching:
            return
        request.update_block_hashes(self.root(request.cache_salt), self.block_size)
        blocks = self._blocks[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        start = self._num_committed.get(request.request_id, 0)
        through = self.store is not None and self.store.write_through
        for i in range(start, num_full):
            if self.pool.commit(blocks[i], request.block_hashes[i]) and through:
                self.store.offer(request.block_hashes[i], TIER_POOL, blocks[i])
        self._num_committed[request.request_id] = max(start, num_full)

    def free_outside_window(self, request: Request, window: int) -> None:
        """Give back the request's blocks wholly before the window its next token attends within: their entries
        become ``pad_block`` (a block no request owns; attention masks those positions anyway). A committed
        block stays in the prefix cache, evictable."""
        blocks = self._blocks.get(request.request_id)
        first_needed = window_start(request.num_computed_tokens, window, self.block_size)
        if not blocks or first_needed <= request.num_window_freed:
            return
        freed = blocks[request.num_window_freed : first_needed]
        self.pool.free(reversed(freed))
        blocks[request.num_window_freed : first_needed] = [self.pad_block] * len(freed)
        request.num_window_freed = first_needed

    @property
    def pad_block(self) -> int:
        """The runner's block past the pool's: what freed window entries point at."""
        return self.pool.num_blocks

    def trim(self, request: Request) -> None:
        """Give back blocks past what the request's known tokens need (reserved for drafts it rejected)."""
        blocks = self._blocks.get(request.request_id)
        extra = len(blocks) - self.blocks_needed(request.num_tokens) if blocks else 0
        if extra > 0:
            self.pool.free(reversed(blocks[-extra:]))
            del blocks[-extra:]

    def detach(self, request: Request) -> list[int]:
        """Hand the request's blocks (still referenced) to the caller, who frees them with ``release``."""
        self._num_committed.pop(request.request_id, None)
        return self._blocks.pop(request.request_id, [])

    def hand_over(self, request: Request, window: int | None) -> tuple[int, tuple[int, ...]]:
        """``detach`` a finished prefill's blocks from the first its next token attends to under ``window``
        (every layer's; None: all of them): (that block's index, the blocks). The ones before go back to the
        pool now (``free_outside_window``), committed ones staying in the prefix cache, evictable."""
        if window is not None:
            self.free_outside_window(request, window)
        first, request.num_window_freed = request.num_window_freed, 0
        return first, tuple(self.detach(request)[first:])

    def allocate_window(self, request: Request, num_tokens: int, first_block: int) -> int | None:
        """Blocks for the first ``num_tokens`` of a request whose first ``first_block`` blocks fell out of the
        window before it arrived (another worker computed it and handed over the rest): pad entries, as
        ``free_outside_window`` leaves them; then the pool's cached blocks continuing the prompt at
        ``first_block`` (a block's hash names its whole prefix, so the ones before need not be here; the host
        tier is not asked); then fresh blocks. Returns the index of the first fresh block, or None when the
        pool cannot hold them now. Only blocks from that index on are committed later (never a pad entry)."""
        cached: list[int] = []
        if self.enable_caching:
            request.update_block_hashes(self.root(request.cache_salt), self.block_size)
            cached = self.pool.longest_cached_prefix(request.block_hashes[first_block : num_tokens // self.block_size])
        num_fresh = self.blocks_needed(num_tokens) - first_block - len(cached)
        if num_fresh > self.pool.num_free_blocks - sum(1 for b in cached if self.pool.ref_count(b) == 0):
            return None
        self.pool.touch(cached)
        fresh = self.pool.allocate(num_fresh)
        self._offer_evicted()
        self._blocks[request.request_id] = [self.pad_block] * first_block + cached + fresh
        self._num_committed[request.request_id] = first_block + len(cached)
        request.num_window_freed = first_block
        return first_block + len(cached)

    def release(self, block_ids: list[int]) -> None:
        self.pool.free(reversed(block_ids))

    # ---- swap (--preemption-mode swap) ------------------------------------------------------
    def swap_out(self, request: Request) -> bool:
        """Copy a preempted request's blocks down to the host tier and free them; False (nothing changed) when
        there is no host tier or it has no room: the caller recomputes instead."""
        blocks = self._blocks.get(request.request_id)
        kept = blocks[request.num_window_freed :] if blocks else None  # freed window entries are not swapped
        if self.host is None or not kept or not self.host.swap_out(request.request_id, kept):
            return False
        freed = request.num_window_freed
        self.free(request)
        request.num_window_freed = freed  # swap_in puts the pad entries back in front of its blocks
        return True

    def swapped_out(self, request: Request) -> int | None:
        """Blocks of ``request`` held in the host tier since its preemption, or None."""
        return None if self.host is None else self.host.swapped(request.request_id)

    def swap_in(self, request: Request, num_blocks: int) -> bool:
        """Fresh blocks for a swapped-out request, its KV queued to be copied back into them; False (still
        swapped out) when the pool cannot give ``num_blocks`` now."""
        if num_blocks > self.pool.num_free_blocks:
            return False
        blocks = self.pool.allocate(num_blocks)
        self._offer_evicted()
        self.host.swap_in(request.request_id, blocks)
        self._blocks[request.request_id] = [self.pad_block] * request.num_window_freed + blocks
        self._num_committed[request.request_id] = request.num_window_freed  # commit again from its first block
        return True

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._num_committed.pop(request.request_id, None)
        self.pool.free(reversed(blocks[request.num_window_freed :]))
        request.num_window_freed = 0
        if self.host is not None and not blocks:
            self.host.drop_swap(request.request_id)  # ended while swapped out (abort): its host blocks go back

    def num_requests(self) -> int:
        return len(self._blocks)
