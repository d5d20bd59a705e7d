"""Which KV transport a pair of workers uses: decided at the pair's first pull, at the handshake, and remembered.

``transport.uris_in_order`` ranks what a serving worker offers by the pulling worker's preference and drops what
a URI alone shows cannot work from here (a cma:// URI of another boot). Some things only the handshake shows: a
cma:// server in another PID namespace of the same kernel (two pods on one node: same boot id), or one whose
memory this process may not read (ptrace rules). Such a transport raises ``TransportUnusable`` before any KV
byte moves; ``PairTransports.pull`` then falls through to the pair's next transport within the same pull (the
lease is still live: nothing was read), remembers what cannot work with that peer so later pulls go straight
to the transport that does, and reports each fall-through once per pair (``on_fallthrough``: the decode worker
logs it and counts it by reason). Any other error (the lease gone, a layout mismatch, an unreachable peer, a
timeout) belongs to the request, not the transport: it propagates, and the caller recomputes as before.

A peer whose KV address cannot be connected to (``PeerUnreachable``: refused, no route, no answer within the
connect timeout) fails the pull as before, but for ``unreachable_retry_s`` afterwards the pair's pulls fail at
once with the same clear error instead of each waiting for the connect timeout again (``on_unreachable`` is
told at the first failure of each such spell).

A pair is keyed by the URIs the peer offers (``KVHandle.data_plane_uri``): a restarted peer offers new ports
or a new boot id and is judged afresh. Only pairs that fell through are remembered (at most ``max_pairs``,
least recently used dropped): for every other pair the puller's first choice is the pair's.
"""

from __future__ import annotations

from collections import OrderedDict
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from kv_transfer.errors import KVTransferError, PeerUnreachable, TransportUnusable
from kv_transfer.transport import uris_in_order

T = TypeVar("T")
MAX_PAIRS = 4096
UNREACHABLE_RETRY_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Fallthrough:
    """A transport that cannot work for a pair, as its handshake showed (reported once per pair)."""

    peer: str  # the serving worker's id
    kind: str  # the transport that cannot work
    reason: str  # ``TransportUnusable.reason``, e.g. "pid_namespace"
    detail: str  # the error's message
    next_kind: str | None  # the pair's next transport; None: none is left


class PairTransports:
    """The pulling side's memory of its pairs: ``pull`` runs a pull over the pair's transport."""

    def __init__(self, preferred: Sequence[str], on_fallthrough: Callable[[Fallthrough], None] | None = None, *,
                 on_unreachable: Callable[[str, PeerUnreachable], None] | None = None, max_pairs: int = MAX_PAIRS,
                 unreachable_retry_s: float = UNREACHABLE_RETRY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.preferred = tuple(preferred)
        self._on_fallthrough = on_fallthrough or (lambda _: None)
        self._on_unreachable = on_unreachable or (lambda peer, exc: None)
        self._max_pairs, self._retry_s, self._clock = max_pairs, unreachable_retry_s, clock
        self._unusable: OrderedDict[str, dict[str, str]] = OrderedDict()  # offered URIs -> kind -> why not
        self._unreachable: dict[str, tuple[float, PeerUnreachable]] = {}  # offered URIs -> (since, the error)

    def candidates(self, offered: str) -> list[str]:
        """The URIs a pull from ``offered`` tries, in order: the puller's preference, less what cannot work for
        the pair; raises KVTransferError when the two have no transport in common."""
        unusable = self._unusable.get(offered, {})
        return [uri for uri in uris_in_order(offered, self.preferred) if urlsplit(uri).scheme not in unusable]

    def chosen(self, offered: str) -> str | None:
        """The URI the pair's next pull uses (None: no transport is left for it)."""
        uris = self.candidates(offered)
        return uris[0] if uris else None

    async def pull(self, peer: str, offered: str, pull: Callable[[str], Awaitable[T]]) -> tuple[T, str]:
        """``pull(uri)`` over the pair's transport, falling through the ones its handshake refuses; returns the
        result and the URI that served it."""
        self._check_reachable(offered)
        while True:
            uris = self.candidates(offered)
            if not uris:
                why = "; ".join(f"{kind}: {detail}" for kind, detail in self._unusable.get(offered, {}).items())
                raise KVTransferError(f"no KV transport works between this worker and {peer}: {why}")
            try:
                result = await pull(uris[0])
            except TransportUnusable as exc:
                self._mark(peer, offered, uris, exc)
                continue
            except PeerUnreachable as exc:
                self._unreachable_since(peer, offered, exc)
                raise
            self._unreachable.pop(offered, None)
            return result, uris[0]

    def _check_reachable(self, offered: str) -> None:
        """Fail at once while the peer was unreachable less than ``unreachable_retry_s`` ago."""
        seen = self._unreachable.get(offered)
        if seen is not None and (age_s := self._clock() - seen[0]) < self._retry_s:
            raise PeerUnreachable(f"{seen[1]} [{age_s:.1f} s ago; not retried for {self._retry_s:g} s]")

    def _unreachable_since(self, peer: str, offered: str, exc: PeerUnreachable) -> None:
        now = self._clock()
        for key in [k for k, (since, _) in self._unreachable.items() if now - since >= self._retry_s]:
            del self._unreachable[key]  # spells long over: their next pull tries again anyway
        if offered not in self._unreachable:
            self._on_unreachable(peer, exc)
        self._unreachable[offered] = (now, exc)

    def _mark(self, peer: str, offered: str, uris: list[str], exc: TransportUnusable) -> None:
        kind = urlsplit(uris[0]).scheme
        unusable = self._unusable.setdefault(offered, {})
        self._unusable.move_to_end(offered)
        while len(self._unusable) > self._max_pairs:
            self._unusable.popitem(last=False)
        if kind in unusable:  # a concurrent first pull of the pair found it already
            return
        unusable[kind] = f"{exc.reason} ({exc})"
        next_kind = urlsplit(uris[1]).scheme if len(uris) > 1 else None
        self._on_fallthrough(Fallthrough(peer=peer, kind=kind, reason=exc.reason, detail=str(exc),
                                         next_kind=next_kind))
