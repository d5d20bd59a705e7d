"""A modelled prefill worker P: Baton's engine reduced to what prefill time depends on.

Prompts are served first come, first served in steps of at most ``step_tokens`` prompt tokens (chunked
prefill: the running prompts' next chunks first, then waiting prompts while the budget lasts). A prompt is
admitted when its blocks fit the KV pool: its longest cached prefix reused (at most prompt - 1 tokens, one is
always computed), the rest allocated. Full blocks are committed as each step computes them, and a waiting prompt
whose next uncached block a running prompt is still computing sits out until it is cached (the real
scheduler's in-batch prefix caching). A finished prompt's blocks stay pinned under its transfer lease until
the decode worker has pulled them (``release``); then they stay cached, evictable. One event per step."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer.hashing import BlockHash
from kv_transfer.workers import WorkerLoad
from sim.kv_pool import KVPool, Reservation
from sim.self_report import SelfReport
from sim.timing import Chunk, TimeModel


@dataclass(slots=True)
class PrefillJob:
    request_id: str
    hashes: Sequence[BlockHash]  # the prompt's full blocks
    prompt_tokens: int
    arrived_s: float
    reservation: Reservation | None = None
    done_tokens: int = 0  # cached or computed so far
    cached_tokens: int = 0
    started_s: float | None = None
    finished_s: float | None = None

    @property
    def left(self) -> int:
        return self.prompt_tokens - self.done_tokens


class PrefillWorker:
    def __init__(self, worker_id: str, pool: KVPool, *, block_size: int, time_model: TimeModel, step_tokens: int,
                 report: SelfReport) -> None:
        self.worker_id, self.pool, self.block_size = worker_id, pool, block_size
        self.time_model, self.step_tokens, self.report = time_model, step_tokens, report
        self.waiting: deque[PrefillJob] = deque()
        self.running: list[PrefillJob] = []
        self.leases: dict[str, PrefillJob] = {}
        self._step: list[tuple[PrefillJob, int]] | None = None  # the step in flight: (job, tokens it computes)
        self._step_s = 0.0
        self.busy_s = 0.0
        self.num_steps = 0

    @property
    def idle(self) -> bool:
        """Nothing queued, computing or leased, no block held: a drained worker may leave."""
        return (not (self.waiting or self.running or self.leases) and self._step is None
                and self.pool.num_free_blocks == self.pool.num_blocks)

    @property
    def busy(self) -> bool:
        """A step is in flight."""
        return self._step is not None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits(self, prompt_tokens: int) -> bool:
        return self.blocks_for(prompt_tokens) <= self.pool.num_blocks

    def submit(self, job: PrefillJob, now_s: float) -> float | None:
        """Queue a prompt; the end of the step it starts, when P was idle."""
        self.waiting.append(job)
        return None if self._step is not None else self._begin(now_s)

    def end_step(self, now_s: float) -> tuple[list[PrefillJob], float | None]:
        """The step in flight ends: (prompts it finished, the end of the next step or None when idle)."""
        assert self._step is not None, "end_step without a step"
        done, tokens = [], 0
        for job, n in self._step:
            job.done_tokens += n
            tokens += n
            self.pool.commit(job.reservation, job.hashes, job.done_tokens // self.block_size)
            if job.left == 0:
                self.running.remove(job)
                job.finished_s = now_s
                self.leases[job.request_id] = job
                done.append(job)
        self.report.prefill_step(tokens, self._step_s)
        self._step = None
        return done, self._begin(now_s)

    def release(self, request_id: str, now_s: float) -> float | None:
        """The transfer lease ends (D pulled the blocks, or needs none): they stay cached, evictable. Returns the
        end of a step this lets start (blocks were short), if any."""
        job = self.leases.pop(request_id)
        self.pool.release(job.reservation)
        return None if self._step is not None else self._begin(now_s)

    def load(self) -> WorkerLoad:
        queued = sum(j.left for j in self.running)
        queued += sum(j.prompt_tokens - self.pool.cached_prefix(j.hashes) * self.block_size for j in self.waiting)
        return self.report.load(running=len(self.running), waiting=len(self.waiting),
                                free_blocks=self.pool.num_free_blocks, queued_prefill_tokens=queued)

    def _begin(self, now_s: float) -> float | None:
        budget, plan = self.step_tokens, []
        for job in self.running:
            if budget <= 0:
                break
            plan.append((job, min(job.left, budget)))
            budget -= plan[-1][1]
        while budget > 0 and self.waiting and self._admit(self.waiting[0], now_s):
            job = self.waiting.popleft()
            self.running.append(job)
            plan.append((job, min(job.left, budget)))
            budget -= plan[-1][1]
        if not plan:
            return None
        self._step = plan
        self._step_s = self.time_model.step_s(0, 0, [Chunk(n, job.done_tokens, n == job.left) for job, n in plan])
        self.busy_s += self._step_s
        self.num_steps += 1
        return now_s + self._step_s

    def _admit(self, job: PrefillJob, now_s: float) -> bool:
        if self._computing(job):
            return False
        reservation = self.pool.reserve(job.hashes, self.blocks_for(job.prompt_tokens),
                                        max_cached=(job.prompt_tokens - 1) // self.block_size)
        if reservation is None:
            return False
        job.reservation, job.started_s = reservation, now_s
        job.cached_tokens = job.done_tokens = reservation.cached * self.block_size
        return True

    def _computing(self, job: PrefillJob) -> bool:
        """Is the prompt's next uncached block being computed by a running prompt?"""
        index = self.pool.cached_prefix(job.hashes)
        if index >= len(job.hashes) or index >= (job.prompt_tokens - 1) // self.block_size:
            return False
        wanted = job.hashes[index]
        return any(r.reservation is not None and wanted in r.hashes[r.reservation.committed:] for r in self.running)
