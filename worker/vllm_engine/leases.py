"""A vLLM prefill worker's transfer leases (event-loop thread only).

vLLM's NixlConnector keeps a finished prefill's blocks until the decoder's NIXL notification says it read them, or
until its own lease (``kv_lease_duration``, which Baton sets to ``--lease-ttl-s``) runs out. Baton's lease over them
records what the handle promised: it ends when the reader says it read (``ReleaseLease`` with ``read``: vLLM freed
the blocks on the notification already), when the router gives up on it or the request is aborted (``free`` is
told; vLLM frees the blocks by the end of its own lease, as long as this one), or at its TTL. Same methods as
``worker.leases.WorkerLeases``, so the shell drives both alike.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class VLLMLease:
    lease_id: str
    request_id: str
    kv_params: dict[str, Any]  # what vLLM's connector answered the prefill with
    expires_at: float  # monotonic
    block_ids: tuple[int, ...] = ()  # vLLM's own ids travel in kv_params


FreeLease = Callable[[VLLMLease], None]  # a lease ended unread


class VLLMLeases:
    def __init__(self, ttl_s: float, free: FreeLease, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self._free, self._clock = ttl_s, free, clock
        self._open: dict[str, VLLMLease] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, request_id: str, kv_params: dict[str, Any]) -> VLLMLease:
        lease = VLLMLease(secrets.token_hex(16), request_id, kv_params, self._clock() + self.ttl_s)
        self._open[lease.lease_id] = lease
        return lease

    def expiry_unix_ms(self, lease: VLLMLease) -> int:
        return int((time.time() + lease.expires_at - self._clock()) * 1e3)

    def release(self, lease_id: str, *, read: bool = False) -> bool:
        """End the lease (``free`` is told unless its reader read it). False: not open."""
        lease = self._open.pop(lease_id, None)
        if lease is not None and not read:
            self._free(lease)
        return lease is not None

    def release_request(self, request_id: str) -> bool:
        found = [lease.lease_id for lease in self._open.values() if lease.request_id == request_id]
        for lease_id in found:
            self.release(lease_id)
        return bool(found)

    def expire(self) -> list[VLLMLease]:
        """Forget leases past their TTL: vLLM's own lease, as long, has ended too."""
        now = self._clock()
        expired = [lease for lease in self._open.values() if lease.expires_at <= now]
        for lease in expired:
            del self._open[lease.lease_id]
        return expired
