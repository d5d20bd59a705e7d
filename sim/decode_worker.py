"""A modelled decode worker D: a continuous batch, and local prefills chunked into its steps.

Each step emits one token for every running sequence and, while a local prefill is being computed, carries one
chunk of it (``chunk_tokens``). A step's time comes from the time model for that step's batch, KV and chunk.
Steps whose make-up does not change are folded into one **segment** and one event: a segment ends when a
sequence finishes, a prefill chunk is done, or after ``max_segment_steps`` (the KV the batch holds grows by a
token per sequence per step; the step time is re-read then). A change from outside (a pulled request joining, a
local prefill arriving) takes effect at the next step boundary, like an engine's scheduler between steps: the
segment is cut there (``wake``) and a new one planned.

Memory: a request's blocks for its prompt and its whole output are reserved when it is admitted (the model
never preempts), its prefix reused from the pool; a local prefill waits at the head of its queue until its
blocks fit. Pure: the caller schedules the returned event times.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_transfer.hashing import BlockHash
from kv_transfer.workers import WorkerLoad
from sim.kv_pool import KVPool, Reservation
from sim.self_report import SelfReport
from sim.timing import Chunk, TimeModel


@dataclass(slots=True)
class Seq:
    """A request in the running batch."""

    request_id: str
    remaining: int  # tokens still to emit
    context: int  # tokens in its KV
    reservation: Reservation
    last_token_s: float


@dataclass(slots=True)
class LocalJob:
    """A prompt D computes itself; ``imported`` leading blocks were pulled from a prefix holder first."""

    request_id: str
    hashes: Sequence[BlockHash]
    prompt_tokens: int
    output_tokens: int
    arrived_s: float
    imported_blocks: int = 0
    reservation: Reservation | None = None
    done_tokens: int = 0
    cached_tokens: int = 0  # from D's pool or imported: not computed
    started_s: float | None = None

    @property
    def left(self) -> int:
        return self.prompt_tokens - self.done_tokens


@dataclass(slots=True)
class StepOutcome:
    first_tokens: list[tuple[LocalJob, float]] = field(default_factory=list)  # local prefills done, at
    finished: list[tuple[str, float]] = field(default_factory=list)  # (request id, its last token's time)


class DecodeWorker:
    def __init__(self, worker_id: str, pool: KVPool, *, block_size: int, time_model: TimeModel, chunk_tokens: int,
                 report: SelfReport, itl: Counter[float], max_segment_steps: int = 64) -> None:
        self.worker_id, self.pool, self.block_size = worker_id, pool, block_size
        self.time_model, self.chunk_tokens, self.report, self.itl = time_model, chunk_tokens, report, itl
        self.max_segment_steps = max_segment_steps
        self.running: dict[str, Seq] = {}
        self.inbox: list[Seq] = []  # pulled, joining at the next step boundary
        self.queue: deque[LocalJob] = deque()
        self.active: LocalJob | None = None
        self.version = 0  # of the planned segment: a step event of an older version is stale
        self._seg: tuple[float, float, int, int] | None = None  # (start_s, step_s, steps, chunk tokens)
        self.busy_s = 0.0
        self.num_segments = 0

    @property
    def idle(self) -> bool:
        """Nothing running, joining, queued or computing, no block held: a drained worker may leave."""
        return (not (self.running or self.inbox or self.queue) and self.active is None and self._seg is None
                and self.pool.num_free_blocks == self.pool.num_blocks)

    @property
    def busy(self) -> bool:
        """A segment of steps is in flight."""
        return self._seg is not None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.pool.num_blocks

    # ---- from outside -------------------------------------------------------------------------
    def reserve_remote(self, hashes: Sequence[BlockHash], prompt_tokens: int, output_tokens: int) -> Reservation | None:
        """Blocks for a remotely prefilled request (its cached prefix reused); None: no room now."""
        return self.pool.reserve(hashes, self.blocks_for(prompt_tokens + output_tokens),
                                 max_cached=prompt_tokens // self.block_size)

    def join(self, request_id: str, reservation: Reservation, hashes: Sequence[BlockHash], prompt_tokens: int,
             remaining: int, first_token_s: float, now_s: float) -> tuple[float, int] | None:
        """The pulled blocks are in: commit them; the request joins at the next step boundary."""
        self.pool.commit(reservation, hashes, len(hashes))
        self.inbox.append(Seq(request_id, remaining, prompt_tokens + 1, reservation, first_token_s))
        return self.wake(now_s)

    def submit(self, job: LocalJob, now_s: float) -> tuple[float, int] | None:
        self.queue.append(job)
        return self.wake(now_s)

    def wake(self, now_s: float) -> tuple[float, int] | None:
        """Something changed: (time, version) of the step event that applies it, or None (already due)."""
        if self._seg is None:
            return self._plan(now_s)
        start_s, step_s, steps, _ = self._seg
        done = min(math.ceil((now_s - start_s) / step_s - 1e-9), steps)
        if done >= steps:
            return None  # the segment's own end is the next boundary: it re-plans there
        self.version += 1
        self._seg = (start_s, step_s, done, self._seg[3])
        return start_s + done * step_s, self.version

    # ---- steps --------------------------------------------------------------------------------
    def on_step(self, now_s: float, version: int) -> tuple[StepOutcome, tuple[float, int] | None]:
        """A step event: apply the segment's steps, admit what waits, plan the next segment."""
        outcome = StepOutcome()
        if version != self.version or self._seg is None:
            return outcome, None
        self._apply(outcome)
        return outcome, self._plan(now_s)

    def _apply(self, outcome: StepOutcome) -> None:
        start_s, step_s, steps, chunk = self._seg
        self._seg = None
        if steps == 0:
            return
        end_s, batch = start_s + steps * step_s, len(self.running)
        for seq in list(self.running.values()):
            self.itl[round(start_s + step_s - seq.last_token_s, 5)] += 1
            if steps > 1:
                self.itl[round(step_s, 5)] += steps - 1
            seq.remaining -= steps
            seq.context += steps
            seq.last_token_s = end_s
            if seq.remaining == 0:
                self._finish(seq, outcome)
        if chunk:
            self.report.prefill_step(chunk, step_s)
            self._advance_prefill(chunk, end_s, outcome)
        else:
            self.report.decode_steps(batch, step_s, steps)
        self.busy_s += steps * step_s

    def _advance_prefill(self, chunk: int, end_s: float, outcome: StepOutcome) -> None:
        job = self.active
        job.done_tokens += chunk
        self.pool.commit(job.reservation, job.hashes, job.done_tokens // self.block_size)
        if job.left:
            return
        self.active = None
        outcome.first_tokens.append((job, end_s))
        seq = Seq(job.request_id, job.output_tokens - 1, job.prompt_tokens + 1, job.reservation, end_s)
        if seq.remaining == 0:
            self._finish(seq, outcome)
        else:
            self.running[seq.request_id] = seq

    def _finish(self, seq: Seq, outcome: StepOutcome) -> None:
        self.running.pop(seq.request_id, None)
        self.pool.release(seq.reservation)
        outcome.finished.append((seq.request_id, seq.last_token_s))

    def _plan(self, now_s: float) -> tuple[float, int] | None:
        for seq in self.inbox:
            self.running[seq.request_id] = seq
        self.inbox.clear()
        if self.active is None and self.queue:
            self._start_local(now_s)
        chunk = min(self.active.left, self.chunk_tokens) if self.active is not None else 0
        if not self.running and not chunk:
            return None
        context = sum(s.context for s in self.running.values())
        chunks = [Chunk(chunk, self.active.done_tokens, chunk == self.active.left)] if chunk else []
        step_s = self.time_model.step_s(len(self.running), context, chunks)
        steps = 1 if chunk else min(min(s.remaining for s in self.running.values()), self.max_segment_steps)
        self.version += 1
        self.num_segments += 1
        self._seg = (now_s, step_s, steps, chunk)
        return now_s + steps * step_s, self.version

    def _start_local(self, now_s: float) -> None:
        job = self.queue[0]
        blocks = self.blocks_for(job.prompt_tokens + job.output_tokens)
        reservation = self.pool.reserve(job.hashes, blocks, max_cached=(job.prompt_tokens - 1) // self.block_size)
        if reservation is None:
            return  # waits for blocks: a running request's end frees some
        self.queue.popleft()
        ready = max(reservation.cached, min(job.imported_blocks, (job.prompt_tokens - 1) // self.block_size))
        self.pool.commit(reservation, job.hashes, ready)  # the imported prefix landed in fresh blocks
        job.reservation, job.started_s = reservation, now_s
        job.cached_tokens = job.done_tokens = ready * self.block_size
        self.active = job

    # ---- what it reports ----------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        queued = (self.active.left if self.active is not None else 0) + sum(
            j.prompt_tokens - self.pool.cached_prefix(j.hashes) * self.block_size for j in self.queue)
        waiting = len(self.queue) + len(self.inbox) + (self.active is not None)
        return self.report.load(running=len(self.running), waiting=waiting, free_blocks=self.pool.num_free_blocks,
                                queued_prefill_tokens=queued)
