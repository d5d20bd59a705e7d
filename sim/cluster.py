"""The modelled cluster: prefill and decode workers on hosts, the links between them, the router, and the upkeep
that connects them as Redis does: heartbeats (each worker's load, every ``heartbeat_s``, on its own phase) and
block events (each worker's stored/removed hashes reach the router's index ``publish_s`` after they happen).

Only workers whose state changed are visited: an idle worker's last report stands until it changes, so an hour of
1,000 mostly idle workers costs nothing. Links: two workers on one host talk over ``intra_link`` (NVLink), others
over ``inter_link`` (RDMA or TCP); ``placement`` puts the pools on separate hosts (``split``) or interleaves
them (``mixed``). A pull takes ``latency + bytes / bandwidth``; links are not shared (no contention modelled).
``cores_per_host`` makes the workers of a host share its compute (``sim/contention.py``: the CPU cores of the
calibration machine); ``router_s`` is the router's own time per request before its first call (with the client's
hops: measured by ``baton simulate check``, where Python routers and clients share the cores; 0 on a data-center
router, whose hops are ``rpc_s``), plus ``router_per_stream_s`` for every request in flight when it is sent (the
router and the client relay every token of every stream on one event loop each: measured there too).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from engine.core.block_pool import BlockEventKind
from kv_transfer.workers import WorkerInfo
from router.routing.policy import PolicyConfig
from sim.contention import SharedCores, SharedTimeModel
from sim.decode_worker import DecodeWorker
from sim.events import EventQueue, Kind
from sim.hardware import LINKS, LinkSpec, WorkerShape, workers_per_host
from sim.kv_pool import KVPool
from sim.prefill_worker import PrefillWorker
from sim.router import SimRouter
from sim.self_report import SelfReport
from sim.timing import Chunk, Efficiency, Roofline, TimeModel

PLACEMENTS = ("split", "mixed")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    shape: WorkerShape
    num_prefill: int
    num_decode: int
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    efficiency: Efficiency = field(default_factory=Efficiency)
    time_model: TimeModel | None = None  # None: the roofline of ``shape`` with ``efficiency``
    intra_link: LinkSpec = LINKS["nvlink"]
    inter_link: LinkSpec = LINKS["rdma"]
    gpus_per_host: int = 8
    placement: str = "split"
    heartbeat_s: float = 2.0
    publish_s: float = 0.25
    rpc_s: float = 0.0005  # one gRPC hop inside a data center
    router_s: float = 0.0  # the router's own time per request, from the client's send to its first call
    router_per_stream_s: float = 0.0  # ... and more per request in flight (streams the router and client relay)
    # the host whose cores the router and the client share with its workers (with ``cores_per_host``): ``router_s``
    # stretches as a step does with the workers busy when a request is sent; None: a router with a machine of its own
    router_host: int | None = None
    # Loaded hops (measured by ``baton simulate check`` on a training replay, 0 elsewhere): how much later than
    # ``router_s`` and the hops the client sees a request's tokens, per route kind (the hops' wake-ups wait for a
    # core while compute holds them), and how long D's servicer takes to hand a local prompt to its engine thread
    local_return_s: float = 0.0
    remote_return_s: float = 0.0
    local_handoff_s: float = 0.0
    cores_per_host: int | None = None  # workers of a host share this many compute units (None: a device each)
    background_load: float = 0.0  # runnable processes beside the workers on those cores (with cores_per_host)
    prefill_step_tokens: int = 8192  # P's token budget per step
    decode_chunk_tokens: int = 512  # prompt tokens a local prefill adds to one of D's steps
    max_segment_steps: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"need >= 0 prefill and >= 1 decode workers, got {self.num_prefill}, {self.num_decode}")
        if (self.cores_per_host is not None and self.cores_per_host < 1) or self.background_load < 0:
            raise ValueError(f"cores_per_host must be >= 1 or None and background_load >= 0: {self}")
        if self.router_host is not None and self.cores_per_host is None:
            raise ValueError("router_host needs cores_per_host (the cores the router shares)")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        delays = (self.rpc_s, self.router_s, self.router_per_stream_s, self.local_return_s, self.remote_return_s,
                  self.local_handoff_s)
        if min(self.heartbeat_s, self.publish_s, self.prefill_step_tokens, self.decode_chunk_tokens,
               self.max_segment_steps) <= 0 or min(delays) < 0:
            raise ValueError(f"ClusterConfig: periods, budgets and max_segment_steps must be > 0, delays >= 0: "
                             f"{self}")

    @property
    def num_gpus(self) -> int:
        return (self.num_prefill + self.num_decode) * self.shape.tp

    def build_time_model(self) -> TimeModel:
        if self.time_model is not None:
            return self.time_model
        layout = self.shape.layout
        return Roofline(self.shape.gpu, self.shape.model, tp=self.shape.tp, efficiency=self.efficiency,
                        kv_bytes_per_token=layout.bytes_per_block / layout.block_size)


class Cluster:
    def __init__(self, config: ClusterConfig, events: EventQueue) -> None:
        self.config, self.events = config, events
        self.time_model = config.build_time_model()
        self.block_bytes = config.shape.layout.bytes_per_block
        ids = [f"p{i}" for i in range(config.num_prefill)] + [f"d{i}" for i in range(config.num_decode)]
        self.host = self._place(ids)
        self.shared = (None if config.cores_per_host is None else
                       SharedCores(config.cores_per_host, self.host, lambda w: self.worker(w).busy,
                                   background=config.background_load))
        self.itl: Counter[float] = Counter()  # inter-token gaps (s, rounded to 10 us) -> tokens
        self.prefill = {w: self._prefill_worker(w) for w in ids if w.startswith("p")}
        self.decode = {w: self._decode_worker(w) for w in ids if w.startswith("d")}
        self.router = SimRouter(config.policy, [self._info(w) for w in ids], clock=events.clock, seed=config.seed)
        self._rng = random.Random(config.seed)
        self._phase = {w: self._rng.uniform(0, config.heartbeat_s) for w in ids}
        self._beat_due: set[str] = set()
        self._publish_due: set[str] = set()
        for w in ids:  # registration: each worker's first load, with its start-up calibration
            self.router.report(w, self.worker(w).load())
        self._next = {"prefill": config.num_prefill, "decode": config.num_decode}  # ids are never reused
        self.draining: set[str] = set()
        self.retired: list[PrefillWorker | DecodeWorker] = []
        self.lifetimes: dict[str, list[float | None]] = {w: [0.0, None] for w in ids}  # [provisioned, retired] s

    # ---- building ------------------------------------------------------------------------------
    def _place(self, ids: list[str]) -> dict[str, int]:
        per_host = workers_per_host(self.config.gpus_per_host, self.config.shape.tp)
        order = ids
        if self.config.placement == "mixed":  # p0 d0 p1 d1 ...: each host holds both roles
            ps, ds = [w for w in ids if w[0] == "p"], [w for w in ids if w[0] == "d"]
            order = [w for pair in zip(ps, ds) for w in pair] + ps[len(ds):] + ds[len(ps):]
        elif self.config.num_prefill:  # split: decode workers start on a fresh host
            gap = -len([w for w in ids if w[0] == "p"]) % per_host
            order = [w for w in ids if w[0] == "p"] + [""] * gap + [w for w in ids if w[0] == "d"]
        return {w: i // per_host for i, w in enumerate(order) if w}

    def _report(self) -> SelfReport:
        report = SelfReport()  # Engine.calibrate: one 256-token prefill, one decode step at batch 1
        report.seed(256 / self.time_model.step_s(0, 0, [Chunk(256, 0)]), self.time_model.step_s(1, 256))
        return report

    def _time_model(self, worker_id: str) -> TimeModel:
        return self.time_model if self.shared is None else SharedTimeModel(self.time_model, self.shared, worker_id)

    def _prefill_worker(self, worker_id: str) -> PrefillWorker:
        return PrefillWorker(worker_id, KVPool(self.config.shape.num_blocks), block_size=self.config.shape.block_size,
                             time_model=self._time_model(worker_id), step_tokens=self.config.prefill_step_tokens,
                             report=self._report())

    def _decode_worker(self, worker_id: str) -> DecodeWorker:
        return DecodeWorker(worker_id, KVPool(self.config.shape.num_blocks), block_size=self.config.shape.block_size,
                            time_model=self._time_model(worker_id), chunk_tokens=self.config.decode_chunk_tokens,
                            report=self._report(), itl=self.itl, max_segment_steps=self.config.max_segment_steps)

    def _info(self, worker_id: str) -> WorkerInfo:
        shape = self.config.shape
        return WorkerInfo(worker_id=worker_id, role="prefill" if worker_id[0] == "p" else "decode",
                          grpc_address=f"host{self.host[worker_id]}:{worker_id}",
                          kv_uri=f"sim://host{self.host[worker_id]}/{worker_id}",
                          model_fingerprint=shape.model.fingerprint.hex(), layout_json=shape.layout.to_json(),
                          total_blocks=shape.num_blocks)

    # ---- queries -------------------------------------------------------------------------------
    def worker(self, worker_id: str) -> PrefillWorker | DecodeWorker:
        return self.prefill[worker_id] if worker_id[0] == "p" else self.decode[worker_id]

    def workers(self) -> list[PrefillWorker | DecodeWorker]:
        return [*self.prefill.values(), *self.decode.values()]

    def link(self, a: str, b: str) -> LinkSpec:
        return self.config.intra_link if self.host[a] == self.host[b] else self.config.inter_link

    def busy_gpu_s(self) -> float:
        return sum(w.busy_s for w in [*self.workers(), *self.retired]) * self.config.shape.tp

    def provisioned_gpu_s(self, start_s: float, end_s: float) -> float:
        """GPU-seconds of every worker that was provisioned (asked for, starting included) within the span."""
        total = sum(max(min(end_s, stop if stop is not None else end_s) - max(start_s, begin), 0.0)
                    for begin, stop in self.lifetimes.values())
        return total * self.config.shape.tp

    # ---- membership: pools the planner resizes (sim/elastic.py) --------------------------------
    def add_worker(self, role: str, provisioned_s: float) -> str:
        """A new worker registers now, with an empty pool (asked for at ``provisioned_s``); its id."""
        worker_id = f"{role[0]}{self._next[role]}"
        self._next[role] += 1
        self.host[worker_id] = self._free_host(role)
        if role == "prefill":
            self.prefill[worker_id] = self._prefill_worker(worker_id)
        else:
            self.decode[worker_id] = self._decode_worker(worker_id)
        self._phase[worker_id] = self._rng.uniform(0, self.config.heartbeat_s)
        self.lifetimes[worker_id] = [provisioned_s, None]
        self.router.add(self._info(worker_id), self.worker(worker_id).load())
        return worker_id

    def drain(self, worker_id: str) -> None:
        """No new requests for the worker; it leaves once idle (``retire_idle``)."""
        self.draining.add(worker_id)
        self.router.drain(worker_id)

    def retire_idle(self) -> None:
        for worker_id in [w for w in self.draining if self.worker(w).idle and self.router.idle(w)]:
            worker = self.worker(worker_id)
            worker.pool.check_drained()
            (self.prefill if worker_id[0] == "p" else self.decode).pop(worker_id)
            self.retired.append(worker)
            self.draining.discard(worker_id)
            self.router.remove(worker_id)
            self.lifetimes[worker_id][1] = self.events.now_s
            del self.host[worker_id]

    def _free_host(self, role: str) -> int:
        """The first host with room for one more worker (of this role's hosts, when the pools are split)."""
        per_host = workers_per_host(self.config.gpus_per_host, self.config.shape.tp)
        held: dict[int, list[str]] = {}
        for w, h in self.host.items():
            held.setdefault(h, []).append(w)
        for h in sorted(held):
            if len(held[h]) < per_host and (self.config.placement == "mixed" or held[h][0][0] == role[0]):
                return h
        return max(held, default=-1) + 1

    # ---- upkeep: heartbeats and block events ---------------------------------------------------
    def touched(self, worker_id: str) -> None:
        """The worker's state changed: its next heartbeat reports it, its block events get published."""
        now, period = self.events.now_s, self.config.heartbeat_s
        if worker_id not in self._beat_due:
            phase = self._phase[worker_id]
            self.events.at(phase + max(math.ceil((now - phase) / period), 0) * period, Kind.HEARTBEAT, worker_id)
            self._beat_due.add(worker_id)
        if worker_id not in self._publish_due:
            self.events.after(self.config.publish_s, Kind.PUBLISH, worker_id)
            self._publish_due.add(worker_id)

    def heartbeat(self, worker_id: str) -> None:
        self._beat_due.discard(worker_id)
        if worker_id not in self.host:  # retired
            return
        self.router.report(worker_id, self.worker(worker_id).load())

    def publish(self, worker_id: str) -> None:
        self._publish_due.discard(worker_id)
        if worker_id not in self.host:  # retired: the registry dropped its entries
            return
        index = self.router.index
        for event in self.worker(worker_id).pool.take_events():
            if event.kind is BlockEventKind.STORED:
                index.store(worker_id, (event.block_hash,))
            else:
                index.remove(worker_id, (event.block_hash,))

    def check_drained(self) -> None:
        """Every pool balanced and empty, the index equal to what the pools cache, the router's books empty."""
        for w in self.workers():
            w.pool.check_drained()
            self.publish(w.worker_id)
            held = set(self.router.index.held(w.worker_id))
            assert held == set(w.pool.blocks.cached_hashes()), f"index out of step with {w.worker_id}'s pool"
        assert self.router.books_empty(), "the router still counts requests in flight"
