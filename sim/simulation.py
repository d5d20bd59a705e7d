"""One simulated run: requests through the router and the modelled workers, event by event.

The request path of DESIGN.md, hop by hop (each hop ``rpc_s``): the router routes (the real policy); remote:
P queues and computes the prompt, its first token goes back to the router (TTFT), D reserves blocks (its own
cached prefix reused), pulls what it lacks from P over their link, P's lease ends, the request joins D's batch;
local: D computes the prompt in chunks between its decode steps, after pulling a prefix holder's blocks when the
policy chose to import them. A remote request D has no room for falls back to a local prefill (as D does).
Refused: longer than the model's context, no worker can ever hold it, or the router finds no worker.
Loaded hops (``ClusterConfig.local_return_s`` / ``remote_return_s``, ``local_handoff_s``): the client sees every
token of a request that much later, per route kind, and D's engine takes a local prompt that long after its
servicer did (counted in D's reported queue and prefill time, as the engine's hand-off is on a real worker).

Bounded: at most ``max_events`` events (an error past them, never a hang). Pure apart from the wall clock it
reads to report its own speed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.errors import CapacityExceeded
from router.errors import WorkerUnavailable
from router.routing.policy import RouteKind
from sim.cluster import Cluster, ClusterConfig
from sim.decode_worker import LocalJob
from sim.events import EventQueue, Kind
from sim.kv_pool import Reservation
from sim.metrics import RequestRecord, Slo, summarize
from sim.prefill_worker import PrefillJob
from sim.router import Routed
from sim.workload import SimRequest


class SimulationError(RuntimeError):
    """The run did not end within its bound of events."""


@dataclass(slots=True)
class Flow:
    """One request's state between its events."""

    request: SimRequest
    record: RequestRecord
    routed: Routed | None = None
    prefill_job: PrefillJob | None = None
    reservation: Reservation | None = None  # D's blocks for a remote request
    source_pin: tuple[str, Reservation] | None = None  # a prefix holder's blocks held for D's import
    pull: tuple[str, int, float, int] = ("", 0, 0.0, 0)  # (source, bytes, seconds, blocks) of D's pull
    local: LocalJob | None = None
    prefill_ms: float = 0.0  # the computing worker's call: queue + compute
    queue_ms: float = 0.0


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    summary: dict
    cluster: Cluster
    events: int
    wall_s: float
    decision_ms: dict[str, float] = field(default_factory=dict)  # lookup + candidates + route()
    policy_ms: dict[str, float] = field(default_factory=dict)  # route() alone
    learned: dict[str, dict[str, float]] = field(default_factory=dict)  # the router's rates at the end
    plan_history: list[dict] = field(default_factory=list)  # a planner-driven run's plans (sim/elastic.py)


class Simulation:
    def __init__(self, config: ClusterConfig, requests: Sequence[SimRequest], slo: Slo = Slo(), *,
                 max_events: int | None = None) -> None:
        self.config, self.slo = config, slo
        self.events = EventQueue()
        self.cluster = Cluster(config, self.events)
        self.router = self.cluster.router
        self.flows = {r.request_id: Flow(r, RequestRecord(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens))
                      for r in requests}
        self.records = [f.record for f in self.flows.values()]
        self.max_events = max_events if max_events is not None else 1_000_000 + 500 * len(requests)
        # requests sent and not ended (None: not counted: the router's time is the same for every request)
        self._streams = 0 if config.router_per_stream_s > 0 or config.router_host is not None else None
        for r in requests:  # the router decides router_s after the client sent (its TTFT counts from the send)
            if self._streams is None:
                self.events.at(r.arrival_s + config.router_s, Kind.ARRIVAL, r.request_id)
            else:
                self.events.at(r.arrival_s, Kind.SEND, r.request_id)
        self._handlers = {Kind.SEND: self._send, Kind.ARRIVAL: self._arrival, Kind.PREFILL_IN: self._prefill_in,
                          Kind.FIRST_TOKEN: self._first_token, Kind.DECODE_IN: self._decode_in,
                          Kind.LOCAL_IN: self._local_in,
                          Kind.PULL_DONE: self._pull_done, Kind.PUBLISH: self.cluster.publish,
                          Kind.HEARTBEAT: self.cluster.heartbeat}

    def run(self) -> SimResult:
        started = time.perf_counter()
        while self.events:
            if self.events.processed >= self.max_events:
                raise SimulationError(f"no end after {self.max_events} events (t = {self.events.now_s:.1f} s)")
            event = self.events.pop()
            if event.kind is Kind.PREFILL_STEP:
                self._prefill_step(event.target)
            elif event.kind is Kind.DECODE_STEP:
                self._decode_step(event.target, event.version)
            else:
                self._handlers[event.kind](event.target)
            self._after_event()
        return SimResult(self.records, self._summary(), self.cluster, self.events.processed,
                         time.perf_counter() - started, _decision_ms(self.router.decision_s),
                         _decision_ms(self.router.policy_s), self.router.learned())

    def _after_event(self) -> None:
        """A hook for runs whose pools change (``sim/elastic.py``)."""

    def _summary(self) -> dict:
        return summarize(self.records, self.cluster.itl, self.slo, gpus=self.config.num_gpus,
                         busy_gpu_s=self.cluster.busy_gpu_s())

    # ---- routing -------------------------------------------------------------------------------
    def _send(self, request_id: str) -> None:
        """The client sends; the router takes longer with its host's workers busy beside it (``router_host``) and, with
        ``router_per_stream_s``, the more streams it (and the client) relay."""
        config, shared = self.config, self.cluster.shared
        sharing = 1.0 if config.router_host is None or shared is None else shared.beside(config.router_host)
        delay_s = config.router_s * sharing + config.router_per_stream_s * self._streams
        self._streams += 1
        self.events.after(delay_s, Kind.ARRIVAL, request_id)

    def _ended(self) -> None:
        if self._streams is not None:
            self._streams -= 1

    def _arrival(self, request_id: str) -> None:
        flow = self.flows[request_id]
        request = flow.request
        if request.prompt_tokens + request.output_tokens > self.config.shape.model.max_model_len:
            return self._refuse(flow, "longer than the model's context")
        try:
            flow.routed = self.router.route(request_id, request.hashes, request.prompt_tokens, request.output_tokens)
        except (WorkerUnavailable, CapacityExceeded) as exc:
            return self._refuse(flow, type(exc).__name__)
        decision = flow.routed.decision
        flow.record.route_kind, flow.record.decode_id = decision.kind.value, decision.decode_id
        flow.record.prefill_id = decision.prefill_id or ""
        if decision.kind is RouteKind.REMOTE:
            self.events.after(self.config.rpc_s, Kind.PREFILL_IN, request_id)
        elif decision.prefix_source_id is not None:
            self._lease_prefix(flow, decision.prefix_source_id)
        else:
            self.events.after(self.config.rpc_s, Kind.DECODE_IN, request_id)

    def _refuse(self, flow: Flow, why: str) -> None:
        flow.record.refused = why
        self._ended()
        if flow.routed is not None:
            self.router.finished(flow.routed, ttft_s=None, prefill_ms=0.0, queue_ms=0.0, cached_tokens=0,
                                 decode_tokens_per_s=0.0, same_route=False)

    # ---- remote prefill on P -------------------------------------------------------------------
    def _prefill_in(self, request_id: str) -> None:
        flow = self.flows[request_id]
        worker = self.cluster.prefill[flow.routed.decision.prefill_id]
        if not worker.fits(flow.request.prompt_tokens):
            return self._refuse(flow, "prompt larger than a prefill worker's KV pool")
        flow.prefill_job = PrefillJob(request_id, flow.request.hashes, flow.request.prompt_tokens, self.events.now_s)
        self._at(worker.submit(flow.prefill_job, self.events.now_s), Kind.PREFILL_STEP, worker.worker_id)
        self.cluster.touched(worker.worker_id)

    def _prefill_step(self, worker_id: str) -> None:
        done, next_s = self.cluster.prefill[worker_id].end_step(self.events.now_s)
        self._at(next_s, Kind.PREFILL_STEP, worker_id)
        self.cluster.touched(worker_id)
        for job in done:
            self.events.after(self.config.rpc_s, Kind.FIRST_TOKEN, job.request_id)

    def _first_token(self, request_id: str) -> None:
        flow = self.flows[request_id]
        job, record = flow.prefill_job, flow.record
        record.first_token_s, record.cached_tokens = self._seen(flow, self.events.now_s), job.cached_tokens
        flow.prefill_ms = (job.finished_s - job.arrived_s) * 1e3
        flow.queue_ms = (job.started_s - job.arrived_s) * 1e3
        self.router.prefill_answered(flow.routed, computed_tokens=job.prompt_tokens - job.cached_tokens,
                                     prefill_ms=flow.prefill_ms)
        if flow.request.output_tokens == 1:
            self._release_prefill(flow)
            return self._finish(flow, self.events.now_s)
        self.events.after(self.config.rpc_s, Kind.DECODE_IN, request_id)

    def _release_prefill(self, flow: Flow) -> None:
        worker = self.cluster.prefill[flow.routed.decision.prefill_id]
        self._at(worker.release(flow.request.request_id, self.events.now_s), Kind.PREFILL_STEP, worker.worker_id)
        self.cluster.touched(worker.worker_id)

    # ---- decode on D ---------------------------------------------------------------------------
    def _decode_in(self, request_id: str) -> None:
        flow = self.flows[request_id]
        request, decode = flow.request, self.cluster.decode[flow.routed.decision.decode_id]
        if flow.prefill_job is None:
            return self._submit_local(flow, imported_blocks=0)
        flow.reservation = decode.reserve_remote(request.hashes, request.prompt_tokens, request.output_tokens)
        if flow.reservation is None:  # no room: D releases P's lease and prefills itself
            self._release_prefill(flow)
            flow.record.fell_back = True
            return self._submit_local(flow, imported_blocks=0)
        self.cluster.touched(decode.worker_id)
        missing = decode.blocks_for(request.prompt_tokens) - flow.reservation.cached
        source = flow.routed.decision.prefill_id
        num_bytes = missing * self.cluster.block_bytes
        seconds = self.cluster.link(source, decode.worker_id).transfer_s(num_bytes)
        flow.pull = (source, num_bytes, seconds, missing)
        self.events.after(seconds, Kind.PULL_DONE, request_id)

    def _lease_prefix(self, flow: Flow, source_id: str) -> None:
        """Local with an import: the holder pins its cached prefix (LeasePrefix), D pulls what it lacks of it."""
        decision, request = flow.routed.decision, flow.request
        bs, decode_id = self.config.shape.block_size, decision.decode_id
        holder = self.cluster.worker(source_id)
        pin = holder.pool.pin_prefix(request.hashes, (request.prompt_tokens - 1) // bs)
        if pin.cached * bs < decision.decode_cached_tokens + bs:  # evicted since the index said so: compute
            holder.pool.release(pin)
            return self.events.after(self.config.rpc_s, Kind.DECODE_IN, request.request_id)
        flow.source_pin = (source_id, pin)
        missing = pin.cached - decision.decode_cached_tokens // bs
        num_bytes = missing * self.cluster.block_bytes
        seconds = self.cluster.link(source_id, decode_id).transfer_s(num_bytes)
        flow.pull = (source_id, num_bytes, seconds, missing)
        self.events.after(2 * self.config.rpc_s + seconds, Kind.PULL_DONE, request.request_id)

    def _pull_done(self, request_id: str) -> None:
        flow = self.flows[request_id]
        source, num_bytes, seconds, blocks = flow.pull
        decode_id = flow.routed.decision.decode_id
        flow.record.kv_bytes += num_bytes
        if num_bytes:
            self.router.transfer(source, decode_id, num_bytes=num_bytes, transfer_ms=seconds * 1e3, num_blocks=blocks)
        if flow.source_pin is not None:  # a prefix import: D now computes the rest
            holder_id, pin = flow.source_pin
            self.cluster.worker(holder_id).pool.release(pin)
            flow.source_pin = None
            return self._submit_local(flow, imported_blocks=pin.cached)
        self._release_prefill(flow)
        decode, request = self.cluster.decode[decode_id], flow.request
        self._at(decode.join(request_id, flow.reservation, request.hashes, request.prompt_tokens,
                             request.output_tokens - 1, flow.prefill_job.finished_s, self.events.now_s),
                 Kind.DECODE_STEP, decode_id)
        self.cluster.touched(decode_id)
        self.router.decode_answered(flow.routed, local=False)

    def _submit_local(self, flow: Flow, *, imported_blocks: int) -> None:
        request, decode_id = flow.request, flow.routed.decision.decode_id
        decode = self.cluster.decode[decode_id]
        if not decode.fits(request.prompt_tokens + request.output_tokens):
            return self._refuse(flow, "request larger than a decode worker's KV pool")
        outputs = request.output_tokens - (flow.record.first_token_s is not None)  # a fallback's first came from P
        flow.local = LocalJob(request.request_id, request.hashes, request.prompt_tokens, max(outputs, 1),
                              self.events.now_s, imported_blocks=imported_blocks)
        if self.config.local_handoff_s > 0:  # D's servicer hands the prompt to its engine thread
            return self.events.after(self.config.local_handoff_s, Kind.LOCAL_IN, request.request_id)
        self._local_in(request.request_id)

    def _local_in(self, request_id: str) -> None:
        flow = self.flows[request_id]
        decode_id = flow.routed.decision.decode_id
        self._at(self.cluster.decode[decode_id].submit(flow.local, self.events.now_s), Kind.DECODE_STEP, decode_id)
        self.cluster.touched(decode_id)

    def _decode_step(self, worker_id: str, version: int) -> None:
        decode, now_s, rpc_s = self.cluster.decode[worker_id], self.events.now_s, self.config.rpc_s
        outcome, next_event = decode.on_step(now_s, version)
        self._at(next_event, Kind.DECODE_STEP, worker_id)
        self.cluster.touched(worker_id)
        for job, at_s in outcome.first_tokens:
            flow = self.flows[job.request_id]
            if flow.record.first_token_s is None:
                flow.record.first_token_s, flow.record.cached_tokens = self._seen(flow, at_s + rpc_s), job.cached_tokens
                flow.prefill_ms, flow.queue_ms = (at_s - job.arrived_s) * 1e3, (job.started_s - job.arrived_s) * 1e3
            else:  # a fallback: P streamed the first token, this is the second
                self.cluster.itl[round(self._seen(flow, at_s + rpc_s) - flow.record.first_token_s, 5)] += 1
            self.router.decode_answered(flow.routed, local=True)
        for request_id, at_s in outcome.finished:
            self._finish(self.flows[request_id], at_s + rpc_s)

    def _seen(self, flow: Flow, at_s: float) -> float:
        """When the client sees what the router relays at ``at_s``: later by the route kind's loaded hops."""
        local = flow.routed.decision.kind is RouteKind.LOCAL
        return at_s + (self.config.local_return_s if local else self.config.remote_return_s)

    def _finish(self, flow: Flow, at_s: float) -> None:
        self._ended()
        record = flow.record
        at_s = record.finished_s = self._seen(flow, at_s)
        decode_s = at_s - record.first_token_s
        tokens_per_s = (record.output_tokens - 1) / decode_s if record.output_tokens > 1 and decode_s > 0 else 0.0
        self.router.finished(flow.routed, ttft_s=record.ttft_s, prefill_ms=flow.prefill_ms, queue_ms=flow.queue_ms,
                             cached_tokens=record.cached_tokens, decode_tokens_per_s=tokens_per_s,
                             same_route=not record.fell_back)

    def _at(self, event: float | tuple[float, int] | None, kind: Kind, worker_id: str) -> None:
        if event is None:
            return
        at_s, version = event if isinstance(event, tuple) else (event, 0)
        self.events.at(at_s, kind, worker_id, version)


def _decision_ms(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    ordered = sorted(samples)
    pick = lambda q: ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1e3  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "mean": sum(samples) / len(samples) * 1e3, "count": len(samples)}


def simulate(config: ClusterConfig, requests: Sequence[SimRequest], slo: Slo = Slo(), *,
             max_events: int | None = None) -> SimResult:
    return Simulation(config, requests, slo, max_events=max_events).run()
