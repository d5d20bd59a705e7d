"""The simulated clock: a heap of events, taken in time order (ties in the order they were scheduled).

Time jumps from one event to the next; nothing steps through idle time. Pure: the clock is ``now_s``.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass


class Kind(enum.Enum):
    SEND = "send"  # the client sends a request (when the router's time depends on its load)
    ARRIVAL = "arrival"  # a request reaches the router
    PREFILL_IN = "prefill_in"  # the Prefill call reaches P
    PREFILL_STEP = "prefill_step"  # P's step ends
    FIRST_TOKEN = "first_token"  # P's answer (first token + handle) reaches the router
    DECODE_IN = "decode_in"  # the Decode call reaches D (handle or local prefill)
    LOCAL_IN = "local_in"  # D's engine takes a local prefill (after its servicer's hand-off)
    PULL_DONE = "pull_done"  # D has pulled the KV it lacked from P (or a prefix holder)
    DECODE_STEP = "decode_step"  # D's steps up to here are done (a segment ends or a change is due)
    HEARTBEAT = "heartbeat"  # a worker reports its load
    PUBLISH = "publish"  # a worker's block events reach the index
    PLAN = "plan"  # the planner runs (a planner-driven run)
    WORKER_UP = "worker_up"  # a worker the planner asked for has started and registers


@dataclass(frozen=True, slots=True)
class Event:
    at_s: float
    kind: Kind
    target: str  # request id or worker id
    version: int = 0  # a worker's plan version (stale step events are dropped)


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = 0
        self.now_s = 0.0
        self.processed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def clock(self) -> float:
        """The simulated clock, for the router's rates and books."""
        return self.now_s

    def at(self, at_s: float, kind: Kind, target: str, version: int = 0) -> None:
        assert at_s >= self.now_s - 1e-9, f"event {kind} at {at_s} before now {self.now_s}"
        heapq.heappush(self._heap, (max(at_s, self.now_s), self._seq, Event(max(at_s, self.now_s), kind, target,
                                                                             version)))
        self._seq += 1

    def after(self, delay_s: float, kind: Kind, target: str, version: int = 0) -> None:
        self.at(self.now_s + delay_s, kind, target, version)

    def pop(self) -> Event:
        at_s, _, event = heapq.heappop(self._heap)
        self.now_s = at_s
        self.processed += 1
        return event
