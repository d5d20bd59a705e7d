"""A request's lifecycle inside the engine: one enum, one transition function (STYLE.md rule 6)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from kv_transfer.hashing import BlockHash, hash_blocks


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # decode side: blocks reserved, KV being pulled
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})
_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset(
        {RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.FINISHED_ABORTED}
    ),
    RequestStatus.WAITING_FOR_REMOTE_KV: frozenset(
        {RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.FINISHED_ABORTED}
    ),
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED} | _FINISHED),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED}),
}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class IllegalTransition(RuntimeError):
    """An internal bug: a request moved between states that have no edge."""


@dataclass(slots=True, eq=False, kw_only=True)
class Request:
    """One generation request. The scheduler owns it; only ``transition`` changes ``status``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # resolved: the user's seed, or a random one drawn at arrival
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first (vLLM's convention); ties by arrival
    cache_salt: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    num_window_freed: int = 0  # leading blocks given back because they fell out of the sliding window
    block_hashes: list[BlockHash] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | None = None  # the stop token id that ended it, if any
    # Prefill side of a disaggregated request: on finish, hand the blocks to the caller (a transfer
    # lease) instead of freeing them.
    hold_blocks: bool = False
    # Seconds from arrival to the first step that scheduled it (its wait in the scheduler's queue), set once
    # by the first WAITING -> RUNNING transition; stays None for a request whose KV was pulled from a
    # prefill worker (it never waits to be prefilled here). ``clock`` is the clock of ``arrival_time``.
    queue_s: float | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

    def transition(self, new_status: RequestStatus) -> None:
        if new_status not in _ALLOWED.get(self.status, frozenset()):
            raise IllegalTransition(f"request {self.request_id}: {self.status.name} -> {new_status.name}")
        if self.queue_s is None and new_status is RequestStatus.RUNNING and self.status is RequestStatus.WAITING:
            self.queue_s = max(self.clock() - self.arrival_time, 0.0)
        self.status = new_status

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def update_block_hashes(self, root: BlockHash, block_size: int) -> None:
        """Hash every full block of the known tokens that is not hashed yet."""
        start = len(self.block_hashes)
        if (start + 1) * block_size > self.num_tokens:
            return
        parent = self.block_hashes[-1] if start else None
        self.block_hashes.extend(hash_blocks(self.all_token_ids, block_size, root, start=start, parent=parent))
