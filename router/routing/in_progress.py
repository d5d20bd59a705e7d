"""What this router sent workers that they have not finished: prompt tokens to compute, and prefixes to hold.

**In-flight prefills** (``InflightPrefills``). A worker's heartbeat reports its queue up to a period late,
so a burst would pile onto whichever worker looked idle; the router adds what it sent each worker to compute
(P's uncached tokens for a remote prefill until P answers, D's for a local one until D's first token) and
prices the larger. What is left of them drains while the worker computes: the backlog is that of a queue
served at the worker's learned rate since each prompt was sent (a worker 2 s into a 3 s prompt has ~1 s
left, not 3), and a prompt leaves it for good when its worker answers.

**Pending prefixes** (``PendingPrefixes``). The index learns a worker's blocks from the worker's own events,
published after the blocks are computed (every ~0.25 s): a cold 1,000-token prompt is invisible to routing
for the seconds its prefill takes. A second request with the same prefix arriving meanwhile looks like a
miss everywhere, is sent wherever is cheapest to compute it all, and the prefix ends up computed twice,
cached twice (pushing out other prefixes where pools are short) and split between workers for the turns
after it. SGLang's cache-aware router inserts a prompt into its tree when it routes it, and Dynamo's router
in approximate mode does the same; here, the router records the prompt's block hashes against the worker
that computes it (D for a local prefill, P for a remote one) from the decision until D's first token, then
for a ``grace_s`` longer while the index catches up (and adds D then: it holds the blocks too).

The cost policy prices such a worker as holding the prefix, behind its backlog: the engine's scheduler holds
a waiting request back while another computes its next prefix block (``engine.core.scheduler``), so the
second request waits for what is left of the first and computes only its tail. Pure logic with an injected
clock; one router's view (routers do not share it).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kv_transfer.hashing import BlockHash
from kv_transfer.workers import WorkerInfo, WorkerLoad
from router.routing.rates import Rates


class PrefillBook(Protocol):
    """What pricing reads of prompts sent to compute: this router's (``InflightPrefills``), or this router's with
    the other routers' beside them (``router.routing.shared_books.SharedPrefills``)."""

    def __contains__(self, worker_id: object) -> bool: ...

    def backlog(self, worker_id: str, tokens_per_s: float) -> int: ...

    def backlogs(self, workers: Iterable[tuple[WorkerInfo, WorkerLoad | None]], rates: Rates) -> dict[str, int]: ...


def backlogs_of(book: PrefillBook, workers: Iterable[tuple[WorkerInfo, WorkerLoad | None]],
                rates: Rates) -> dict[str, int]:
    """Per worker with prompts in ``book``, what is left of them at its learned prefill rate."""
    out = {}
    for info, load in workers:
        if info.worker_id in book:
            rate = rates.prefill_tokens_per_s(info.worker_id, load, on_decode=info.role == "decode")
            out[info.worker_id] = book.backlog(info.worker_id, rate)
    return out


def queue_left(sent: Iterable[tuple[int, float]], now: float, tokens_per_s: float) -> int:
    """What is left of prompts ``(tokens, sent_s)`` at ``tokens_per_s``: the largest, over each prompt, of the
    tokens sent since it minus what the worker computed since (a queue served in order; at most every token
    sent)."""
    left, since = 0.0, 0
    for tokens, sent_s in sorted(sent, key=lambda e: -e[1]):  # newest first
        since += tokens
        left = max(left, since - (now - sent_s) * tokens_per_s)
    return math.ceil(left)


@dataclass(slots=True)
class InflightPrefills:
    clock: Callable[[], float] = time.monotonic
    _sent: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)  # worker -> request -> (tokens, sent)
    changes: int = 0  # bumped by every add and remove (the shared books republish on a change)

    def add(self, worker_id: str, request_id: str, tokens: int) -> None:
        self._sent.setdefault(worker_id, {})[request_id] = (tokens, self.clock())
        self.changes += 1

    def remove(self, worker_id: str, request_id: str) -> None:
        """The worker answered (or the request ended): the prompt is no longer its queue."""
        sent = self._sent.get(worker_id)
        if sent is not None and sent.pop(request_id, None) is not None:
            self.changes += 1
            if not sent:
                del self._sent[worker_id]

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._sent

    def tokens(self) -> dict[str, int]:
        """Per worker, every prompt token sent and not answered (workers with none left out)."""
        return {w: sum(n for n, _ in sent.values()) for w, sent in self._sent.items()}

    def backlogs(self, workers: Iterable[tuple[WorkerInfo, WorkerLoad | None]], rates: Rates) -> dict[str, int]:
        """Per worker with prompts in flight, what is left of them at its learned prefill rate."""
        return backlogs_of(self, workers, rates)

    def backlog(self, worker_id: str, tokens_per_s: float, also: Sequence[tuple[int, float]] = ()) -> int:
        """What is left of them at ``tokens_per_s`` (``queue_left``), in one queue with ``also``: other routers'
        prompts ``(tokens, sent_s)`` on this clock."""
        sent = self._sent.get(worker_id)
        if not sent and not also:
            return 0
        return queue_left([*sent.values(), *also] if sent else also, self.clock(), tokens_per_s)


@dataclass(slots=True)
class _Entry:
    hashes: tuple[BlockHash, ...]
    workers: list[str]
    expires_s: float | None = None  # None: still computing (kept until settled or finished)


@dataclass(slots=True)
class PendingPrefixes:
    grace_s: float = 1.0  # after the first token: the worker's next event batch plus the index round trip
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, _Entry] = field(default_factory=dict)  # request id -> its prompt's blocks
    _held: dict[str, Counter[BlockHash]] = field(default_factory=dict)  # worker -> pending hash -> requests
    _expiry: list[tuple[float, str]] = field(default_factory=list)  # heap of (expires_s, request id)
    changes: int = 0  # bumped whenever a worker starts or stops holding a request's blocks

    def add(self, request_id: str, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        """``worker_id`` is computing the prompt whose full blocks are ``hashes``."""
        self._purge()
        if not hashes or request_id in self._entries:
            return
        entry = self._entries[request_id] = _Entry(tuple(hashes), [])
        self._hold(entry, worker_id)

    def settle(self, request_id: str, also: Iterable[str] = ()) -> None:
        """The first token is out: the blocks are computed (and held by ``also`` as well, e.g. the decode
        worker that pulled them); keep them for ``grace_s`` while the index catches up."""
        entry = self._entries.get(request_id)
        if entry is None or entry.expires_s is not None:
            return
        for worker_id in also:
            if worker_id not in entry.workers:
                self._hold(entry, worker_id)
        entry.expires_s = self.clock() + self.grace_s
        heapq.heappush(self._expiry, (entry.expires_s, request_id))

    def finish(self, request_id: str) -> None:
        """The request ended: never settled (failed, aborted), its blocks may never be computed: forget them
        now; settled, they stay to the end of the grace."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.expires_s is None:
            self._forget(request_id)

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per worker with pending blocks: how many leading ``hashes`` it will hold (workers with none left out)."""
        self._purge()
        if not hashes:
            return {}
        out = {}
        first = hashes[0]
        for worker_id, held in self._held.items():
            if first not in held:
                continue
            n = 1
            while n < len(hashes) and hashes[n] in held:
                n += 1
            out[worker_id] = n
        return out

    def newest(self, max_hashes: int) -> dict[str, list[BlockHash]]:
        """Per worker, its pending blocks, the newest requests' first, at most ``max_hashes`` in all (a request's
        leading blocks first: a lookup walks a chain from its first block); what other routers are told."""
        self._purge()
        out: dict[str, list[BlockHash]] = {}
        seen: dict[str, set[BlockHash]] = {}
        room = max_hashes
        for entry in reversed(self._entries.values()):
            for worker_id in entry.workers:
                if room <= 0:
                    return out
                have = seen.setdefault(worker_id, set())
                new = [h for h in entry.hashes if h not in have][:room]
                have.update(new)
                out.setdefault(worker_id, []).extend(new)
                room -= len(new)
        return out

    def expire(self) -> None:
        """Forget the settled requests whose grace is over (the other methods do so first)."""
        self._purge()

    def __len__(self) -> int:
        return len(self._entries)

    def _hold(self, entry: _Entry, worker_id: str) -> None:
        entry.workers.append(worker_id)
        self._held.setdefault(worker_id, Counter()).update(entry.hashes)
        self.changes += 1

    def _forget(self, request_id: str) -> None:
        entry = self._entries.pop(request_id)
        self.changes += 1
        for worker_id in entry.workers:
            held = self._held[worker_id]
            for h in entry.hashes:  # one pass: drop a hash with its last request
                if held[h] > 1:
                    held[h] -= 1
                else:
                    del held[h]
            if not held:
                del self._held[worker_id]

    def _purge(self) -> None:
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, request_id = heapq.heappop(self._expiry)
            if request_id in self._entries:
                self._forget(request_id)
