"""Transfer leases: the prefill side pins a request's blocks until the decoder acks or the lease expires.

Pure logic with an injected clock (``now`` in seconds, any monotonic clock). The table never frees
blocks itself: its owner (the engine shell) frees the blocks of every lease that ``release`` or
``expire`` hands back. Each lease is handed back exactly once, by whichever of the two comes first.
Not thread-safe: the owner calls it from one thread (the node's event loop).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kv_transfer.errors import LeaseNotFound

DEFAULT_LEASE_TTL_S = 30.0
LEASE_ID_BYTES = 16  # 128 random bits: unguessable, so a lease id is a capability to read its blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # seconds on the owner's clock
    first_block: int = 0  # the prompt block block_ids start at (the ones before fell out of a sliding window)

    def is_expired(self, now: float) -> bool:
        return now >= self.expires_at


class LeaseTable:
    """Open transfer leases by id."""

    def __init__(self, *, default_ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
        self.default_ttl_s = default_ttl_s
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def create(self, block_ids: Sequence[int], ttl_s: float | None = None, *, now: float,
               first_block: int = 0) -> Lease:
        """Pin ``block_ids`` (a prompt's from ``first_block`` on) under a new lease that expires ``ttl_s``
        (default: the table's) from ``now``."""
        ttl_s = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        ids = tuple(int(b) for b in block_ids)
        if any(b < 0 for b in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"lease block ids must be distinct and >= 0, got {list(ids)}")
        lease_id = secrets.token_hex(LEASE_ID_BYTES)
        lease = self._leases[lease_id] = Lease(lease_id=lease_id, block_ids=ids, expires_at=now + ttl_s,
                                               first_block=first_block)
        return lease

    def get(self, lease_id: str, now: float) -> Lease:
        """The live lease ``lease_id``; LeaseNotFound if unknown, released or expired (expired ones stay
        in the table until ``expire`` hands them back)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(f"unknown transfer lease {_short(lease_id)}")
        if lease.is_expired(now):
            raise LeaseNotFound(f"transfer lease {_short(lease_id)} expired")
        return lease

    def renew(self, lease_id: str, ttl_s: float | None = None, *, now: float) -> Lease | None:
        """Extend an open lease to expire ``ttl_s`` (default: the table's) from ``now``; None if not open.
        A lease pinned before its blocks were computed (layer-wise) restarts its clock once they are."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        ttl_s = self.default_ttl_s if ttl_s is None else ttl_s
        renewed = self._leases[lease_id] = replace(lease, expires_at=max(lease.expires_at, now + ttl_s))
        return renewed

    def release(self, lease_id: str) -> Lease | None:
        """Remove the lease (the decoder acked); its blocks are the caller's to free. None if not open."""
        return self._leases.pop(lease_id, None)

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every lease expired at ``now``, earliest first; the caller frees their blocks."""
        expired = sorted((l for l in self._leases.values() if l.is_expired(now)), key=lambda l: l.expires_at)
        for lease in expired:
            del self._leases[lease.lease_id]
        return expired

    def next_expiry(self) -> float | None:
        """When the earliest open lease expires (for the owner's timer); None when no lease is open."""
        return min((l.expires_at for l in self._leases.values()), default=None)

    def pinned_block_ids(self) -> set[int]:
        """Every block pinned by an open lease (for invariant checks)."""
        return {b for lease in self._leases.values() for b in lease.block_ids}

    def resolver(self, clock: Callable[[], float]) -> Callable[[str], tuple[int, ...]]:
        """A transport ``resolve`` callback: lease id -> its block ids, LeaseNotFound if not live."""
        return lambda lease_id: self.get(lease_id, clock()).block_ids


def _short(lease_id: str) -> str:
    """Enough of an id to correlate logs without printing a full capability."""
    return repr(lease_id[:8] + "...") if len(lease_id) > 8 else repr(lease_id)
