"""Iteration-level continuous batching with one token budget (vLLM v1 style). No torch.

Every step: running requests first (a decode needs 1 token, an unfinished prefill gets the next
chunk), then waiting requests in (priority, arrival) order while the token budget, ``max_num_seqs``
and free blocks allow. A waiting request whose next uncached prompt block another admitted request is
still computing waits for it (SGLang's in-batch prefix caching): admitted at once it would compute the
same blocks again beside it; a step later it takes them from the prefix cache. When a running request
cannot grow, the newest lowest-priority running request is preempted by recompute: its blocks are freed
(full ones stay in the prefix cache) and it goes back to the waiting queue, to resume later mostly from
cache.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from engine.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import RequestDelta, SampledTokens, ScheduledSeq, SchedulerOutput, SchedulerStats
from engine.core.remote_requests import RemoteRequests
from engine.core.request import Request, RequestStatus
from engine.core.speculation import Speculator, accepted
from engine.errors import InvalidRequest


class Scheduler(RemoteRequests):
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, speculator: Speculator | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.speculator = speculator  # speculative decoding (engine/core/speculation.py), or None
        # A lone request must always fit, or the queue could deadlock: cap the length at the pool, unless every
        # layer attends within a window and the pool holds a window plus a step's chunk (all a request then holds).
        pool_tokens, window = kv_cache.pool.num_blocks * kv_cache.block_size, config.sliding_window
        roomy = window is not None and pool_tokens >= window + config.max_num_batched_tokens + 2 * kv_cache.block_size
        self.max_model_len = config.max_model_len if roomy else min(config.max_model_len, pool_tokens)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            # Without chunking a longer request (or a preempted one that grew) could never be admitted.
            raise InvalidRequest(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off"
            )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._order: dict[str, tuple[int, int]] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.num_aborted = 0  # live requests ended by abort (a client gone, a deadline, a router's Abort)
        self.num_prefix_waits = 0  # steps a waiting request sat out for a prefix another request was computing

    # ---- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._check_new(request)
        self._requests[request.request_id] = request
        self._order[request.request_id] = (request.priority, next(self._arrivals))
        self._enqueue(request)

    def abort(self, request_id: str) -> RequestDelta | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            self.waiting.remove(request)
        request.transition(RequestStatus.FINISHED_ABORTED)
        self.num_aborted += 1
        return self._finish(request, [])

    def _check_new(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise InvalidRequest(f"duplicate request id {request.request_id!r}")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _key(self, request: Request) -> tuple[int, int]:
        return self._order[request.request_id]

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._key)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=self._key)
        seqs: list[ScheduledSeq] = []
        preempted: list[str] = []
        budget = self._schedule_running(budget, seqs, preempted)
        if not preempted:
            budget = self._schedule_waiting(budget, seqs)
        block_of = self.kv_cache.block_ids
        out = tuple(
            ScheduledSeq(s.request, s.start, s.num_new_tokens, tuple(block_of(s.request.request_id)),
                         s.end - len(s.draft_token_ids) == s.request.num_tokens, s.draft_token_ids)
            for s in seqs
        )
        return SchedulerOutput(out, self.config.max_num_batched_tokens - budget, tuple(preempted))

    def _schedule_running(self, budget: int, seqs: list[ScheduledSeq], preempted: list[str]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, num_new, budget)
            while self.kv_cache.allocate_slots(request, num_new + len(drafts)) is None:
                if drafts:  # room for the token itself comes first
                    drafts = []
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; the list shrank, i already points at the next one
            seqs.append(ScheduledSeq(request, request.num_computed_tokens, num_new + len(drafts), (), False,
                                     tuple(drafts)))
            budget -= num_new + len(drafts)
            i += 1
        return budget

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Speculative drafts for a running decode, within the step's budget, the model length and max_tokens."""
        if self.speculator is None or num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = min(budget - 1, self.max_model_len - request.num_tokens - 1,
                   request.sampling_params.max_tokens - request.num_output_tokens - 1)
        return self.speculator.drafts(request, room)

    def _schedule_waiting(self, budget: int, seqs: list[ScheduledSeq]) -> int:
        computing = self._blocks_in_progress() if self.waiting and self.kv_cache.enable_caching else None
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[i]
            swapped = self.kv_cache.swapped_out(request)
            if swapped is not None:
                if not self._swap_in(request, swapped, budget, seqs):
                    break
                budget -= seqs[-1].num_new_tokens
                self.waiting.pop(i)
                continue
            computed = self.kv_cache.get_computed_blocks(request)
            hosted = self.kv_cache.host_prefix(request, len(computed))  # the prefix's continuation in host memory
            num_hit = len(computed) + len(hosted)
            if computing and self._waits_for(request, num_hit, computing):
                self.kv_cache.unpin_host(hosted)
                self.num_prefix_waits += 1
                i += 1
                continue
            num_cached = num_hit * self.kv_cache.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                self.kv_cache.unpin_host(hosted)
                break
            num_new = min(num_new, budget)
            fresh = self.kv_cache.allocate_slots(request, len(hosted) * self.kv_cache.block_size + num_new, computed)
            if fresh is None:
                self.kv_cache.unpin_host(hosted)
                break
            if hosted:  # copied up before the step's forward pass, so they count as cached
                self.kv_cache.load_from_host(hosted, fresh[: len(hosted)])
            self.waiting.pop(i)
            if computing is not None:  # what it computes now is in progress for the requests behind it
                computing.update(request.block_hashes[num_hit:])
            self.kv_cache.record_prefix_lookup(request, num_hit)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.transition(RequestStatus.RUNNING)
            self.running.append(request)
            seqs.append(ScheduledSeq(request, num_cached, num_new, (), False))
            budget -= num_new
        return budget

    def _swap_in(self, request: Request, num_blocks: int, budget: int, seqs: list[ScheduledSeq]) -> bool:
        """A swapped-out request resumes where it stopped: its blocks copied back, then its next tokens."""
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        needed = self.kv_cache.blocks_needed(request.num_computed_tokens + num_new)
        if needed > self.kv_cache.pool.num_free_blocks or not self.kv_cache.swap_in(request, num_blocks):
            return False
        if self.kv_cache.allocate_slots(request, num_new) is None:  # room for the next token: it was checked
            raise AssertionError("swap-in allocated its blocks but not the next token's")
        request.transition(RequestStatus.RUNNING)
        self.running.append(request)
        seqs.append(ScheduledSeq(request, request.num_computed_tokens, num_new, (), False))
        return True

    def _blocks_in_progress(self) -> set[bytes]:
        """Hashes of the full blocks running requests have yet to compute (their prompts' uncomputed part)."""
        block_size = self.kv_cache.block_size
        computing: set[bytes] = set()
        for request in self.running:
            done = request.num_computed_tokens // block_size
            if done < len(request.block_hashes):
                computing.update(request.block_hashes[done:])
        return computing

    def _waits_for(self, request: Request, num_hit: int, computing: set[bytes]) -> bool:
        """Another admitted request is computing the block after ``request``'s cached prefix."""
        max_blocks = (request.num_tokens - 1) // self.kv_cache.block_size  # get_computed_blocks' limit
        return num_hit < max_blocks and request.block_hashes[num_hit] in computing

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        swapped = self.config.preemption_mode == "swap" and self.kv_cache.swap_out(request)
        if not swapped:
            self.kv_cache.free(request)
            request.num_computed_tokens = 0  # recompute (mostly from the prefix cache)
        request.num_preemptions += 1
        request.transition(RequestStatus.PREEMPTED)
        self.num_preemptions += 1
        self._enqueue(request)

    # ---- after the forward pass ----------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: SampledTokens) -> list[RequestDelta]:
        results: list[RequestDelta] = []
        tokens = iter(sampled.token_ids)
        logprobs = iter(sampled.logprobs) if sampled.logprobs is not None else None
        for seq in sampled.seqs or output.seqs:
            request = seq.request
            if not seq.samples:
                request.num_computed_tokens = seq.end
                self.kv_cache.commit(request)
                self._slide(request)
                continue
            sampled = [next(tokens) for _ in range(seq.num_rows)]
            entries = [next(logprobs) for _ in range(seq.num_rows)] if logprobs is not None else [None] * seq.num_rows
            drafts = seq.draft_token_ids
            kept = accepted(drafts, sampled) if drafts else sampled
            if drafts:
                self.speculator.record(request.request_id, len(drafts), len(kept) - 1)
            request.num_computed_tokens = seq.end - len(drafts) + len(kept) - 1  # accepted drafts' KV is valid
            results.append(self._after_tokens(request, kept, entries))
        return results

    def _slide(self, request: Request) -> None:
        """A model whose every layer attends within a window frees what fell out of it (a prefill's prompt too:
        its later chunks never attend there; ``_finish`` hands over only the blocks its next token attends to)."""
        if self.config.sliding_window is not None:
            self.kv_cache.free_outside_window(request, self.config.sliding_window)

    def _after_tokens(self, request: Request, tokens: list[int], entries: list) -> RequestDelta:
        """Append a step's tokens (one, or accepted drafts and one more) up to the first that stops the request."""
        keep_logprobs = request.sampling_params.logprobs is not None
        new_logprobs, status = [], None
        for count, (token, entry) in enumerate(zip(tokens, entries), start=1):
            request.append_output_token(token)
            if entry is not None and keep_logprobs:
                request.output_logprobs.append(entry)
                new_logprobs.append(entry)
            status = self._check_stop(request, token)
            if status is not None:
                tokens = tokens[:count]
                break
        self.kv_cache.commit(request)
        if status is None:
            self.kv_cache.trim(request)  # blocks reserved for rejected drafts go back
            self._slide(request)
            return RequestDelta(request.request_id, tokens, None, new_logprobs, queue_s=request.queue_s)
        self.running.remove(request)
        request.transition(status)
        return self._finish(request, tokens, new_logprobs)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids or (not params.ignore_eos and token in request.eos_token_ids):
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, tokens: list[int], new_logprobs: Sequence = ()) -> RequestDelta:
        first_held, held = 0, ()
        if request.hold_blocks and request.status != RequestStatus.FINISHED_ABORTED:
            first_held, held = self.kv_cache.hand_over(request, self.config.sliding_window)
        else:
            self.kv_cache.free(request)
        del self._requests[request.request_id]
        del self._order[request.request_id]
        drafted, accepted_ = self.speculator.forget(request.request_id) if self.speculator else (0, 0)
        return RequestDelta(
            request.request_id, tokens, request.finish_reason, list(new_logprobs),
            request.num_prompt_tokens, request.num_cached_tokens, held, request.queue_s, drafted, accepted_, first_held,
        )

    def stats(self) -> SchedulerStats:
        pool, host, spec = self.kv_cache.pool, self.kv_cache.host, self.speculator
        tier = {} if host is None else dict(host_tier_blocks=len(host), host_tier_saved=host.num_saved,
                                            host_tier_loaded=host.num_loaded)
        if spec is not None:
            tier |= dict(spec_draft_tokens=spec.num_drafted, spec_accepted_tokens=spec.num_accepted,
                         spec_steps=spec.num_steps)
        return SchedulerStats(**tier,
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_free_blocks=pool.num_free_blocks, num_total_blocks=pool.num_blocks,
            kv_cache_usage=pool.usage, prefix_cache_queries=pool.num_cache_queries,
            prefix_cache_hits=pool.num_cache_hits, num_preemptions=self.num_preemptions, num_aborted=self.num_aborted,
        )
