"""Proto conversion for ``router.admin.servicer`` (shell helpers: core objects in, ``baton.v1`` messages out)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from kv_transfer.workers import WorkerInfo, WorkerLoad
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from proto.tls import TlsConfig, aio_channel
from router.admin import planner
from router.admin.traffic import Percentiles, Window

log = logging.getLogger(__name__)


def curve_dict(curve: pb.PrefillCurve | pb.DecodeCurve) -> dict[str, Any]:
    if isinstance(curve, pb.PrefillCurve):
        return {"prompt_lens": list(curve.prompt_lens), "tokens_per_s": list(curve.tokens_per_s)}
    kv = curve.kv_tokens_per_worker if curve.HasField("kv_tokens_per_worker") else None
    return {"batch_sizes": list(curve.batch_sizes), "itl_ms": list(curve.itl_ms), "kv_tokens_per_worker": kv,
            "context_lens": list(curve.context_lens), "itl_ms_grid": list(curve.itl_ms_grid)}


def worker_to_proto(info: WorkerInfo, load: WorkerLoad | None, draining: bool, now_ms: int,
                    prefix_hit_rate: float | None = None, transfer_gbps: float | None = None, *,
                    restarts: int = 0) -> pb.AdminWorker:
    worker = pb.AdminWorker(
        worker_id=info.worker_id, role=info.role, grpc_address=info.grpc_address, kv_uri=info.kv_uri,
        state=pb.WORKER_STATE_DRAINING if draining else pb.WORKER_STATE_UP, num_total_blocks=info.total_blocks,
        restarts=restarts,
    )
    if load is not None:
        worker.has_load, worker.num_running, worker.num_waiting = True, load.running, load.waiting
        worker.num_free_blocks, worker.queued_prefill_tokens = load.free_blocks, load.queued_prefill_tokens
        if info.total_blocks > 0:
            worker.kv_cache_usage = 1.0 - load.free_blocks / info.total_blocks
        if load.reported_unix_ms is not None:
            worker.load_age_ms = max(0, now_ms - load.reported_unix_ms)
    if prefix_hit_rate is not None:
        worker.prefix_cache_hit_rate = prefix_hit_rate
    if transfer_gbps is not None:
        worker.transfer_gbps = transfer_gbps
    return worker


async def worker_rates(workers: list[WorkerInfo], timeout_s: float,
                       tls: TlsConfig | None = None) -> dict[str, tuple[float | None, float | None]]:
    """Each worker's (prefix-cache hit rate, KV pull GB/s) since it started, from its ``Stats`` (concurrent,
    short deadline), called over TLS with ``tls`` as the router calls the workers. A worker that does not
    answer in time (or refuses the connection) is left out."""
    async def one(info: WorkerInfo) -> tuple[str, tuple[float | None, float | None] | None]:
        try:
            async with aio_channel(info.grpc_address, tls) as channel:
                stats = await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            log.debug("Stats of worker_id=%s failed: %r", info.worker_id, exc)
            return info.worker_id, None
        queries, seconds = stats.prefix_cache_queries, stats.kv_transfer_seconds
        hit = stats.prefix_cache_hits / queries if queries > 0 else None
        gbps = stats.kv_transfer_bytes / seconds / 1e9 if seconds > 0 else None
        return info.worker_id, (hit, gbps)

    pairs = await asyncio.gather(*(one(info) for info in workers))
    return {worker_id: rates for worker_id, rates in pairs if rates is not None}


def window_to_proto(window: Window) -> pb.TrafficWindow:
    out = pb.TrafficWindow(window_s=window.span_s, num_requests=window.num_requests, rate=window.rate_per_s,
                           mean_isl=window.mean_isl or 0.0, mean_osl=window.mean_osl or 0.0)
    for name in ("ttft", "itl"):
        if (p := getattr(window, name)) is not None:
            getattr(out, name).CopyFrom(_percentiles(p))
    return out


def _percentiles(p: Percentiles) -> pb.LatencyPercentiles:
    return pb.LatencyPercentiles(count=p.count, p50_ms=p.p50_s * 1e3, p90_ms=p.p90_s * 1e3, p99_ms=p.p99_s * 1e3)


def traffic_terms(window: Window) -> list[planner.Term]:
    """The observed traffic, as plan terms (pool ``traffic``)."""
    terms = [planner.Term(pool="traffic", name="window", value=window.span_s, unit="s",
                          note=f"{window.num_requests} finished requests"),
             planner.Term(pool="traffic", name="rate", value=window.rate_per_s, unit="req/s",
                          note="observed" if window.num_arrived is None else
                          f"{window.num_arrived} requests arrived (finished ones understate an overload)"),
             planner.Term(pool="traffic", name="mean isl", value=window.mean_isl or 0.0, unit="tokens"),
             planner.Term(pool="traffic", name="mean osl", value=window.mean_osl or 0.0, unit="tokens")]
    if window.remote is not None and window.num_remote is not None:
        terms.append(planner.Term(pool="traffic", name="remote prefills", value=window.num_remote, unit="requests",
                                  note=f"{window.remote.rate_per_s:.3g} req/s, mean isl {window.remote.mean_isl:.0f}, "
                                  f"{window.remote.cached_fraction:.1%} of their prompt tokens cached on P"))
    for name, p in (("TTFT", window.ttft), ("ITL", window.itl)):
        if p is not None:
            terms.append(planner.Term(pool="traffic", name=f"measured {name} p90", value=p.p90_s * 1e3, unit="ms",
                                      note=f"p50 {p.p50_s * 1e3:.3g} ms, p99 {p.p99_s * 1e3:.3g} ms, n = {p.count}"))
    return terms


def plan_to_proto(plan: planner.Plan, *, applied: bool, extra_terms: list[planner.Term] = (),
                  window: Window | None = None) -> pb.PlanResponse:
    terms = [pb.PlanTerm(pool=t.pool, name=t.name, value=t.value, unit=t.unit, note=t.note)
             for t in (*extra_terms, *plan.terms)]
    extra = "".join(f"{t.pool:<8} {t.name:<28} = {t.value:.4g} {t.unit}" + (f"  ({t.note})" if t.note else "") + "\n"
                    for t in extra_terms)
    response = pb.PlanResponse(prefill=plan.prefill, decode=plan.decode, prefill_raw=plan.prefill_plan.raw,
                               decode_raw=plan.decode_plan.raw, feasible=plan.feasible, terms=terms,
                               reasoning=extra + plan.explain(), applied=applied)
    if window is not None:
        response.traffic.CopyFrom(window_to_proto(window))
    return response
