"""One request's trip through the workers: route, Prefill on P, Decode on D, stream back to the client.

    remote:  Prefill(P) -> first token to the client at once (TTFT) -> Decode(D, handle, prompt + [first])
    local:   Decode(D, no handle): D prefills itself (with a prefix holder's lease when one is worth importing)

``_Flow`` runs one request through named stages, in ``_stages`` (one screen), and this is what each failure
does in each stage (DESIGN.md "Request path" 6):

    ROUTING     no decode worker, all saturated        -> UNAVAILABLE / RESOURCE_EXHAUSTED to the client
    PREFILLING  P fails (UNAVAILABLE, RESOURCE_EXH...)  -> Abort to P; PREFILL_RETRY: the cost model re-run
                                                          without P picks another P, once; if it fails too,
                                                          or the model picks local: DECODING with local prefill
                P refuses the request (INVALID_ARGUMENT) or the deadline passes -> that status to the client
    DECODING    D fails before any token                -> Abort to D; once on another D (the lease handed on
                                                          if still usable, else D prefills itself); that one
                                                          failing too after P's first token: MIGRATION
                D fails after tokens were streamed      -> Abort to D; MIGRATION (``router.migration``): the cost
                                                          model re-run for prompt + tokens sent, local plans only,
                                                          without the failed Ds, picks another D (importing a
                                                          holder's prefix if cheaper), which resumes the stream
                                                          exactly; at most max_migrations times, then (or with
                                                          no other D) UNAVAILABLE to the client
                D prefilled locally (pull failed, ...)  -> counted as a fallback (``Timings.local_fallback``)
    any stage   done, stop string, error, client gone, deadline -> ``_cleanup``: cancel worker streams, Abort
                                                          to P and D, end the KV lease (``router.handoff``)

The KV lease (P's handle, or a prefix holder's) is one ``KVLease``: D releases it on its holder the moment its
pull ends and tells the router in its first answer; the router releases it only when no decode worker did,
after D confirmed its abort when D was handed it. Control calls run as background tasks (``router.control``),
so they still go out while the request's own task is being cancelled.

With an OpenTelemetry tracer (``proto.tracing``), each request also leaves spans (``router.tracing``) cut at
its ``RequestTrace`` instants; the Prefill and Decode calls carry the trace context to the workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from engine.errors import CapacityExceeded
from engine.tokenizer import Tokenizer
from kv_transfer.hashing import BlockHash, hash_blocks, root_hash
from kv_transfer.workers import WorkerInfo
from kv_transfer.transport import streams_layers
from proto import baton_pb2 as pb
from proto.tracing import current_tracer
from router.admission import AdmissionGate
from router.coalesce import coalesced, take_text
from router.control import WorkerControl
from router.convert import worker_sampling
from router.routing.cost_model import used_kv_blocks
from router.routing.directory import Snapshot, WorkerDirectory
from router.errors import DeadlineExceeded, Overloaded, WorkerUnavailable, error_from_status
from router.frontend import Job
from router.handoff import KVLease
from router.metrics import RouterMetrics
from router.migration import Migrations, failure_text
from engine.text_stream import TextStream
from router.routing.in_progress import InflightPrefills, PendingPrefixes
from router.routing.policy import (
    Candidate, PolicyConfig, RouteDecision, RouteKind, RouteRequest, RoutingState, pick_decode, route,
)
from router.routing.preselect import Books, PoolView, PreselectConfig, preselect_for
from router.routing.prefix_reuse import lease_prefix
from router.routing.shared_books import NO_OTHERS, OtherBooks, with_others
from router.trace import RequestTrace
from router.tracing import RequestSpans

log = logging.getLogger(__name__)

INDEX_UNANSWERED = "the KV index did not answer in time (Redis slow or down): no prefix was seen"
_NEVER_RETRIED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED})


class Relay:
    """Runs requests across the workers the directory lists."""

    def __init__(
        self, directory: WorkerDirectory, tokenizer: Tokenizer, policy: PolicyConfig, *,
        decode_retries: int = 1, control_rpc_timeout_s: float = 2.0, metrics: RouterMetrics | None = None,
        tracer: Any | None = None, max_inflight_requests: int | None = None, kv_layerwise: bool = False,
        max_migrations: int = 2, preselect: PreselectConfig | None = None,
    ) -> None:
        self.directory, self.tokenizer, self.policy = directory, tokenizer, policy
        # who is priced in a large pool (None: everyone, as the baseline policies need)
        self.preselect = preselect_for(policy, preselect if preselect is not None else PreselectConfig())
        self._view: PoolView | None = None  # the last snapshot's workers, ranked by load
        self.kv_layerwise = kv_layerwise  # remote prefills by PrefillStream, D pulling while P computes
        # the router-wide admission limit, shared by both fronts (None: no limit)
        self.admission = AdmissionGate(max_inflight_requests)
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.decode_retries = decode_retries
        self.max_migrations = max_migrations  # moves to another D after one failed with tokens streamed
        self.control = WorkerControl(directory, timeout_s=control_rpc_timeout_s)
        # Requests this router sent to each decode worker and not yet finished: heartbeats report load
        # every ~2 s, so a burst would otherwise pile onto whichever worker looked idlest.
        self.inflight: Counter[str] = Counter()
        # prompts sent to each worker to compute and not answered yet: remote prefills on P until P answers, local
        # ones on D until its first token (heartbeats lag; a second prompt must see the first's queue)
        self.inflight_prefills = InflightPrefills()
        self.routing = RoutingState.for_config(policy)  # learned rates, RNG, round-robin cursor
        # prompts sent to a worker to compute, until the index shows their blocks
        self.pending_prefixes = PendingPrefixes()
        self.other_books: OtherBooks = NO_OTHERS  # other routers' books, as last read (router.routing.books_sync)
        self.tracer = tracer if tracer is not None else current_tracer()  # None: no spans at all

    def pool_view(self, snapshot: Snapshot) -> PoolView:
        """``snapshot``'s served workers ranked by load: built once per listing, shared by its decisions."""
        if self._view is None or self._view.snapshot is not snapshot:
            self._view = PoolView(snapshot)
        return self._view

    @property
    def inflight_prefill_tokens(self) -> dict[str, int]:
        """Per worker, the prompt tokens sent to it to compute and not answered yet."""
        return self.inflight_prefills.tokens()

    def generate(self, job: Job, deadline_s: float, trace_parent: Any = None) -> AsyncIterator[pb.GenerateResponse]:
        """Stream ``job``'s responses; ``deadline_s`` is on the event loop's clock. ``trace_parent``: the
        client's trace context (``proto.tracing.extract``), which the request's spans continue.

        Over the admission limit (``--max-inflight-requests``) this raises ``Overloaded`` at once, before
        anything is built for the request. The slot is taken (checked again) when the stream starts and
        given back when it ends, whatever ends it: a stream never started holds none."""
        self.metrics.received.inc()  # demand, admitted or not (the planner's traffic rate)
        self.admission.check()
        return _Flow(self, job, deadline_s, trace_parent).run()


class Stage(enum.Enum):
    ROUTING = "routing"
    PREFILLING = "prefilling"  # P computes the prompt (Prefill, or PrefillStream layer-wise)
    PREFILL_RETRY = "prefill_retry"  # the first P failed: once more on another
    DECODING = "decoding"  # D imports the KV (or computes the prompt) and streams tokens
    DONE = "done"  # the final message was built


class _DecodeFailed(Exception):
    def __init__(self, worker: WorkerInfo, code: grpc.StatusCode, details: str, num_tokens: int) -> None:
        super().__init__(f"decode worker {worker.worker_id}: {code.name}: {details}")
        self.worker, self.code, self.details, self.num_tokens = worker, code, details, num_tokens

    def to_error(self) -> Exception:
        if self.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
            return error_from_status(self.code, self.details)
        return WorkerUnavailable(failure_text(self.worker.worker_id, self.num_tokens, self.code, self.details))


class _Flow:
    """The state of one request; every field is touched only from the request's own task."""

    def __init__(self, relay: Relay, job: Job, deadline_s: float, trace_parent: Any = None) -> None:
        self._relay, self._job, self._deadline_s = relay, job, deadline_s
        self._loop = asyncio.get_running_loop()
        self._trace = RequestTrace()
        self._spans = RequestSpans.begin(relay.tracer, self._trace, job.request_id, trace_parent)
        self._text = TextStream(relay.tokenizer, job.prompt_token_ids, job.params.stop)
        self._sampling = worker_sampling(job.params)
        self._output_ids: list[int] = []
        self._finish = pb.FINISH_REASON_UNSPECIFIED
        self._cached_prompt_tokens = 0
        self._snapshot: Snapshot | None = None
        self._candidates: list[Candidate] = []
        self._preselected = False  # the candidates are a large pool's pre-selected few
        self._index_answered = True  # False: Redis did not answer the lookup, the route saw no prefix
        self._route_request: RouteRequest | None = None
        self._hashes: list[BlockHash] = []  # the prompt's blocks, as the in-progress book prices them
        self.stage = Stage.ROUTING
        self._prefill_worker: WorkerInfo | None = None
        self._prefill_pending = False
        self._prefilled_remotely = False  # P produced the first token
        self._lease: KVLease | None = None  # the KV a decode worker is handed: P's, or a prefix holder's
        self._decode_worker: WorkerInfo | None = None
        self._decode_call: Any = None
        self._decode_active = False
        self._decode_has_lease = False  # the running Decode call carries the lease
        self._early_decode: Any = None  # layer-wise: D's Decode call, started on P's handle, not yet read
        self._counted_decode_id: str | None = None  # counted in relay.inflight until cleanup
        self._decision: RouteDecision | None = None
        self._local_prefill: str | None = None  # D, while counted in relay.inflight_prefills
        self._migrations = Migrations(relay.max_migrations)  # moves to another D after tokens were streamed

    async def run(self) -> AsyncIterator[pb.GenerateResponse]:
        try:  # Overloaded if the slot Relay.generate saw free was taken meanwhile
            self._relay.admission.enter()
        except Overloaded as exc:
            self._spans.close(error=f"{type(exc).__name__}: {exc}")
            raise
        self._relay.metrics.running.inc()
        try:
            async for response in self._stages():
                yield response
                if self.stage is not Stage.DONE:
                    self._remaining_s()  # a slow client may keep a write pending past the deadline
        except BaseException as exc:
            self._spans.close(error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._relay.admission.leave(self._trace.elapsed_ms() * 1e-3 if self.stage is Stage.DONE else None)
            self._relay.metrics.running.dec()
            self._cleanup()
            self._spans.close()

    async def _stages(self) -> AsyncIterator[pb.GenerateResponse]:
        """The request's stages in order; each failure's handling is in the module docstring's table."""
        decision = await self._route()
        prefilled = None
        if decision.kind is RouteKind.REMOTE:
            self.stage = Stage.PREFILLING
            prefilled = await self._prefill(decision)
            if prefilled is None and (retry := self._reroute_prefill(decision)) is not None:
                self.stage, decision = Stage.PREFILL_RETRY, retry
                prefilled = await self._prefill(decision)
        if prefilled is not None:
            yield self._on_prefilled(prefilled)
            if self._finish:
                self.stage = Stage.DONE
                yield self._final()
                return
        elif decision.kind is RouteKind.LOCAL:
            self._count_local_prefill(decision)
            if decision.prefix_source_id is not None:
                await self._lease_prefix(decision, self._job.prompt_token_ids)
        self.stage = Stage.DECODING
        async for response in self._decode(decision.decode_id):
            yield response
        self.stage = Stage.DONE
        yield self._final()

    # ---- routing -----------------------------------------------------------------------------
    async def _look_up(self, tokens: list[int]) -> tuple[list[Candidate], int, list[BlockHash]]:
        """Every worker priced for computing ``tokens`` (what the index and the router's books say it holds),
        the block size and ``tokens``' block hashes; a fresh listing in ``self._snapshot``."""
        relay = self._relay
        self._snapshot = await relay.directory.snapshot()
        view = relay.pool_view(self._snapshot)
        scheme = view.scheme
        if scheme is None:
            raise WorkerUnavailable("no decode workers registered")
        root = root_hash(scheme.fingerprint, scheme.block_size, self._job.cache_salt)
        hashes = hash_blocks(tokens, scheme.block_size, root)
        match = await relay.directory.match(hashes)
        books = with_others(Books(relay.inflight, relay.inflight_prefills, relay.pending_prefixes.lookup(hashes),
                                  relay.routing.rates), relay.other_books, hashes)
        candidates, self._preselected = view.candidates(match, books, relay.preselect, relay.routing.rng)
        self._store_blocks = match.store  # the shared store's leading blocks (priced as a fetch)
        self._index_answered = match.answered
        return candidates, scheme.block_size, hashes

    async def _route(self) -> RouteDecision:
        prompt = self._job.prompt_token_ids
        self._candidates, block_size, hashes = await self._look_up(prompt)
        self._route_request = RouteRequest(num_prompt_tokens=len(prompt), block_size=block_size,
                                           max_tokens=self._job.params.max_tokens, store_blocks=self._store_blocks)
        pending = self._relay.pending_prefixes
        decision = route(self._route_request, self._candidates, self._relay.policy, state=self._relay.routing,
                         preselected=self._preselected)
        if not self._index_answered:  # said, so that a miss is not blamed on the workload or a stale index
            decision = dataclasses.replace(decision, reason=f"{decision.reason}; {INDEX_UNANSWERED}")
        self._relay.inflight[decision.decode_id] += 1
        self._counted_decode_id = decision.decode_id
        pending.add(self._job.worker_request_id, decision.prefill_id or decision.decode_id, hashes)
        self._hashes = hashes
        self._trace.route(decision.kind.value, decision.reason, decision.predicted_ttft_s)
        self._spans.routed(decision.kind.value, decision.reason)
        self._decision = decision
        self._relay.metrics.decision(decision.kind.value, decision.reason)
        log.debug("request_id=%s routed %s: decode=%s prefill=%s (%s)", self._job.worker_request_id,
                  decision.kind.value, decision.decode_id, decision.prefill_id, decision.reason)
        return decision

    def _reroute_prefill(self, failed: RouteDecision) -> RouteDecision | None:
        """After P failed: the cost model re-run without it. A remote decision names another P (tried once);
        None when it chooses local prefill, or nothing else fits: D prefills itself; also when D already has the
        prompt (layer-wise: its Decode started on the failed P's handle and was told to recompute)."""
        if self._early_decode is not None:
            return None
        try:
            decision = route(self._route_request, self._candidates, self._relay.policy,
                             exclude=(failed.prefill_id or "",), state=self._relay.routing,
                             preselected=self._preselected)
        except (WorkerUnavailable, CapacityExceeded):
            return None
        if decision.kind is not RouteKind.REMOTE:
            return None
        if decision.decode_id != failed.decode_id:  # the in-flight book follows the decode worker chosen
            _uncount(self._relay.inflight, failed.decode_id, 1)
            self._relay.inflight[decision.decode_id] += 1
            self._counted_decode_id = decision.decode_id
        pending = self._relay.pending_prefixes  # the prompt is being computed on the new P now
        pending.finish(self._job.worker_request_id)
        pending.add(self._job.worker_request_id, decision.prefill_id or decision.decode_id, self._hashes)
        reason = f"retry: prefill on {failed.prefill_id} failed; {decision.reason}"
        self._trace.route(decision.kind.value, reason, decision.predicted_ttft_s)
        self._relay.metrics.decision(decision.kind.value, reason)
        self._decision = decision
        log.warning("request_id=%s prefill on worker_id=%s failed; retrying on worker_id=%s",
                    self._job.worker_request_id, failed.prefill_id, decision.prefill_id)
        return decision

    def _computed_tokens(self, decision: RouteDecision) -> int:
        """The prompt tokens the computing worker will compute (what it queues), per the decision."""
        n = decision.computed_tokens
        return len(self._job.prompt_token_ids) if n is None else n

    def _count_local_prefill(self, decision: RouteDecision) -> None:
        self._local_prefill = decision.decode_id
        self._relay.inflight_prefills.add(decision.decode_id, self._job.worker_request_id,
                                          self._computed_tokens(decision))

    def _settle_local_prefill(self) -> None:
        """D answered (or the request ended): its local prefill no longer counts as D's queue."""
        if self._local_prefill is not None:
            self._relay.inflight_prefills.remove(self._local_prefill, self._job.worker_request_id)
            self._local_prefill = None

    def _info(self, worker_id: str) -> WorkerInfo:
        info = self._snapshot.info(worker_id) if self._snapshot else None
        assert info is not None, f"routed to unknown worker {worker_id}"
        return info

    # ---- prefill -----------------------------------------------------------------------------
    async def _prefill(self, decision: RouteDecision) -> pb.PrefillResponse | None:
        """P's first token and KV handle, or None after a failure (the caller prefills locally)."""
        worker = self._info(decision.prefill_id or "")
        job = self._job
        request = pb.PrefillRequest(
            request_id=job.worker_request_id, token_ids=job.prompt_token_ids, sampling=self._sampling,
            cache_salt=job.cache_salt, decode_worker_id=decision.decode_id, priority=job.priority,
            store_blocks=self._relay.directory.store_run(self._hashes, worker.worker_id),
        )
        self._prefill_worker, self._prefill_pending = worker, True
        inflight = self._relay.inflight_prefills
        inflight.add(worker.worker_id, job.worker_request_id, self._computed_tokens(decision))  # a hit: its tail
        metadata = self._spans.call("prefill", worker.worker_id)
        decode = self._info(decision.decode_id)
        try:
            if self._relay.kv_layerwise and streams_layers(worker.kv_uri, decode.kv_uri):
                response = await self._prefill_streamed(worker, decode, request, metadata)
            else:
                response = await self._relay.directory.stub(worker).Prefill(request, timeout=self._remaining_s(),
                                                                            metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            self._prefill_pending = False
            self._spans.end("prefill", error=exc.code().name)
            self._prefill_failed(worker, exc)
            if self._early_decode is not None:  # D holds the handle and waits: it prefills itself instead
                self._relay.control.first_token(decode, job.worker_request_id, None)
            return None
        finally:
            inflight.remove(worker.worker_id, job.worker_request_id)
        self._prefill_pending = False
        self._spans.end("prefill")
        if self._early_decode is not None and not response.finish_reason:
            self._relay.control.first_token(decode, job.worker_request_id, response.first_token)
        elif response.HasField("handle") and response.handle.lease_id:
            self._hold_lease(worker, response.handle, prefix=False)
        return response

    async def _prefill_streamed(self, worker: WorkerInfo, decode: WorkerInfo, request: pb.PrefillRequest,
                                metadata: Any) -> pb.PrefillResponse:
        """Layer-wise: P's first message is the handle of KV still being computed; Decode starts on D at
        once (D pulls each layer as P writes it), and P's first token follows it there by FirstToken."""
        call = self._relay.directory.stub(worker).PrefillStream(request, timeout=self._remaining_s(),
                                                                metadata=metadata)
        async for response in call:
            if not response.kv_pending:
                return response
            self._hold_lease(worker, response.handle, prefix=False)
            self._early_decode = self._start_decode(decode, pending=True)
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="PrefillStream ended without a first token")

    def _prefill_failed(self, worker: WorkerInfo, exc: grpc.aio.AioRpcError) -> None:
        self._relay.control.abort(worker, self._job.worker_request_id)  # P may be alive and still hold the request
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise self._deadline_error() from exc
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise error_from_status(exc.code(), exc.details() or "") from exc
        log.warning("request_id=%s prefill on worker_id=%s failed (%s: %s)",
                    self._job.worker_request_id, worker.worker_id, exc.code().name, exc.details())
        reason = f"fallback: prefill on {worker.worker_id} failed ({exc.code().name})"
        self._trace.route(RouteKind.LOCAL.value, reason)
        self._relay.metrics.decision(RouteKind.LOCAL.value, reason)

    def _on_prefilled(self, response: pb.PrefillResponse) -> pb.GenerateResponse:
        self._trace.merge(response.timings)
        if self._prefill_worker is not None:  # learn P's prefill rate (the cost model's input)
            computed = len(self._job.prompt_token_ids) - response.num_cached_tokens
            compute_ms = response.timings.prefill_ms - response.timings.queue_ms  # P's queue is priced apart
            self._relay.routing.rates.observe_prefill(self._prefill_worker.worker_id, computed, compute_ms)
        self._prefilled_remotely = True
        self._cached_prompt_tokens = response.num_cached_tokens
        self._relay.metrics.remote_prefill(num_prompt_tokens=len(self._job.prompt_token_ids),
                                           num_cached_tokens=response.num_cached_tokens)
        logprobs = [response.logprobs] if response.HasField("logprobs") else []
        message = self._tokens([response.first_token], logprobs)
        if not self._finish and response.finish_reason:
            self._finish = response.finish_reason
        return message

    # ---- prefix reuse ------------------------------------------------------------------------
    async def _lease_prefix(self, decision: RouteDecision, tokens: list[int]) -> None:
        """Pin the source's cached prefix of ``tokens`` for D (at least a block more than D holds); none: D
        computes it."""
        source = self._snapshot.info(decision.prefix_source_id or "") if self._snapshot else None
        if source is None:
            return
        min_tokens = decision.decode_cached_tokens + self._route_request.block_size
        handle = await lease_prefix(self._relay.directory.stub(source), self._job.worker_request_id,
                                    tokens, self._job.cache_salt, min_tokens, self._remaining_s())
        if handle is not None:
            self._hold_lease(source, handle, prefix=True)

    def _hold_lease(self, holder: WorkerInfo, handle: pb.KVHandle, *, prefix: bool) -> None:
        if self._lease is not None and self._lease.handle.lease_id == handle.lease_id:
            return  # layer-wise: P's final message repeats the handle of its first
        if self._lease is not None:  # a failed prefill's lease, superseded by the retry's
            self._lease.release()
        self._lease = KVLease(holder, handle, self._relay.control, prefix=prefix)
        self._spans.open("kv.lease", **{"baton.lease_id": handle.lease_id})

    # ---- decode ------------------------------------------------------------------------------
    async def _decode(self, decode_id: str) -> AsyncIterator[pb.GenerateResponse]:
        worker, excluded, retries = self._info(decode_id), [], 0
        while True:
            try:
                async for response in self._decode_on(worker):
                    yield response
                return
            except _DecodeFailed as failure:
                if failure.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise self._deadline_error() from failure
                if failure.code in _NEVER_RETRIED:
                    raise failure.to_error() from failure
                excluded.append(worker.worker_id)
                decoded = failure.num_tokens or self._migrations.count  # a decode worker streamed tokens
                if not decoded and retries < self._relay.decode_retries:
                    retries += 1
                    worker = self._replacement(failure, excluded)
                elif self._output_ids:  # the client has tokens (maybe only P's first): they stay, the stream goes on
                    worker = await self._migrate(failure, excluded)
                else:
                    raise failure.to_error() from failure

    def _replacement(self, failure: _DecodeFailed, excluded: Sequence[str]) -> WorkerInfo:
        assert self._route_request is not None
        try:
            candidate, _ = pick_decode(self._route_request, self._candidates, excluded)
        except (WorkerUnavailable, CapacityExceeded):
            if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise failure.to_error() from failure
            raise WorkerUnavailable(f"{failure} and no other decode worker is available") from failure
        log.warning("request_id=%s %s; retrying on worker_id=%s", self._job.worker_request_id, failure,
                    candidate.worker_id)
        self._move_count(candidate.worker_id)
        return candidate.info

    async def _migrate(self, failure: _DecodeFailed, excluded: Sequence[str]) -> WorkerInfo:
        """The decode worker failed after tokens were streamed: the cost model, re-run for the prompt plus those
        tokens with local plans only and without the failed workers, picks the one that resumes the request (first
        leasing a holder's cached prefix when it says so). UNAVAILABLE past the limit, or with no other worker."""
        why = failure_text(failure.worker.worker_id, len(self._output_ids), failure.code, failure.details)
        if self._migrations.exhausted:
            limit = self._relay.max_migrations
            raise WorkerUnavailable(f"{why} (migrated {limit} times already, the limit)" if limit else why) \
                from failure
        self._settle_local_prefill()  # a replacement that failed before its first token computes nothing more
        tokens, outputs = [*self._job.prompt_token_ids, *self._output_ids], len(self._output_ids)
        max_tokens = self._job.params.max_tokens
        try:
            candidates, block_size, _ = await self._look_up(tokens)
            request = RouteRequest(num_prompt_tokens=len(tokens), block_size=block_size, num_resumed_outputs=outputs,
                                   max_tokens=None if max_tokens is None else max_tokens - outputs)
            decision = route(request, candidates, self._relay.policy, exclude=excluded, state=self._relay.routing,
                             preselected=self._preselected)
        except (WorkerUnavailable, CapacityExceeded) as exc:
            raise WorkerUnavailable(f"{why}; no other decode worker can resume it ({exc})") from failure
        self._migrations.moved(self._trace.now())
        self._relay.metrics.migration(failure.code.name)
        self._move_count(decision.decode_id)
        self._count_local_prefill(decision)
        self._trace.note(f"migrated: {why}; resumed on {decision.decode_id} ({decision.reason})")
        log.warning("request_id=%s %s; migrating to worker_id=%s", self._job.worker_request_id, why,
                    decision.decode_id)
        if decision.prefix_source_id is not None:
            await self._lease_prefix(decision, tokens)
        return self._info(decision.decode_id)

    def _move_count(self, decode_id: str) -> None:
        """The request's in-flight count follows it to ``decode_id``."""
        if self._counted_decode_id is not None:
            _uncount(self._relay.inflight, self._counted_decode_id, 1)
        self._relay.inflight[decode_id] += 1
        self._counted_decode_id = decode_id

    def _start_decode(self, worker: WorkerInfo, *, pending: bool = False) -> Any:
        metadata = self._spans.call("decode", worker.worker_id)
        call = self._relay.directory.stub(worker).Decode(self._decode_request(worker, pending),
                                                         timeout=self._remaining_s(), metadata=metadata)
        self._decode_worker, self._decode_call, self._decode_active = worker, call, True
        return call

    async def _decode_on(self, worker: WorkerInfo) -> AsyncIterator[pb.GenerateResponse]:
        if self._early_decode is not None and self._decode_worker is not None \
                and worker.worker_id == self._decode_worker.worker_id:
            call, self._early_decode = self._early_decode, None
        else:
            call = self._start_decode(worker)
        with_lease, num_tokens = self._decode_has_lease, 0
        try:
            async for batch in coalesced(call):  # what queued up while the client's last write was pending
                if with_lease:
                    self._lease_read(batch.responses[0].timings.lease_released)
                    with_lease = False
                for response in batch.responses:
                    self._on_decode_progress(response)
                if token_ids := batch.token_ids:
                    num_tokens += len(token_ids)
                    yield self._tokens(token_ids, batch.logprobs)
                if self._finish:  # a stop string matched: D is still generating
                    self._stop_decode()
                    self._spans.end("decode")
                    return
                if batch.finish_reason:
                    self._finish, self._decode_active = batch.finish_reason, False
                    self._spans.end("decode")
                    return
        except grpc.aio.AioRpcError as exc:
            self._decode_active = False
            self._spans.end("decode", error=exc.code().name)
            self._relay.control.abort(worker, self._job.worker_request_id)  # D may be alive and still hold it
            raise _DecodeFailed(worker, exc.code(), exc.details() or "", num_tokens) from exc
        self._decode_active = False
        raise _DecodeFailed(worker, grpc.StatusCode.UNAVAILABLE, "stream ended without a finish reason", num_tokens)

    def _decode_request(self, worker: WorkerInfo, first_token_pending: bool = False) -> pb.DecodeRequest:
        job = self._job
        request = pb.DecodeRequest(
            request_id=job.worker_request_id, token_ids=[*job.prompt_token_ids, *self._output_ids],
            sampling=self._sampling, cache_salt=job.cache_salt, num_output_tokens_so_far=len(self._output_ids),
            priority=job.priority, prompt_len=len(job.prompt_token_ids), first_token_pending=first_token_pending,
            store_blocks=self._relay.directory.store_run(self._hashes, worker.worker_id),
        )
        self._decode_has_lease = self._lease is not None and self._lease.give(request)
        return request

    def _on_decode_progress(self, response: pb.DecodeResponse) -> None:
        migrated = self._migrations.count > 0
        if response.token_ids:
            self._settle_local_prefill()
            self._migrations.resumed(self._trace.now())
            if self._decode_worker is not None:  # D holds the prompt's blocks now (computed or pulled)
                self._relay.pending_prefixes.settle(self._job.worker_request_id, also=[self._decode_worker.worker_id])
        self._trace.merge(response.timings, migrated=migrated)
        timings = response.timings
        if timings.local_fallback:  # D fell back to prefilling itself (pull failed, ...)
            self._relay.metrics.decision(RouteKind.LOCAL.value, timings.route_reason)
        source = self._lease.holder if self._lease is not None else None
        if (timings.transfer_bytes and not timings.kv_layerwise  # a streamed pull also waited on P's layers
                and source is not None and self._decode_worker is not None):
            self._relay.routing.rates.observe_transfer(  # learn the link from P (or the prefix's holder) to D
                source.worker_id, self._decode_worker.worker_id, timings.transfer_bytes,
                timings.transfer_ms, num_tokens=timings.transfer_blocks * self._route_request.block_size)
        if not self._prefilled_remotely and not migrated:  # D computed the prompt (a resumed one counts more)
            self._cached_prompt_tokens = max(self._cached_prompt_tokens, response.num_cached_tokens)

    def _stop_decode(self) -> None:
        if not self._decode_active or self._decode_worker is None:
            return
        self._decode_active = False
        self._decode_call.cancel()
        then_release = self._lease.abandon() if self._lease is not None and self._decode_has_lease else None
        self._relay.control.abort(self._decode_worker, self._job.worker_request_id, then_release=then_release)

    def _lease_read(self, released_by_decode: bool) -> None:
        """D answered a request carrying the lease, so its pull is over; D released the lease on its holder
        then (DESIGN.md's pull model, acked by D itself), or the router does now."""
        if self._lease is not None:
            self._lease.read(released_by_decode)
            self._spans.end("kv.lease")

    # ---- output ------------------------------------------------------------------------------
    def _tokens(self, token_ids: list[int], logprobs: list[pb.Logprobs]) -> pb.GenerateResponse:
        taken, text, stopped = take_text(self._text, token_ids, has_stops=bool(self._job.params.stop))
        self._trace.tokens_sent(taken)
        self._output_ids.extend(token_ids[:taken])  # a stop string ends the output at the token completing it
        self._finish = pb.FINISH_REASON_STOP if stopped else self._finish
        return pb.GenerateResponse(request_id=self._job.request_id, token_ids=token_ids[:taken], text=text,
                                   logprobs=logprobs[:taken])

    def _final(self) -> pb.GenerateResponse:
        piece = self._text.finish()
        usage = pb.Usage(prompt_tokens=len(self._job.prompt_token_ids), completion_tokens=len(self._output_ids),
                         cached_prompt_tokens=self._cached_prompt_tokens)
        prefill = self._prefill_worker.worker_id if self._prefilled_remotely and self._prefill_worker else ""
        decode = self._decode_worker.worker_id if self._decode_worker else ""
        timings = self._trace.final(prefill_worker=prefill, decode_worker=decode)
        timings.migrations, timings.migration_ms = self._migrations.count, self._migrations.stalled_s * 1e3
        self._learn_overhead(timings)
        self._relay.metrics.request_finished(
            self._trace, num_prompt_tokens=usage.prompt_tokens, num_output_tokens=usage.completion_tokens,
            finished_reason=pb.FinishReason.Name(self._finish).removeprefix("FINISH_REASON_").lower())
        final = pb.GenerateResponse(request_id=self._job.request_id, text=piece.text, finish_reason=self._finish,
                                    usage=usage, timings=timings)
        self._spans.finish(final)
        return final

    def _learn_overhead(self, timings: pb.Timings) -> None:
        """Teach the rates what this request measured: the route kind's fixed cost (TTFT minus the
        computing worker's own prefill time), D's local prefill rate, D's decode speed."""
        decision, request = self._decision, self._route_request
        if decision is None or request is None or self._trace.first_token_s is None:
            return
        if timings.route_kind != decision.kind.value or timings.route_reason != decision.reason:
            return  # a fallback changed the route: these figures belong to another plan
        rates = self._relay.routing.rates
        rates.observe_ttft(decision.kind.value, timings.ttft_ms * 1e-3, timings.prefill_ms * 1e-3)
        if decision.kind is RouteKind.LOCAL:
            computed = request.num_prompt_tokens - self._cached_prompt_tokens
            rates.observe_prefill(decision.decode_id, computed, timings.prefill_ms - timings.queue_ms, on_decode=True)
        decode = next((c for c in self._candidates if c.worker_id == decision.decode_id), None)
        if decode is not None and timings.decode_tokens_per_s > 0:
            kv_blocks = used_kv_blocks(decode) + request.blocks_to_admit
            rates.observe_decode(decode.worker_id, decode.num_active + 1, timings.decode_tokens_per_s, kv_blocks)

    # ---- deadline and cleanup ----------------------------------------------------------------
    def _remaining_s(self) -> float:
        remaining = self._deadline_s - self._loop.time()
        if remaining <= 0:
            raise self._deadline_error()
        return remaining

    def _deadline_error(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"request {self._job.request_id} exceeded its deadline after {self._trace.elapsed_ms():.0f} ms "
            f"({len(self._output_ids)} tokens generated)"
        )

    def _cleanup(self) -> None:
        request_id = self._job.worker_request_id
        self._settle_local_prefill()
        self._relay.pending_prefixes.finish(request_id)
        if self._counted_decode_id is not None:
            _uncount(self._relay.inflight, self._counted_decode_id, 1)
        if self._prefill_pending and self._prefill_worker is not None:
            self._relay.control.abort(self._prefill_worker, request_id)
        self._stop_decode()
        if self._lease is not None:
            self._lease.release()


def _uncount(counter: Counter[str], key: str, n: int) -> None:
    """Take ``n`` off ``counter[key]``, dropping the key at zero (a worker that left leaves no entry)."""
    counter[key] -= n
    if counter[key] <= 0:
        del counter[key]
