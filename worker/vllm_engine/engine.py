"""vLLM's async engine (``AsyncLLM``) behind the worker seam (``worker.engine_seam.WorkerEngine``).

vLLM runs its engine core in a child process; this object lives on the worker's event loop and owns:
- the engine (built from ``VLLMOptions``; NixlConnector on host buffers for disaggregation, prefix caching on,
  block events published to a private ``ipc://`` socket, vLLM's KV lease set to Baton's ``--lease-ttl-s``);
- one output stream per request (``stream``), ending with an ABORT delta when ``abort`` ends it;
- the block-event subscriber feeding ``VLLMBlockBridge`` (Baton's index hashes);
- the load a router prices it by: vLLM's scheduler figures (a stat logger), the prompt tokens of requests that
  have not produced their first token yet, and the rates measured by ``calibrate``.

Importing this module imports vLLM: only ``worker.vllm_engine.node`` does, in a process of ``.venv-vllm``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from vllm import SamplingParams as VLLMSamplingParams
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from engine.async_engine import EngineDead
from engine.core.block_pool import BlockEvent
from engine.core.outputs import RequestDelta, SchedulerStats
from engine.core.request import FinishReason
from engine.errors import CapacityExceeded, InvalidRequest
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.ports import free_port
from kv_transfer.transport import TransportConfig
from kv_transfer.workers import WorkerLoad
from worker.engine_seam import Holdings
from worker.vllm_engine import connector, kv_plane, plugin
from worker.vllm_engine.blocks import VLLMBlockBridge
from worker.vllm_engine.identity import vllm_kv_identity
from worker.vllm_engine.options import VLLMOptions
from worker.vllm_engine.params import FINISH_OF_VLLM, logprobs_of

logger = logging.getLogger(__name__)
EVENT_TOPIC = b"baton-kv"
MAX_PULLS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Pull:
    num_bytes: int
    seconds: float
    transport: str  # the Baton transport's kind (tcp, cma)


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    num_prompt_tokens: int = 0


class VLLMEngine:
    name = "vllm"

    def __init__(self, options: VLLMOptions) -> None:
        self.options = options
        self._streams: dict[str, _Stream] = {}
        self._stats: Any = None  # vLLM's latest SchedulerStats
        self.pulls: dict[str, Pull] = {}  # vLLM's request id -> its pull by Baton's connector (taken by pull_of)
        self._totals = {"queries": 0, "hits": 0, "preemptions": 0, "aborted": 0, "external_tokens": 0}
        self._events: list[BlockEvent] = []
        self._event_seq: int | None = None
        self.event_gaps = 0
        self.prefill_tokens_per_s: float | None = None
        self.decode_step_s: float | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        options = self.options
        self._tmp = tempfile.TemporaryDirectory(prefix="baton-vllm-")
        endpoint = f"ipc://{self._tmp.name}/kv-events"
        self.side_channel_port = free_port()
        _set_vllm_env(options, self.side_channel_port)
        args = AsyncEngineArgs(
            model=options.model, dtype=options.dtype, block_size=options.block_size,
            max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens, enforce_eager=options.enforce_eager,
            enable_prefix_caching=True, scheduling_policy="priority", disable_log_stats=False,
            num_gpu_blocks_override=_vllm_blocks(options),
            kv_transfer_config=_kv_transfer_config(options),
            kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                              "topic": EVENT_TOPIC.decode()},
        )
        engine = self

        class _Stats(StatLoggerBase):  # vLLM builds it from the class, in this process
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                engine._record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        self._zmq = zmq.asyncio.Context()
        self._sub = self._zmq.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, EVENT_TOPIC)
        self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[_Stats])
        self._sub.connect(endpoint)
        self._describe()
        self._reader = asyncio.create_task(self._read_events(), name="vllm-kv-events")

    def _describe(self) -> None:
        """Fingerprint, layout and pool size, from the engine vLLM built."""
        config, options = self.llm.vllm_config, self.options
        kv = vllm_kv_identity(config)
        self.vllm_block_size, self.fingerprint = kv.vllm_block_size, kv.fingerprint
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.get_vocab_size()
        self.bridge = VLLMBlockBridge(self.fingerprint, options.index_block_size, self.vllm_block_size)
        self.layout = KVLayout(model_fingerprint=self.fingerprint, dtype=kv.dtype, block_size=options.index_block_size,
                               num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim)
        per_block = self.vllm_block_size // options.index_block_size
        self.total_blocks = int(config.cache_config.num_gpu_blocks or 0) * per_block
        self.bytes_per_token = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * self.layout.itemsize
        # Baton's connector names vLLM's own blocks: what a release (a read of none) is checked against
        self.connector_layout = dataclasses.replace(self.layout, block_size=self.vllm_block_size)
        self._release: tuple[KVBuffer, dict[str, Any]] | None = None

    async def stop(self) -> None:
        for client in (self._release[1].values() if self._release is not None else ()):
            client.close()
        self._reader.cancel()
        await asyncio.to_thread(self.llm.shutdown)
        self._sub.close(linger=0)
        self._zmq.term()
        self._tmp.cleanup()

    # ---- requests ------------------------------------------------------------------------
    def check(self, token_ids: list[int]) -> None:
        """Refuse what Baton's engine refuses, with the same errors (and so the same gRPC status)."""
        if not token_ids:
            raise InvalidRequest("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt has {len(token_ids)} tokens; it must be shorter than max_model_len "
                                 f"({self.max_model_len}) to leave room for an output token")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})")
        waiting, options = len(self._streams), self.options
        if options.max_num_waiting is not None and waiting >= options.max_num_waiting + options.max_num_seqs:
            raise CapacityExceeded(f"the waiting queue is full ({waiting} requests); retry later or elsewhere")

    async def stream(self, request_id: str, token_ids: list[int], sampling: dict[str, Any], *,
                     kv_params: dict[str, Any] | None = None, cache_salt: str = "",
                     priority: int = 0) -> AsyncIterator[tuple[RequestDelta, dict[str, Any] | None]]:
        """(delta, vLLM's kv_transfer_params on the last one) until the request ends; leaving early aborts it.
        A request refused before vLLM took it tells the holder of ``kv_params``'s blocks to free them."""
        try:
            self.check(token_ids)
        except (InvalidRequest, CapacityExceeded):
            if kv_params and kv_params.get("do_remote_prefill"):
                await self.reject_kv(request_id, kv_params)
            raise
        params = VLLMSamplingParams(**sampling, output_kind=RequestOutputKind.DELTA,
                                    extra_args={"kv_transfer_params": kv_params} if kv_params else None)
        prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        stream = self._streams[request_id] = _Stream(num_prompt_tokens=len(token_ids))
        feeder = asyncio.create_task(self._feed(request_id, prompt, params, priority, stream))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                delta, _ = item
                finished = delta.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            feeder.cancel()
            if not finished:
                await self._abort_engine(request_id)

    async def _feed(self, request_id: str, prompt: dict, params: Any, priority: int, stream: _Stream) -> None:
        num_top = params.logprobs or 0
        try:
            async for out in self.llm.generate(prompt, params, request_id, priority=priority):
                completion = out.outputs[0]
                tokens = list(completion.token_ids)
                if tokens and stream.first_token_at is None:
                    stream.first_token_at = time.monotonic()
                if completion.finish_reason == "error":  # vLLM failed the request (not the client's doing)
                    raise KVTransferError(f"vLLM failed request {request_id} (its KV could not be loaded)")
                reason = FINISH_OF_VLLM.get(completion.finish_reason) if completion.finish_reason else None
                if out.finished and reason is None:
                    reason = FinishReason.ABORT
                delta = RequestDelta(request_id=request_id, new_token_ids=tokens, finish_reason=reason,
                                     new_logprobs=logprobs_of(completion.logprobs, tokens, num_top),
                                     num_prompt_tokens=len(prompt["prompt_token_ids"]),
                                     num_cached_tokens=out.num_cached_tokens or 0)
                stream.queue.put_nowait((delta, out.kv_transfer_params if out.finished else None))
                if out.finished:
                    return
        except asyncio.CancelledError:
            raise
        except KVTransferError as exc:  # UNAVAILABLE: the router retries or migrates it
            stream.queue.put_nowait(exc)
        except ValueError as exc:  # vLLM's own input validation: the request never entered the engine
            kv_params = (params.extra_args or {}).get("kv_transfer_params")
            if kv_params and kv_params.get("do_remote_prefill"):
                await self.reject_kv(request_id, kv_params)
            stream.queue.put_nowait(InvalidRequest(str(exc)))
        except Exception as exc:  # noqa: BLE001 - the engine died: UNAVAILABLE, and the worker exits
            logger.error("request_id=%s vLLM engine failed: %r", request_id, exc)
            stream.queue.put_nowait(EngineDead(f"vLLM engine failed: {exc!r}"))

    async def abort(self, request_id: str) -> bool:
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.queue.put_nowait((RequestDelta(request_id=request_id, new_token_ids=[],
                                              finish_reason=FinishReason.ABORT), None))
        await self._abort_engine(request_id)
        return True

    async def _abort_engine(self, request_id: str) -> None:
        self._totals["aborted"] += 1
        try:
            await self.llm.abort(request_id)
        except Exception as exc:  # noqa: BLE001 - a dead engine frees nothing more
            logger.debug("abort of %s: %r", request_id, exc)

    async def reject_kv(self, request_id: str, kv_params: dict[str, Any]) -> None:
        """This worker will not read the blocks ``kv_params`` name: vLLM's connector tells their holder to free
        them (a request submitted already aborted)."""
        await self.llm.notify_kv_transfer_request_rejected(request_id, dict(kv_params, do_remote_prefill=True))

    async def release_kv(self, kv_params: dict[str, Any]) -> None:
        """Baton's connector: nobody will read the blocks ``kv_params`` name (held by this worker's engine or
        another's): a read of no blocks ends their lease now, so vLLM frees them (instead of at the lease's TTL)."""
        if kv_params.get("connector") != "baton" or not kv_params.get("remote_lease_id"):
            return
        if self._release is None:
            self._release = KVBuffer.allocate(self.connector_layout, 1), {}
        buffer, clients = self._release
        kinds = tuple(self.options.kv_transports.split(","))
        try:
            await kv_plane.pull_lease(clients, kinds, TransportConfig(), kv_params.get("remote_uris", ""),
                                      kv_params["remote_lease_id"], buffer, [], [], self.options.lease_ttl_s)
        except KVTransferError as exc:
            logger.info("release of lease %s: %s (its holder frees it at its TTL)", kv_params["remote_lease_id"][:8],
                        exc)

    async def calibrate(self, num_tokens: int) -> None:
        """Time a prefill of ``num_tokens`` random tokens and three decode steps, so the router prices this worker
        from its first heartbeat (as Baton's engine does)."""
        ids = [secrets.randbelow(self.vocab_size) for _ in range(min(num_tokens, self.max_model_len - 8))]
        sampling = dict(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
        started, stamps = time.monotonic(), []
        async for delta, _ in self.stream(f"calibrate-{secrets.token_hex(4)}", ids, sampling,
                                          cache_salt=secrets.token_hex(8)):
            stamps += [time.monotonic()] * len(delta.new_token_ids)
        if len(stamps) >= 2:
            self.prefill_tokens_per_s = len(ids) / max(stamps[0] - started, 1e-6)
            self.decode_step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    # ---- the seam ------------------------------------------------------------------------
    def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self._stats = scheduler_stats
            for request_id, num_bytes, seconds, kind in (scheduler_stats.kv_connector_stats or {}).get("pulls", ()):
                self.pulls[request_id] = Pull(num_bytes, seconds, kind)
            while len(self.pulls) > MAX_PULLS_KEPT:  # pulls of requests that ended before their first token
                del self.pulls[next(iter(self.pulls))]
            cache = scheduler_stats.prefix_cache_stats
            self._totals["queries"] += getattr(cache, "queries", 0)
            self._totals["hits"] += getattr(cache, "hits", 0)
        if iteration_stats is not None:
            self._totals["preemptions"] += iteration_stats.num_preempted_reqs
            self._totals["external_tokens"] += iteration_stats.prompt_token_stats.external_kv_transfer

    async def stats(self) -> SchedulerStats:
        s, per_block = self._stats, self.vllm_block_size // self.options.index_block_size
        usage = s.kv_cache_usage if s is not None else 0.0
        free = round((1.0 - usage) * self.total_blocks / per_block) * per_block
        # running / waiting from this worker's own streams (decoding once their first token came), not vLLM's
        # scheduler figures, which reach its stat loggers only from time to time: a whole short stream could run
        # between two of them and never be seen running
        running = sum(1 for stream in self._streams.values() if stream.first_token_at is not None)
        return SchedulerStats(
            num_running=running, num_waiting=len(self._streams) - running,
            num_free_blocks=free, num_total_blocks=self.total_blocks, kv_cache_usage=usage,
            prefix_cache_queries=self._totals["queries"], prefix_cache_hits=self._totals["hits"],
            num_preemptions=self._totals["preemptions"], num_aborted=self._totals["aborted"])

    async def sample(self) -> tuple[SchedulerStats, WorkerLoad]:
        stats = await self.stats()
        queued = sum(s.num_prompt_tokens for s in self._streams.values() if s.first_token_at is None)
        return stats, WorkerLoad(running=stats.num_running, waiting=stats.num_waiting,
                                 free_blocks=stats.num_free_blocks, queued_prefill_tokens=queued,
                                 prefill_tokens_per_s=self.prefill_tokens_per_s, decode_step_s=self.decode_step_s,
                                 decode_batch_size=1.0 if self.decode_step_s is not None else None)

    def pull_of(self, request_id: str) -> Pull | None:
        """The pull Baton's connector made for ``request_id`` (vLLM may suffix its ids), forgotten once taken."""
        for key in [k for k in self.pulls if k == request_id or k.startswith(f"{request_id}-")]:
            return self.pulls.pop(key)
        return None

    @property
    def external_tokens(self) -> int:
        """Prompt tokens whose KV vLLM's connector loaded from other workers, since start."""
        return self._totals["external_tokens"]

    async def take_block_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    async def holdings(self) -> Holdings:
        self._events = []
        return self.bridge.holdings()

    async def _read_events(self) -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while True:
            _, seq_bytes, payload = await self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self._event_seq is not None and seq != self._event_seq + 1:
                self.event_gaps += 1
                logger.warning("vLLM KV events %d..%d were lost: the index misses those blocks until they move "
                               "again", self._event_seq + 1, seq - 1)
            self._event_seq = seq
            for event in decoder.decode(payload).events:
                self._events += self._bridge(event)

    def _bridge(self, event: Any) -> list[BlockEvent]:
        if isinstance(event, BlockStored):
            return self.bridge.stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.medium,
                                      event.extra_keys)
        if isinstance(event, BlockRemoved):
            return self.bridge.removed(event.block_hashes, event.medium)
        if isinstance(event, AllBlocksCleared):
            return self.bridge.cleared()
        return []


def _kv_transfer_config(options: VLLMOptions) -> dict[str, Any]:
    """vLLM's connector between workers: its NixlConnector on host buffers, or Baton's (``connector.py``)."""
    # a failed load is recomputed on D (as Baton's decode workers fall back), not failed (vLLM's default)
    if options.kv_connector == "baton":
        return {"kv_connector": connector.NAME, "kv_connector_module_path": connector.__name__, "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"lease_ttl_s": options.lease_ttl_s, "transports": options.kv_transports,
                                              "host": options.side_channel_host}}
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kv_lease_duration": max(int(options.lease_ttl_s), 6)}}


def _vllm_blocks(options: VLLMOptions) -> int | None:
    if options.num_blocks is None:
        return None
    return max(1, -(-options.num_blocks * options.index_block_size // options.block_size))


def _set_vllm_env(options: VLLMOptions, side_channel_port: int) -> None:
    """vLLM's CPU build and its NIXL connector read these from the environment of the engine core it spawns."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{options.kv_cache_gib:g}"
    if options.cpus:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = options.cpus
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = options.side_channel_host
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    if options.nixl_progress_delay_us:
        os.environ[plugin.ENV] = str(options.nixl_progress_delay_us)
    else:
        os.environ.pop(plugin.ENV, None)


