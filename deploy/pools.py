"""``baton up`` keeps each local pool at its desired size (``{ns}:pool:{role}:desired``, set by
``baton admin scale``): it starts workers, or drains the newest — no new requests are routed to a
draining worker; once it runs and queues nothing it is stopped — so no request is lost.

It also supervises them: a worker that dies (a crash, an OOM kill, SIGKILL) is started again under the same
id after a backoff (1 s, doubling to 30 s; back to 1 s once a run lasted a minute), counted in
``{ns}:restarts`` (``baton admin status`` shows it). Requests it had in flight finish through the request
path's own fault handling (another prefill worker, recompute on the decode worker, a clear UNAVAILABLE).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.redis_index import RedisKeys

Child = Any  # deploy.up.Child: a name and a Popen

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class PoolAction:
    num_to_start: int = 0
    to_drain: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Backoff:
    first_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0  # a run this long counts as healthy: the next death waits first_s again

    def delay_s(self, failures: int) -> float:
        """Before restart number ``failures`` (1, 2, ...) of a worker that keeps dying."""
        return min(self.first_s * 2 ** (failures - 1), self.max_s)


def reconcile(desired: int | None, active: Sequence[str]) -> PoolAction:
    """Pure: ``active`` are the pool's non-draining workers, oldest first; the newest drain first."""
    if desired is None or desired == len(active):
        return PoolAction()
    if desired > len(active):
        return PoolAction(num_to_start=desired - len(active))
    return PoolAction(to_drain=tuple(reversed(active[max(desired, 0):])))


@dataclass
class PoolManager:
    """Owns the worker processes of both pools; ``tick`` is called about once a second."""

    redis: object  # a synchronous redis client
    keys: RedisKeys
    start_worker: Callable[[str, str], Child]  # (role, worker_id) -> the started child
    workers: dict[str, list[Child]] = field(default_factory=lambda: {r: [] for r in ROLES})
    draining: dict[str, tuple[Child, float]] = field(default_factory=dict)  # id -> (child, drain start)
    # A worker's load reaches Redis with its heartbeat (every 2 s): wait longer than that before trusting
    # an idle report, so a request routed just before the drain is seen.
    settle_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    report: Callable[[str], None] = log.warning  # what the supervisor did, for the console
    backoff: Backoff = field(default_factory=lambda: Backoff())
    _next_index: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    _restart_at: dict[str, float] = field(default_factory=dict)  # worker id -> when to start it again
    _started_at: dict[str, float] = field(default_factory=dict)
    _failures: dict[str, int] = field(default_factory=dict)  # worker id -> deaths in a row (for the backoff)

    def start(self, role: str) -> Child:
        worker_id = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        child = self.start_worker(role, worker_id)
        self._started_at[worker_id] = self.clock()
        self.workers[role].append(child)
        return child

    def children(self) -> list[Child]:
        return [c for role in ROLES for c in self.workers[role]] + [c for c, _ in self.draining.values()]

    def tick(self) -> None:
        for role in ROLES:
            raw = self.redis.get(self.keys.pool_desired(role))
            action = reconcile(None if raw is None else int(raw), [c.name for c in self.workers[role]])
            for _ in range(action.num_to_start):
                log.info("scaling %s up: starting %s", role, self.start(role).name)
            for worker_id in action.to_drain:
                self._drain(role, worker_id)
        self.supervise()  # after scaling: a dead worker the pool no longer wants is not started again
        self._stop_idle_drained()

    def supervise(self) -> None:
        """Restart the pools' workers that died (a draining worker that exits is done, not dead)."""
        now = self.clock()
        for role in ROLES:
            for index, child in enumerate(self.workers[role]):
                if child.popen.poll() is None:
                    continue
                if child.name not in self._restart_at:
                    self._schedule_restart(child, now)
                elif now >= self._restart_at[child.name]:
                    del self._restart_at[child.name]
                    self.workers[role][index] = self.start_worker(role, child.name)
                    self._started_at[child.name] = now
                    self.report(f"{child.name} restarted")

    def _schedule_restart(self, child: Child, now: float) -> None:
        ran_s = now - self._started_at.get(child.name, now)
        failures = 1 if ran_s >= self.backoff.reset_after_s else self._failures.get(child.name, 0) + 1
        self._failures[child.name] = failures
        delay_s = self.backoff.delay_s(failures)
        self._restart_at[child.name] = now + delay_s
        restarts = self.redis.hincrby(self.keys.restarts, child.name, 1)
        self.report(f"{child.name} exited with {child.popen.returncode} after {ran_s:.0f} s; restarting in "
                    f"{delay_s:.0f} s (restart {restarts})")

    def _drain(self, role: str, worker_id: str) -> None:
        child = next(c for c in self.workers[role] if c.name == worker_id)
        self.workers[role].remove(child)
        self._restart_at.pop(worker_id, None)  # a dead one scaled away is not started again
        self.draining[worker_id] = (child, self.clock())
        self.redis.sadd(self.keys.draining, worker_id)
        log.info("scaling %s down: draining %s", role, worker_id)

    def _stop_idle_drained(self) -> None:
        for worker_id, (child, since) in list(self.draining.items()):
            load = self.redis.hgetall(self.keys.load(worker_id))
            busy = int(load.get(b"running", 0)) + int(load.get(b"waiting", 0)) if load else 0
            if busy == 0 and self.clock() - since >= self.settle_s and child.popen.poll() is None:
                log.info("%s drained: stopping it", worker_id)
                child.popen.send_signal(signal.SIGTERM)
            if child.popen.poll() is not None:
                del self.draining[worker_id]
                self.redis.srem(self.keys.draining, worker_id)
