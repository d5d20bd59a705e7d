"""Typed objects crossing the scheduler <-> runner <-> engine boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import FinishReason, Request


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's slice of a step: tokens [start, start + num_new_tokens) are computed."""

    request: Request
    start: int
    num_new_tokens: int  # the draft tokens included
    block_ids: tuple[int, ...]
    samples: bool  # the slice reaches the last known token, so the step yields the next token
    draft_token_ids: tuple[int, ...] = ()  # speculative decoding: computed after the known tokens, then verified

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def num_rows(self) -> int:
        """Logit rows the step samples for this slice: its last known token's and each draft's."""
        return 1 + len(self.draft_token_ids) if self.samples else 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    num_batched_tokens: int
    preempted_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """What the runner returns: ``ScheduledSeq.num_rows`` tokens per sampling seq, in ``SchedulerOutput.seqs``
    order (one, or one per draft token plus one with speculative decoding)."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    seqs: tuple[ScheduledSeq, ...] | None = None  # the slices as run, when the runner chose their drafts


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """A request's progress in one step: the new tokens, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    held_block_ids: tuple[int, ...] = ()  # hold_blocks requests: blocks now owned by the caller
    queue_s: float | None = None  # the request's wait before its first scheduled step (Request.queue_s)
    num_draft_tokens: int = 0  # speculative decoding, on the finishing delta: tokens drafted for the request
    num_accepted_tokens: int = 0  # ... and how many of them the target accepted
    held_first_block: int = 0  # the prompt block held_block_ids start at: those before fell out of the window

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_aborted: int = 0  # requests ended by abort since the engine started
    host_tier_blocks: int = 0  # blocks the host tier holds now (0 without one)
    host_tier_saved: int = 0  # blocks copied down since start
    host_tier_loaded: int = 0  # blocks copied back up (prefix hits served from host memory) since start
    spec_draft_tokens: int = 0  # speculative decoding since start: draft tokens proposed,
    spec_accepted_tokens: int = 0  # ... accepted,
    spec_steps: int = 0  # ... and (request, step) pairs that drafted


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A prompt's longest cached prefix, pinned for another worker to pull (``Engine.hold_cached_prefix``)."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]  # one per block: the prefix is whole blocks
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PrefixReservation:
    """Blocks reserved for a request whose prefix KV another worker holds (``Engine.add_prefix_request``):
    its first ``num_local_blocks`` were cached here already; the caller fills the rest of the prefix."""

    block_ids: tuple[int, ...]  # the request's blocks, every token's
    block_hashes: tuple[bytes, ...]  # this worker's hashes of the request's full blocks
    num_local_blocks: int
