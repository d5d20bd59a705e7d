"""The scheduler's disaggregation states (no torch): a request whose KV another worker computed (``add_remote`` ->
``activate_remote``), or whose cached prefix another worker holds (-> ``activate_prefix``), and the way back to a
local prefill when the pull fails (``fallback_remote``). A mixin of ``engine.core.scheduler.Scheduler``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.kv_cache_manager import window_start
from engine.core.request import Request, RequestStatus
from engine.errors import InvalidRequest

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.core.kv_cache_manager import KVCacheManager


class RemoteRequests:
    config: SchedulerConfig
    kv_cache: KVCacheManager
    running: list[Request]
    _requests: dict[str, Request]

    def add_remote(self, request: Request, num_prompt_tokens: int,
                   first_block: int = 0) -> tuple[int, list[int]] | None:
        """Reserve blocks for a prompt whose KV will be pulled; reuse locally cached prefix blocks.

        Returns (how many leading blocks need no pull, the request's block ids), or None when the pool cannot
        hold the prompt now (the caller falls back to local prefill). Cached here means in the pool or, past it,
        in the host tier: those blocks are copied up into fresh blocks (the caller makes the copies before
        anything writes into the reservation). ``first_block`` > 0: the prompt's blocks before it fell out of
        the sliding window and are not sent; they are pad entries here (``KVCacheManager.allocate_window``).
        """
        self._check_new(request)  # before any block is allocated: a refused id must not leak them
        size = self.kv_cache.block_size
        needed = window_start(num_prompt_tokens, self.config.sliding_window, size)
        if not 0 <= first_block <= needed:
            raise InvalidRequest(f"request {request.request_id!r}: KV from prompt block {first_block} on cannot do: "
                                 f"this model attends from block {needed} of a {num_prompt_tokens}-token prompt")
        if first_block:
            num_hit = self.kv_cache.allocate_window(request, num_prompt_tokens, first_block)
        else:
            num_hit = self._allocate_prompt(request, num_prompt_tokens)
        if num_hit is None:
            return None
        self.add_request(request)
        self.waiting.remove(request)
        request.num_cached_tokens = (num_hit - first_block) * size  # pad entries hold no cached KV
        request.transition(RequestStatus.WAITING_FOR_REMOTE_KV)
        return num_hit, list(self.kv_cache.block_ids(request.request_id))

    def _allocate_prompt(self, request: Request, num_prompt_tokens: int) -> int | None:
        """``add_remote``'s blocks for the whole prompt: its cached prefix, then fresh ones (None: no room)."""
        size, limit = self.kv_cache.block_size, num_prompt_tokens // self.kv_cache.block_size
        computed = self.kv_cache.get_computed_blocks(request)[:limit]
        hosted = self.kv_cache.host_prefix(request, len(computed))
        self.kv_cache.unpin_host(hosted[limit - len(computed):])
        hosted = hosted[: limit - len(computed)]
        num_hit = len(computed) + len(hosted)
        num_new = num_prompt_tokens - num_hit * size
        fresh = self.kv_cache.allocate_slots(request, len(hosted) * size + num_new, computed)
        if fresh is None:
            self.kv_cache.unpin_host(hosted)
            return None
        if hosted:
            self.kv_cache.load_from_host(hosted, fresh[: len(hosted)])
        return num_hit

    def activate_remote(self, request_id: str, num_prompt_tokens: int) -> None:
        """The pulled KV is in place: the request joins the running batch at its next token.

        Its first output token (the prefill worker's) must be there already: with none, the next step would
        schedule 0 new tokens and sample from another sequence's logit row. Refused before any change, so the
        caller can still ``fallback_remote`` (recompute) or abort.
        """
        request = self._requests[request_id]
        if request.num_output_tokens == 0:
            raise InvalidRequest(
                f"request {request_id!r}: activating pulled KV needs the prefill worker's first output token; "
                "none was given (fall back to recompute instead)"
            )
        request.num_computed_tokens = num_prompt_tokens
        self.kv_cache.commit(request)
        request.transition(RequestStatus.RUNNING)
        self.running.append(request)

    def activate_prefix(self, request_id: str, num_prefix_tokens: int) -> None:
        """A prefix of a reserved request's KV is in place (pulled, or cached here): it counts as cached and
        the request prefills the rest in the running batch (chunked, within the token budget)."""
        request = self._requests[request_id]
        num_computed = max(num_prefix_tokens, request.num_cached_tokens)
        assert num_computed % self.kv_cache.block_size == 0 and num_computed < request.num_tokens
        request.num_computed_tokens = request.num_cached_tokens = num_computed
        self.kv_cache.commit(request)
        request.transition(RequestStatus.RUNNING)
        self.running.append(request)

    def fallback_remote(self, request_id: str) -> None:
        """The pull failed: free the reserved blocks and prefill locally instead (recompute)."""
        request = self._requests[request_id]
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.transition(RequestStatus.WAITING)
        self._enqueue(request)

