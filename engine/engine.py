"""Engine: one synchronous step = schedule -> execute -> update (STYLE.md rule 6)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import torch

from engine.attention.select import pick_backend
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.block_pool import BlockEvent
from engine.core.host_tier import HostCopies
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import CachedPrefix, PrefixReservation, RequestDelta, SchedulerOutput, SchedulerStats
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.speculation import Speculator
from engine.spec_draft import load_draft
from engine.decode_graphs import graph_sizes
from engine.engine_setup import default_num_blocks, fingerprint, keep_freed_memory, pick_device, pick_dtype
from engine.kv_quant import kv_quant
from engine.errors import CapacityExceeded, InvalidRequest
from engine.model.loader import load_model, open_gguf, read_model_config
from engine.model.weight_quant import check_weight_format, quantize_linears
from engine.model_source import resolve_model
from engine.parallel.launch import check_supported, launch
from engine.parallel.shard import TensorParallel
from engine.runner import LayerHook, ModelRunner
from engine.sampling_params import SamplingParams
from engine.step_rates import StepRates
from engine.store_buffer import StoreBuffer
from engine.store_side import EngineStore

logger = logging.getLogger(__name__)
CALIBRATION_RUNS = 3  # timings per calibrated figure, the fastest kept


ScheduledHook = Callable[[SchedulerOutput], None]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_source = resolve_model(config.model)
        self.model_path = self.model_source.path
        self.device = pick_device(config.device)
        started = time.perf_counter()
        # a GGUF's metadata, read once (config, weights, and the offline API's tokenizer); None for a folder
        self.gguf = open_gguf(self.model_source) if self.model_source.is_gguf else None
        self.model_config = read_model_config(self.model_source, pick_dtype(config.dtype, self.device), self.gguf)
        tp = None  # one rank: the whole model here
        if config.tensor_parallel_size > 1:
            check_supported(config, self.model_config, self.device)
            tp = TensorParallel(0, config.tensor_parallel_size)  # rank 0: this process (its share of the model)
        check_weight_format(config.weights, self.device, config.tensor_parallel_size)
        model, weights_id = load_model(self.model_source, self.model_config, self.device, self.gguf, tp)
        quantize_linears(model, config.weights)
        if self.device.type == "cpu":  # after the weights: each stays in pages of its own (mmap, page-aligned)
            keep_freed_memory()
        self.kv_quant = kv_quant(config.kv_cache_dtype)  # None: the cache holds the model's dtype
        self.fingerprint = fingerprint(self.model_config, weights_id, self.kv_quant, config.weights)
        logger.info("loaded %s in %.1f s", self.model_path, time.perf_counter() - started)
        max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                            self.model_config.max_position_embeddings)
        num_blocks = config.num_blocks or default_num_blocks(config, self.model_config, max_model_len, self.device,
                                                              self.kv_quant)
        self.tp, kv_ranks = (None, None) if tp is None else launch(
            config, str(self.model_path), self.model_config, num_blocks, self.kv_quant, self.device, tp)
        try:
            self._build(config, model, num_blocks, max_model_len, kv_ranks)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, model: torch.nn.Module, num_blocks: int, max_model_len: int,
               kv_ranks: torch.Tensor | None) -> None:
        self.cache_config = CacheConfig(
            block_size=config.block_size, num_blocks=num_blocks, enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=config.kv_host_blocks if config.enable_prefix_caching else 0,
            num_store_slots=config.kv_store_buffer_blocks if config.enable_prefix_caching else 0,
            store_write_through=config.kv_store_write == "through",
        )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len, preemption_mode=config.preemption_mode,
            sliding_window=self.model_config.uniform_window,
        )
        self.kv_cache_manager = KVCacheManager(self.cache_config, self.fingerprint)
        speculator = Speculator(config.speculative_config) if config.speculative_config else None
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, speculator)
        self.runner = ModelRunner(
            model, self.model_config, num_blocks=num_blocks, block_size=config.block_size,
            device=self.device, backend=pick_backend(config.attention_backend, self.device, self.model_config,
                                                      self.kv_quant),
            num_host_blocks=self.cache_config.num_host_blocks, quant=self.kv_quant, tp=self.tp, kv_ranks=kv_ranks,
        )
        if config.speculative_config and config.speculative_config.method == "draft_model":
            self.runner.draft = load_draft(config.speculative_config.model, self.model_config, self.device,
                                           num_blocks=num_blocks + 1, block_size=self.cache_config.block_size)
        if self.device.type == "cuda" and not config.enforce_eager:  # never run here (no GPU)
            self.runner.use_decode_graphs(graph_sizes(config.cuda_graph_sizes, config.max_num_seqs), capture=True)
        slots = self.cache_config.num_store_slots  # as many write slots as read slots
        self.store = None if self.kv_cache_manager.store is None else EngineStore(  # the store tier's engine side
            self.kv_cache_manager, StoreBuffer(self.runner.kv_cache, self.runner.host, slots, slots))
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.max_num_waiting = config.max_num_waiting
        self.step_rates = StepRates()  # this engine's measured prefill rate and decode step time

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    def check_healthy(self) -> None:
        """Raise TensorParallelError if a tensor-parallel rank has exited (a no-op on one rank)."""
        if self.tp is not None:
            self.tp.check()

    def close(self) -> None:
        """Stop the tensor-parallel ranks (a no-op on one rank); the engine cannot step afterwards."""
        if self.tp is not None:
            self.tp.close()

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str = "",
        eos_token_ids: frozenset[int] | None = None,
        output_token_ids: list[int] = (),
        hold_blocks: bool = False,
    ) -> Request:
        """Queue a request. ``output_token_ids`` resumes one whose first outputs exist (sampling goes on
        at the next output position); ``hold_blocks`` hands its blocks to the caller when it finishes."""
        request = self._new_request(request_id, prompt_token_ids, params, priority, cache_salt, eos_token_ids,
                                    output_token_ids)
        request.hold_blocks = hold_blocks
        self.scheduler.add_request(request)
        return request

    def add_remote_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str = "",
        eos_token_ids: frozenset[int] | None = None,
        first_block: int = 0,
    ) -> tuple[Request, int, list[int]] | None:
        """Reserve blocks for a prompt whose KV another worker computed: returns (request, leading
        blocks not to pull: cached here, or before ``first_block``, where the KV fell out of the sliding window
        and was not sent; all prompt block ids), or None when the pool is full right now.
        Follow with ``activate_remote`` once the KV is in place, or ``fallback_remote`` to recompute."""
        request = self._new_request(request_id, prompt_token_ids, params, priority, cache_salt, eos_token_ids,
                                    output_token_ids)
        reserved = self.scheduler.add_remote(request, len(prompt_token_ids), first_block)
        self._copy_host_blocks(wait=True)  # what the reservation evicted goes down before the pull overwrites it
        return None if reserved is None else (request, *reserved)

    def activate_remote(self, request_id: str, first_token: int | None = None) -> None:
        """The pulled KV is in place; ``first_token``: the prefill worker's, when it came after the
        reservation (layer-wise streaming)."""
        request = self.scheduler._requests[request_id]
        if first_token is not None:
            request.append_output_token(first_token)
        self.scheduler.activate_remote(request_id, request.num_prompt_tokens)

    def fallback_remote(self, request_id: str, first_token: int | None = None) -> None:
        if first_token is not None:
            self.scheduler._requests[request_id].append_output_token(first_token)
        self.scheduler.fallback_remote(request_id)

    def hold_cached_prefix(self, token_ids: list[int], cache_salt: str, min_tokens: int) -> CachedPrefix | None:
        """Pin this engine's longest cached prefix of a prompt (whole blocks, at most prompt - 1 tokens, under
        ``cache_salt``'s hashes) for another worker to pull; None when shorter than ``min_tokens`` or empty.
        Free it with ``release_blocks``."""
        self._validate(token_ids)
        block_ids, hashes = self.kv_cache_manager.hold_cached_prefix(token_ids, cache_salt)
        num_tokens = len(block_ids) * self.cache_config.block_size
        if not block_ids or num_tokens < min_tokens:
            self.kv_cache_manager.release(block_ids)
            return None
        return CachedPrefix(tuple(block_ids), tuple(hashes), num_tokens)

    def add_prefix_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str = "",
        eos_token_ids: frozenset[int] | None = None,
        hold_blocks: bool = False,
    ) -> PrefixReservation | None:
        """Reserve blocks for a request whose cached prefix another worker (or the store) holds, reusing what is
        cached here, or None when the pool is full right now. The caller pulls the prefix blocks not cached here
        into the reserved ids, then ``activate_prefix``; or ``fallback_remote`` to recompute everything."""
        request = self._new_request(request_id, prompt_token_ids, params, priority, cache_salt, eos_token_ids,
                                    output_token_ids)
        request.hold_blocks = hold_blocks
        reserved = self.scheduler.add_remote(request, request.num_tokens)
        self._copy_host_blocks(wait=True)
        if reserved is None:
            return None
        num_hit, block_ids = reserved
        return PrefixReservation(tuple(block_ids), tuple(request.block_hashes), num_hit)

    def activate_prefix(self, request_id: str, num_prefix_tokens: int) -> None:
        """The first ``num_prefix_tokens`` (whole blocks) of a reserved request's KV are in place: they count as
        cached and join the prefix cache; the request prefills the rest here, then decodes."""
        self.scheduler.activate_prefix(request_id, num_prefix_tokens)

    def release_blocks(self, block_ids: list[int]) -> None:
        """Free blocks a ``hold_blocks`` request handed over or ``hold_cached_prefix`` pinned (their lease ended)."""
        self.kv_cache_manager.release(block_ids)

    def _new_request(self, request_id, prompt_token_ids, params, priority, cache_salt, eos_token_ids,
                     output_token_ids) -> Request:
        self._validate(prompt_token_ids)
        if self.max_num_waiting is not None and len(self.scheduler.waiting) >= self.max_num_waiting:
            raise CapacityExceeded(
                f"the waiting queue is full ({len(self.scheduler.waiting)} requests); retry later or elsewhere"
            )
        if len(prompt_token_ids) + len(output_token_ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt plus outputs so far must be shorter than max_model_len ({self.max_model_len})")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params, seed=seed,
            eos_token_ids=self.eos_token_ids if eos_token_ids is None else eos_token_ids,
            arrival_time=time.monotonic(), priority=priority, cache_salt=cache_salt,
        )
        for token in output_token_ids:
            request.append_output_token(token)
        return request

    def abort(self, request_id: str) -> RequestDelta | None:
        delta = self.scheduler.abort(request_id)
        self.runner.forget([request_id])
        return delta

    def _validate(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequest("prompt must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(prompt_token_ids)} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for an output token"
            )
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")

    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] at every prompt position (scoring; uses scratch blocks, freed at once)."""
        self._validate(prompt_token_ids)
        pool = self.kv_cache_manager.pool
        num_blocks = self.kv_cache_manager.blocks_needed(len(prompt_token_ids))
        if num_blocks > pool.num_free_blocks:
            raise CapacityExceeded(f"scoring needs {num_blocks} free KV blocks, {pool.num_free_blocks} are free")
        block_ids = self.kv_cache_manager.allocate_scratch(num_blocks)
        self._copy_host_blocks()
        try:
            return self.runner.prompt_logits(prompt_token_ids, block_ids)
        finally:
            pool.free(block_ids)

    def calibrate(self, num_tokens: int = 256) -> tuple[float, float] | None:
        """Time one prefill of ``num_tokens`` (capped by the step budget, the model length and the free pool)
        and one decode step after it, on scratch blocks freed at once, and seed ``step_rates`` with them:
        a worker reports its speed from its first heartbeat, so the router never prices a fresh worker at a
        default that can be 10x off (what vLLM's start-up profile run is for memory, this is for time). One
        small untimed forward first pays the first-call costs; each timing is the fastest of ``CALIBRATION_RUNS``.
        Returns (prefill tokens/s, decode step s), or None when the pool has too little room. Call before the
        engine loop starts."""
        size = self.cache_config.block_size
        pool = self.kv_cache_manager.pool
        num_tokens = min(num_tokens, self.scheduler_config.max_num_batched_tokens, self.max_model_len - 2,
                         (pool.num_free_blocks - 1) * size)
        if num_tokens < size:
            return None
        block_ids = self.kv_cache_manager.allocate_scratch(self.kv_cache_manager.blocks_needed(num_tokens + 1))
        self._copy_host_blocks()
        try:
            tokens = [(7 * i + 3) % self.model_config.vocab_size for i in range(num_tokens + 1)]
            self._timed_forward(tokens[:size], block_ids)  # warm-up
            # the fastest of a few: a worker calibrates on a thread beside its event loop, and one wait for the GIL
            # made a single timing of a tiny model's prefill 50x slow (405 tokens/s for ~22,000)
            prefill_s = min(self._timed_forward(tokens[:num_tokens], block_ids) for _ in range(CALIBRATION_RUNS))
            decode_s = min(self._timed_forward(tokens[num_tokens:], block_ids, start=num_tokens)
                           for _ in range(CALIBRATION_RUNS))
            if self.runner.host is not None:
                self._price_host_tier(num_tokens / prefill_s, block_ids)
        finally:
            pool.free(block_ids)
        rates = (num_tokens / prefill_s, decode_s)
        self.step_rates.seed(*rates)
        logger.info("calibrated: prefill %.0f tokens/s (%d tokens), decode step %.1f ms", rates[0], num_tokens,
                    decode_s * 1e3)
        return rates

    def _price_host_tier(self, prefill_tokens_per_s: float, scratch: list[int]) -> None:
        """Copying a block up from the host tier must beat recomputing it; time a copy of scratch blocks, the
        fastest of a few: one copy takes microseconds, so a single timing was the first call's costs, or a wait for
        the GIL (a worker calibrates on a thread beside its event loop), 50x over, and the tier was off for good."""
        host, count = self.runner.host, min(len(scratch), self.cache_config.num_host_blocks)
        loads = HostCopies(loads=tuple(zip(range(count), scratch)))  # scratch blocks: garbage in, freed after
        copy_s = float("inf")
        for _ in range(5):  # microseconds each: more samples cost nothing
            started = time.perf_counter()
            host.copy(loads)
            host.sync()
            copy_s = min(copy_s, (time.perf_counter() - started) / count)
        compute_s = self.cache_config.block_size / prefill_tokens_per_s
        self.kv_cache_manager.host.worth_loading = copy_s < compute_s
        logger.info("host tier: %d blocks of %.2f MiB; a block copies up in %.3f ms, recomputes in %.3f ms: %s",
                    self.cache_config.num_host_blocks, host.bytes_per_block / 2**20, copy_s * 1e3, compute_s * 1e3,
                    "loads hits" if copy_s < compute_s else "recomputes instead")

    def _timed_forward(self, token_ids: list[int], block_ids: list[int], start: int = 0) -> float:
        started = time.perf_counter()
        logits = self.runner.prompt_logits(token_ids, block_ids, start=start, last_only=True)
        logits.argmax().item()  # waits for the device
        return time.perf_counter() - started

    # ---- the loop ------------------------------------------------------------------------
    def step(
        self, *, on_scheduled: ScheduledHook | None = None, on_layer: LayerHook | None = None
    ) -> list[RequestDelta]:
        """One step. Layer-wise KV streaming hooks, both on this thread: ``on_scheduled(output)`` once the
        step's requests are admitted and hold their blocks (``ScheduledSeq.block_ids``), before any layer
        runs; ``on_layer(i)`` after each decoder layer wrote its KV (``engine.runner.LayerHook``)."""
        output = self.scheduler.schedule()
        self._copy_host_blocks()  # evicted blocks down, host-tier hits up: before the forward writes or reads them
        if output.is_empty:
            self.runner.forget(output.preempted_ids)  # a request that preempted itself
            return []
        if on_scheduled is not None:
            on_scheduled(output)
        started = time.perf_counter()
        sampled = self.runner.execute(output, on_layer)  # returns host token ids: the step's device work is done
        self.step_rates.observe(output, time.perf_counter() - started)
        deltas = self.scheduler.update(output, sampled)
        if self.store is not None:
            self.store.copy()  # blocks committed under write-through go out now, not at the next step (if any)
        self.runner.forget([d.request_id for d in deltas if d.finished])  # their sampling state
        return deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def take_block_events(self) -> list[BlockEvent]:
        """Block hashes that entered or left a tier (the KV pool: ``gpu``; the host tier: ``cpu``)."""
        return self.kv_cache_manager.take_events()

    def host_tier_hashes(self) -> list[bytes]:
        """Every block hash the host tier holds (empty without one)."""
        host = self.kv_cache_manager.host
        return host.hashes() if host is not None else []

    def _copy_host_blocks(self, wait: bool = False) -> None:
        """The tiers' queued copies: blocks into the store's write slots first (they read host and pool blocks the
        host copies may overwrite), then the host tier's saves and loads."""
        spilled = self.store is not None and self.store.copy()
        copies = self.kv_cache_manager.take_host_copies()
        if copies:
            self.runner.host.copy(copies)
        if wait and (copies or spilled):
            (self.runner.host or self.store.buffer).sync()
