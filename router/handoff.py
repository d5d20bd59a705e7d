"""The KV lease a request's decode worker is handed, as the router sees it: one object, one lifecycle.

The lease is P's after a remote prefill (``KVHandle`` in ``DecodeRequest.handle``) or a prefix holder's
(``prefix_handle``, cross-worker prefix reuse). The handoff is direct: D releases it on its holder the moment
its pull ends (``decode_node.servicer``) and says so in its first answer; the router only learns of it, and
releases the lease itself only when no decode worker did::

    OPEN --give--> GIVEN --read(released by D)---------------> ENDED   D's first answer: its pull is over
                   GIVEN --read(not released by D)-> release -> ENDED   (D could not reach the holder)
                   GIVEN --abandon--> Abort D, then release --> ENDED   the request ended while D may read
    OPEN / GIVEN --release---------------------------------> ENDED   no decode worker will read it (any more)

``abandon`` releases only once D confirmed its abort (or is unreachable), so the holder never frees blocks a
decode worker may still be reading. Every call is from the request's own task.
"""

from __future__ import annotations

import enum

from kv_transfer.workers import WorkerInfo
from proto import baton_pb2 as pb
from router.control import WorkerControl


class LeaseState(enum.Enum):
    OPEN = "open"  # the holder pins the blocks; no decode worker was handed them yet
    GIVEN = "given"  # a Decode call carries the handle and may be reading
    ENDED = "ended"  # released (by D or by the router), or left to the holder's TTL


class KVLease:
    def __init__(self, holder: WorkerInfo, handle: pb.KVHandle, control: WorkerControl, *, prefix: bool) -> None:
        self.holder, self.handle, self.prefix = holder, handle, prefix
        self._control = control
        self.state = LeaseState.OPEN

    @property
    def usable(self) -> bool:
        """A decode worker may still be handed it."""
        return self.state is not LeaseState.ENDED

    def give(self, request: pb.DecodeRequest) -> bool:
        """Hand the lease to a Decode call (again, to a replacement decode worker); False once it ended."""
        if not self.usable:
            return False
        (request.prefix_handle if self.prefix else request.handle).CopyFrom(self.handle)
        self.state = LeaseState.GIVEN
        return True

    def read(self, released_by_decode: bool) -> None:
        """The decode worker answered: its pull is over. It released the lease, or the router does now."""
        if self.state is LeaseState.GIVEN and not released_by_decode:
            self._control.release_lease(self.holder, self.handle.lease_id)
        self.state = LeaseState.ENDED

    def abandon(self) -> tuple[WorkerInfo, str] | None:
        """The request ends while the decode worker it was given to may be reading: what to release once that
        worker confirmed its abort (``WorkerControl.abort(..., then_release=...)``); None if not given."""
        if self.state is not LeaseState.GIVEN:
            return None
        self.state = LeaseState.ENDED
        return self.holder, self.handle.lease_id

    def release(self) -> None:
        """No decode worker will read it: the request ended before one was handed it, or after the Decode call
        it was given to failed (that worker was sent Abort when its call failed)."""
        if self.state is not LeaseState.ENDED:
            self._control.release_lease(self.holder, self.handle.lease_id)
        self.state = LeaseState.ENDED
