"""Every transfer lease a worker holds, in one object with one lifecycle.

A lease pins blocks for a peer to read. It is opened one of three ways:
- ``hand_over``: a prefill finished and its blocks became the request's lease (``Prefill``);
- ``pin_admitted``: layer-wise, pinned when the step computing the prompt's last chunk starts, before the
  blocks are written (``PrefillStream``); ``hand_over`` then restarts its clock;
- ``pin``: a cached prefix leased to another worker (``LeasePrefix``).
It ends exactly once, by whichever comes first: ``release`` (the reader is done, or the router gave up),
``release_request`` (an ``Abort``) or ``expire`` (its TTL passed). Every end frees the lease's blocks through
the one ``free`` callback, and forgets its request and its layer progress, so nothing is left behind.

Event-loop thread only (the engine thread reaches it through ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from kv_transfer.leases import Lease, LeaseTable
from kv_transfer.progress import LayerProgress
from kv_transfer.staging import StagedLeases, StagingFull, StagingPool

logger = logging.getLogger(__name__)

FreeBlocks = Callable[[Sequence[int]], None]  # hands blocks back to the engine


class WorkerLeases:
    def __init__(self, ttl_s: float, free: FreeBlocks, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = LeaseTable(default_ttl_s=ttl_s)
        self._free, self._clock = free, clock
        self._of_request: dict[str, Lease] = {}  # request id -> its lease, until its Prefill call takes it
        self._admitted: dict[str, Lease] = {}  # layer-wise: pinned at admission, until the prefill hands over
        self._progress: dict[str, LayerProgress] = {}  # lease id -> layers written so far (layer-wise)
        self._waiters: dict[str, asyncio.Future] = {}  # request id -> its admitted lease, for PrefillStream
        self._staging: StagedLeases | None = None  # host staging of every lease (``stage_through``)

    def __len__(self) -> int:
        return len(self.table)

    def stage_through(self, pool: StagingPool) -> StagedLeases:
        """Copy every lease into host staging as it opens (``kv_transfer/staging.py``), for the transports
        served through it (``staged``'s resolve / locate / progress); freed as it ends. Handles still name
        cache blocks, which the transports served in place read as they are."""
        self._staging = StagedLeases(pool, self.table.resolver(self._clock))
        return self._staging

    @property
    def staged(self) -> StagedLeases | None:
        """The leases' host staging (None: none is staged)."""
        return self._staging

    def _opened(self, lease: Lease, progress: LayerProgress | None = None) -> Lease:
        if self._staging is not None:
            try:
                self._staging.stage(lease.lease_id, lease.block_ids, progress)
            except StagingFull as exc:  # its reads are refused: the reader recomputes the prompt
                logger.warning("lease %s is not staged: %s", lease.lease_id[:8], exc)
        return lease

    # ---- opening ---------------------------------------------------------------------------
    def pin(self, block_ids: Sequence[int]) -> Lease:
        """A new lease on blocks already pinned in the engine (a cached prefix)."""
        return self._opened(self.table.create(block_ids, now=self._clock()))

    def pin_admitted(self, request_id: str, block_ids: Sequence[int], progress: LayerProgress,
                     first_block: int = 0) -> Lease:
        """Layer-wise: pin the request's blocks (its prompt's from ``first_block`` on) as their computing step
        starts; wakes its ``wait_admitted``."""
        lease = self.table.create(block_ids, now=self._clock(), first_block=first_block)
        self._admitted[request_id] = self._of_request[request_id] = lease
        self._progress[lease.lease_id] = progress
        self._opened(lease, progress)
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(lease)
        return lease

    def hand_over(self, request_id: str, block_ids: Sequence[int], first_block: int = 0) -> None:
        """The prefill of ``request_id`` finished holding ``block_ids`` (its prompt's from ``first_block`` on):
        they become its lease. Pinned at admission already: that lease's clock restarts now (as a lease made
        after the prefill would), or it was released / expired meanwhile, which freed its blocks; only what the
        request holds beyond them is freed."""
        admitted = self._admitted.pop(request_id, None)
        if admitted is None:
            lease = self.table.create(block_ids, now=self._clock(), first_block=first_block)
            self._of_request[request_id] = self._opened(lease)
            return
        self._progress.pop(admitted.lease_id, None)
        renewed = self.table.renew(admitted.lease_id, now=self._clock())
        if renewed is not None and self._of_request.get(request_id) is admitted:
            self._of_request[request_id] = renewed
        extra = sorted(set(block_ids) - set(admitted.block_ids))
        if extra:
            self._free(extra)

    def take(self, request_id: str) -> Lease | None:
        """The request's lease, for its Prefill call to hand out (None: it ended already)."""
        return self._of_request.pop(request_id, None)

    def wait_admitted(self, request_id: str) -> asyncio.Future:
        """A future set to the request's lease once ``pin_admitted`` pins it; ``forget_waiter`` when done."""
        waiter = self._waiters[request_id] = asyncio.get_running_loop().create_future()
        return waiter

    def forget_waiter(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    # ---- reading ---------------------------------------------------------------------------
    def progress(self, lease_id: str) -> LayerProgress | None:
        """The layers written so far of a lease pinned at admission (None: all of them are), for the
        transports served in place (``staged.progress``: the layers copied to host staging so far)."""
        return self._progress.get(lease_id)

    def resolver(self) -> Callable[[str], Sequence[int]]:
        """A transport ``resolve`` callback for the transports served in place: lease id -> its cache block
        ids, LeaseNotFound if not live (``staged.resolve``: its staging ids)."""
        return self.table.resolver(self._clock)

    def read_ids(self, lease: Lease) -> list[int]:
        """The block ids a reader of ``lease`` asks for (what its handle names): its cache blocks, whatever the
        transport (a staged server translates them)."""
        return list(lease.block_ids)

    def expiry_unix_ms(self, lease: Lease) -> int:
        """When ``lease`` expires, on the wall clock a peer can compare."""
        return int((time.time() + lease.expires_at - self._clock()) * 1e3)

    # ---- ending ----------------------------------------------------------------------------
    def release(self, lease_id: str) -> bool:
        """End the lease and free its blocks; False if it is not open (ended already)."""
        lease = self.table.release(lease_id)
        if lease is not None:
            self._end(lease)
        return lease is not None

    def release_request(self, request_id: str) -> bool:
        """End the lease of a request whose Prefill call never took it (an ``Abort``)."""
        lease = self._of_request.pop(request_id, None)
        return lease is not None and self.release(lease.lease_id)

    def expire(self) -> list[Lease]:
        """End every lease whose TTL passed; returns them (for the log)."""
        expired = self.table.expire(self._clock())
        for lease in expired:
            self._end(lease)
        return expired

    def _end(self, lease: Lease) -> None:
        self._free(lease.block_ids)
        if self._staging is not None:
            self._staging.end(lease.lease_id)
        self._progress.pop(lease.lease_id, None)
        for request_id in [r for r, held in self._of_request.items() if held.lease_id == lease.lease_id]:
            del self._of_request[request_id]
