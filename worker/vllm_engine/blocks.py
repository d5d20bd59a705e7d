"""vLLM's KV block events as Baton's index events (pure logic: no vLLM, no I/O).

vLLM (``--kv-events-config``) reports each block it caches (``BlockStored``: its hash, its parent's hash, its
tokens) and each it drops (``BlockRemoved``, ``AllBlocksCleared``). Baton's index names blocks by Baton's own chained
hashes (``kv_transfer.hashing``) over ``index_block_size`` tokens, so one vLLM block of ``vllm_block_size`` tokens
(128 on vLLM's CPU build) is ``vllm_block_size // index_block_size`` index blocks: hashed on from the last index
hash of its parent, or from the root (the worker's fingerprint, block size and the request's ``cache_salt``, which
vLLM reports as the first block's extra key). A block size that is no multiple of Baton's is refused.

vLLM does not de-duplicate its cache: two physical blocks can hold the same hash (each reported by its own
``BlockStored`` and, when evicted, its own ``BlockRemoved``), so the bridge counts the copies per tier and tells the
index only of a tier's first copy and of its last one gone. (This holds for vLLM's default ``incremental`` report
mode; the ``full`` mode also reports prefix-cache hits as stored, which no Baton worker turns on.)

A block whose parent this bridge never saw (or whose extra keys name something the index cannot salt by, such as
a LoRA adapter or an image) cannot be chained: it is left out of the index (counted in ``unchained``), so the
router never believes a prefix is cached where it is not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.block_pool import TIER_HOST, TIER_POOL, BlockEvent, BlockEventKind
from kv_transfer.hashing import BlockHash, hash_blocks, root_hash

TIER_OF_MEDIUM = {None: TIER_POOL, "GPU": TIER_POOL, "CPU": TIER_HOST}  # vLLM's medium -> the index's tier
VLLMHash = int | bytes  # vLLM's external block hash


@dataclass(slots=True)
class _Held:
    hashes: tuple[BlockHash, ...]  # the index blocks of one vLLM block
    copies: Counter[str] = field(default_factory=Counter)  # tier -> physical blocks vLLM holds with this hash


class VLLMBlockBridge:
    def __init__(self, fingerprint: bytes, index_block_size: int, vllm_block_size: int) -> None:
        if vllm_block_size < index_block_size or vllm_block_size % index_block_size:
            raise ValueError(f"vLLM's KV block size ({vllm_block_size} tokens) must be a multiple of Baton's index "
                             f"block size ({index_block_size}): its blocks are indexed as whole index blocks")
        self.fingerprint, self.index_block_size, self.vllm_block_size = fingerprint, index_block_size, vllm_block_size
        self._held: dict[VLLMHash, _Held] = {}
        self.unchained = 0  # vLLM blocks left out of the index (unknown parent, unsaltable extra keys)

    def stored(self, block_hashes: Sequence[VLLMHash], parent: VLLMHash | None, token_ids: Sequence[int],
               medium: str | None = None, extra_keys: Sequence[tuple | None] | None = None) -> list[BlockEvent]:
        """``BlockStored``: consecutive vLLM blocks (``token_ids``: all of theirs, in order) after ``parent``."""
        tier = TIER_OF_MEDIUM.get(medium)
        if tier is None or len(token_ids) != len(block_hashes) * self.vllm_block_size:
            self.unchained += len(block_hashes)
            return []
        tail = self._tail(parent, extra_keys[0] if extra_keys else None)
        events: list[BlockEvent] = []
        for i, vllm_hash in enumerate(block_hashes):
            if tail is None:
                self.unchained += len(block_hashes) - i
                break
            if i > 0 and extra_keys and extra_keys[i] is not None:  # later blocks carry a LoRA or image key
                self.unchained += len(block_hashes) - i
                break
            held = self._held.get(vllm_hash)
            if held is None:
                tokens = token_ids[i * self.vllm_block_size:(i + 1) * self.vllm_block_size]
                hashes = tuple(hash_blocks(tokens, self.index_block_size, tail))
                held = self._held[vllm_hash] = _Held(hashes)
            held.copies[tier] += 1
            if held.copies[tier] == 1:
                events += [BlockEvent(BlockEventKind.STORED, h, 0, tier) for h in held.hashes]
            tail = held.hashes[-1]
        return events

    def removed(self, block_hashes: Sequence[VLLMHash], medium: str | None = None) -> list[BlockEvent]:
        tier = TIER_OF_MEDIUM.get(medium)
        events: list[BlockEvent] = []
        for vllm_hash in block_hashes:
            held = self._held.get(vllm_hash)
            if held is None or held.copies[tier] == 0:
                continue
            held.copies[tier] -= 1
            if held.copies[tier] > 0:  # another copy of the block is still there
                continue
            del held.copies[tier]
            if not held.copies:
                del self._held[vllm_hash]
            events += [BlockEvent(BlockEventKind.REMOVED, h, 0, tier) for h in held.hashes]
        return events

    def cleared(self) -> list[BlockEvent]:
        """``AllBlocksCleared``: the engine holds nothing any more."""
        events = [BlockEvent(BlockEventKind.REMOVED, h, 0, tier)
                  for held in self._held.values() for tier in held.copies for h in held.hashes]
        self._held.clear()
        return events

    def holdings(self) -> dict[str, list[BlockHash]]:
        """Tier -> the index hashes of every block vLLM holds now."""
        out: dict[str, list[BlockHash]] = {TIER_POOL: [], TIER_HOST: []}
        for held in self._held.values():
            for tier in held.copies:
                out[tier].extend(held.hashes)
        return out

    def _tail(self, parent: VLLMHash | None, first_extra: tuple | None) -> BlockHash | None:
        """The index hash the first new block chains on (None: it cannot be chained)."""
        if parent is not None:
            held = self._held.get(parent)
            return None if held is None else held.hashes[-1]
        salt = _salt(first_extra)
        return None if salt is None else root_hash(self.fingerprint, self.index_block_size, salt)


def _salt(extra: tuple | None) -> str | None:
    """A first block's extra keys as Baton's ``cache_salt``: none, or the salt alone; None: something else."""
    if extra is None or len(extra) == 0:
        return ""
    if len(extra) == 1 and isinstance(extra[0], str):
        return extra[0]
    return None
