"""Pools resized by Baton's own planner while the trace runs (``baton simulate pools``; issue 23, item 3).

Every ``interval_s`` the planner runs as the router's ``Admin/Plan(from_traffic, apply)`` runs it: the traffic of
the last ``window_s`` (the requests that finished in it: rate, mean prompt and output lengths, TTFT and ITL
percentiles; and the prefill pool's own: the requests a prefill worker answered in it, their prompts and cached
tokens; ``router.admin.traffic`` reads the same from the router's histograms), the measured corrections
(``traffic.corrections``, the real function), then ``plan_pools`` with the pools' state (the desired sizes and
when they last changed) for its hysteresis and cool-downs, and the queue model of the simulated policy
(``router.admin.queueing.dispatch_of``, as the router's servicer takes its own). No finished request in the window:
no plan (the servicer refuses one). The desired sizes are reconciled as ``baton up``'s pool manager does: a new
worker registers ``startup_s`` after it is asked for (model load) and costs GPU-seconds from the ask; a pool that shrinks drains
its newest workers (no new requests, gone once idle), cancelling a worker still starting first.

One approximation, said here: the ITL percentiles are those of the finished requests' mean token gaps (TPOT), not
of every gap (the simulator keeps gaps in one histogram for the whole run). Pure.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from workload.stats import percentile
from router.admin import traffic as traffic_mod
from router.admin.planner import DecodeProfile, PlannerConfig, PoolState, PrefillProfile, plan_pools
from router.admin.planner import Slo as PlannerSlo
from router.admin.queueing import dispatch_of
from router.metrics import TOKEN_BUCKETS
from sim.cluster import Cluster, ClusterConfig
from sim.events import Kind
from sim.metrics import RequestRecord, Slo
from sim.simulation import SimResult, Simulation
from sim.workload import SimRequest

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticConfig:
    interval_s: float = 60.0  # how often the planner runs
    window_s: float = 300.0  # the traffic it reads (the Admin servicer's default window)
    startup_s: float = 60.0  # from the ask to a registered worker (an 8B model's load on an H200, order of)
    planner: PlannerConfig = field(default_factory=lambda: PlannerConfig(max_workers=512))

    def __post_init__(self) -> None:
        if min(self.interval_s, self.window_s) <= 0 or self.startup_s < 0:
            raise ValueError(f"ElasticConfig: interval_s, window_s > 0 and startup_s >= 0: {self}")


def window_of(records: Sequence[RequestRecord], now_s: float, window_s: float) -> traffic_mod.Window:
    """What ``TrafficRecorder.window`` would report at ``now_s``: the requests that finished in the window (means,
    percentiles), the rate of those that arrived in it, and the prefill pool's traffic: the requests routed remote
    whose first token (P's answer, where the relay observes it) came in the window, with P's cached tokens."""
    span_s = max(min(window_s, now_s), 1e-9)
    done = [r for r in records if r.finished_s is not None and now_s - span_s < r.finished_s <= now_s]
    arrived = sum(1 for r in records if now_s - span_s < r.arrival_s <= now_s)
    n = len(done)
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    lengths = [float(r.prompt_tokens) for r in done]
    window = traffic_mod.Window(
        span_s=span_s, num_requests=n, rate_per_s=arrived / span_s, num_arrived=arrived,
        mean_isl=sum(lengths) / n if n else None,
        mean_osl=sum(r.output_tokens for r in done) / n if n else None,
        ttft=_percentiles(ttfts, len(ttfts)), itl=_itl(done, tpots),
        isl_mix=traffic_mod.isl_mix_of(traffic_mod.histogram_of(lengths, TOKEN_BUCKETS)))
    remote = [r for r in records if r.route_kind == "remote" and r.first_token_s is not None
              and now_s - span_s < r.first_token_s <= now_s]
    prompts = traffic_mod.histogram_of([float(r.prompt_tokens) for r in remote], TOKEN_BUCKETS)
    return traffic_mod.with_remote(window, prompts, float(sum(r.cached_tokens for r in remote)))


def _percentiles(values: list[float], count: int, mean_s: float | None = None) -> traffic_mod.Percentiles | None:
    if not values:
        return None
    return traffic_mod.Percentiles(count=count, p50_s=percentile(values, 50), p90_s=percentile(values, 90),
                                   p99_s=percentile(values, 99), mean_s=mean_s)


def _itl(done: list[RequestRecord], tpots: list[float]) -> traffic_mod.Percentiles | None:
    """Percentiles of the requests' mean gaps; the mean over every gap (the histogram's sum / count)."""
    gaps = sum(r.output_tokens - 1 for r in done if r.tpot_s is not None)
    spans = sum(r.finished_s - r.first_token_s for r in done if r.tpot_s is not None)
    return _percentiles(tpots, gaps, spans / gaps if gaps else None)


class PoolPlanner:
    """The planner's loop and the pool manager's reconciliation over one simulated cluster."""

    def __init__(self, config: ElasticConfig, slo: Slo, profiles: tuple[PrefillProfile, DecodeProfile],
                 cluster: Cluster, records: Sequence[RequestRecord]) -> None:
        self.config, self.cluster, self.records = config, cluster, records
        self.slo = PlannerSlo(ttft_p90_s=slo.ttft_s, itl_p90_s=slo.tpot_s)
        self.prefill, self.decode = profiles
        self.dispatch = dispatch_of(cluster.config.policy.policy)
        self.desired = {"prefill": cluster.config.num_prefill, "decode": cluster.config.num_decode}
        self.starting: dict[str, dict[str, float]] = {role: {} for role in ROLES}  # token -> asked at
        self.last_change_s: float | None = None
        self.history: list[dict] = []
        self._tokens = itertools.count()

    def live(self, role: str) -> list[str]:
        """Registered workers of the role that take requests, oldest first."""
        pool = self.cluster.prefill if role == "prefill" else self.cluster.decode
        return sorted((w for w in pool if w not in self.cluster.draining), key=lambda w: int(w[1:]))

    def tick(self, now_s: float) -> list[str]:
        """Plan and reconcile; the ``role:token`` of each worker asked for now (it registers ``startup_s`` on)."""
        window = window_of(self.records, now_s, self.config.window_s)
        entry = {"t_s": now_s, "window_requests": window.num_requests, "rate_per_s": window.rate_per_s}
        if window.num_requests and window.mean_isl and window.mean_osl:
            traffic = traffic_mod.traffic_of(window)  # as the servicer does
            corrections, _ = traffic_mod.corrections(window, self.prefill, self.decode,
                                                     prefill_workers=len(self.live("prefill")),
                                                     decode_workers=len(self.live("decode")), dispatch=self.dispatch)
            state = PoolState(prefill=self.desired["prefill"], decode=self.desired["decode"],
                              last_change_s=self.last_change_s)
            plan = plan_pools(self.slo, traffic, self.prefill, self.decode, corrections=corrections,
                              config=self.config.planner, state=state, now_s=now_s, dispatch=self.dispatch)
            remote = traffic.prefill_side()
            entry.update(mean_isl=traffic.mean_isl, mean_osl=traffic.mean_osl, prefill_rate_per_s=remote.rate_per_s,
                         cached_fraction=remote.cached_fraction,
                         raw={"prefill": plan.prefill_plan.raw, "decode": plan.decode_plan.raw},
                         corrections={"prefill": corrections.prefill, "decode": corrections.decode})
            sizes = {"prefill": plan.prefill, "decode": plan.decode}
            if sizes != self.desired:
                self.desired, self.last_change_s = sizes, now_s
        asked = [ask for role in ROLES for ask in self._reconcile(role, now_s)]
        entry.update(desired=dict(self.desired), live={role: len(self.live(role)) for role in ROLES})
        self.history.append(entry)
        return asked

    def worker_up(self, ask: str, now_s: float) -> str | None:
        """A worker asked for has started (None: it was cancelled meanwhile); its id."""
        role, token = ask.split(":")
        asked_s = self.starting[role].pop(token, None)
        return None if asked_s is None else self.cluster.add_worker(role, asked_s)

    def _reconcile(self, role: str, now_s: float) -> list[str]:
        live, starting = self.live(role), self.starting[role]
        gap = self.desired[role] - len(live) - len(starting)
        asks = []
        for _ in range(max(gap, 0)):
            token = str(next(self._tokens))
            starting[token] = now_s
            asks.append(f"{role}:{token}")
        for _ in range(max(-gap, 0)):
            if starting:  # cancel the newest start: it cost GPU-seconds from its ask until now
                token = max(starting, key=starting.__getitem__)
                self.cluster.lifetimes[f"cancelled-{role}-{token}"] = [starting.pop(token), now_s]
            else:
                self.cluster.drain(live.pop())
        return asks


class ElasticSimulation(Simulation):
    """A run whose pools the planner resizes every ``interval_s`` (its first pools: the config's)."""

    def __init__(self, config: ClusterConfig, requests: Sequence[SimRequest], slo: Slo, elastic: ElasticConfig, *,
                 profiles: tuple[PrefillProfile, DecodeProfile], max_events: int | None = None) -> None:
        if config.cores_per_host is not None:
            raise ValueError("a planner-driven run models devices, not shared cores")
        super().__init__(config, requests, slo, max_events=max_events)
        self.elastic = elastic
        self.planner = PoolPlanner(elastic, slo, profiles, self.cluster, self.records)
        self._handlers[Kind.PLAN] = self._plan
        self._handlers[Kind.WORKER_UP] = self._worker_up
        self.events.at(elastic.interval_s, Kind.PLAN, "")

    def _plan(self, _target: str) -> None:
        for ask in self.planner.tick(self.events.now_s):
            self.events.after(self.elastic.startup_s, Kind.WORKER_UP, ask)
        if any(r.finished_s is None and not r.refused for r in self.records):
            self.events.after(self.elastic.interval_s, Kind.PLAN, "")

    def _worker_up(self, ask: str) -> None:
        worker_id = self.planner.worker_up(ask, self.events.now_s)
        if worker_id is not None:
            self.cluster.touched(worker_id)

    def _after_event(self) -> None:
        if self.cluster.draining:
            self.cluster.retire_idle()

    def _summary(self) -> dict:
        """GPU-seconds of the workers as they came and went, not of the first pools over the whole span."""
        summary = super()._summary()
        start = min((r.arrival_s for r in self.records), default=0.0)
        span_s = summary["span_s"]
        provisioned = self.cluster.provisioned_gpu_s(start, start + span_s)
        good = summary["good_rps"]
        summary["gpu_seconds"]["provisioned"] = provisioned
        summary["goodput_per_gpu"] = good / max(provisioned / span_s, 1e-9)
        return summary

    def run(self) -> SimResult:
        result = super().run()
        result.plan_history = self.planner.history
        return result
