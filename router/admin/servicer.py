"""``baton.v1.Admin`` on the router: workers and pools from the Redis registry, scale, drain, plan.

A thin shell (STYLE.md rule 1): the registry holds the state, ``router.admin.planner`` does the math. When an
admin token is configured every call must carry ``authorization: Bearer <token>``; otherwise it is refused
with UNAUTHENTICATED before anything is read or changed.

Profiles for ``Plan`` come with the request, or from ``{ns}:profile:prefill`` / ``{ns}:profile:decode``
(JSON, written by ``StoreProfile`` after ``baton admin profile``: ``{"prompt_lens": [...], "tokens_per_s": [...]}``
and ``{"batch_sizes": [...], "itl_ms": [...], "kv_tokens_per_worker": N, "context_lens": [...],
"itl_ms_grid": [...]}``; with a grid, the ITLs at the plan's mean context ``isl + osl / 2`` are used).
``Plan(from_traffic)`` and ``GetTraffic`` read the router's own request histograms (``router.admin.traffic``).
The router's routing policy decides the prefill pool's queue model (``router.admin.queueing.dispatch_of``).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from typing import Any

import grpc

from engine.errors import InvalidRequest
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVLayout
from kv_transfer.registry import Registry
from kv_transfer.workers import ROLES
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from proto.tls import TlsConfig
from router.admin import planner, traffic as traffic_mod
from router.admin.calibrated import Calibrated, from_calibration
from router.admin.convert import (curve_dict, plan_to_proto, traffic_terms, worker_rates, window_to_proto,
                                  worker_to_proto)
from router.admin.queueing import dispatch_of

log = logging.getLogger(__name__)

ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name
DEFAULT_WINDOW_S = 300.0


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, registry: Registry, redis: Any, *, token: str | None = None,
                 planner_config: planner.PlannerConfig = planner.PlannerConfig(), metrics_registry: Any = None,
                 stats_timeout_s: float = 0.5, tls: TlsConfig | None = None, policy: str = "cost") -> None:
        self._registry, self._redis = registry, redis
        self._dispatch = dispatch_of(policy)  # how this router's policy feeds the prefill pool
        self._tls = tls  # how the router calls the workers (their Stats for ListWorkers)
        self._token = token or None
        self._planner_config = planner_config
        self._last_change_s: float | None = None  # monotonic; the planner's cool-down clock
        self._traffic = None if metrics_registry is None else traffic_mod.TrafficRecorder(
            metrics_registry, time.monotonic())
        self._stats_timeout_s = stats_timeout_s

    async def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        draining, now_ms = await self._registry.list_draining(), int(time.time() * 1000)
        listed = await self._registry.list_workers()
        rates = await worker_rates([info for info, _ in listed], self._stats_timeout_s, self._tls)
        restarts = await self._redis.hgetall(self._registry.keys.restarts)  # kept by `baton up`'s supervisor
        workers = [worker_to_proto(info, load, info.worker_id in draining, now_ms,
                                   *rates.get(info.worker_id, (None, None)),
                                   restarts=_count(restarts, info.worker_id))
                   for info, load in listed]
        return pb.ListWorkersResponse(workers=workers)

    async def GetPools(self, request: pb.GetPoolsRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        return pb.GetPoolsResponse(pools=[await self._pool(role) for role in ROLES])

    async def ScalePool(self, request: pb.ScalePoolRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        if request.role not in ROLES:
            raise InvalidRequest(f"role must be one of {', '.join(ROLES)}, got {request.role!r}")
        if request.size < 1:
            raise InvalidRequest(f"size must be >= 1, got {request.size}")
        previous = await self._registry.get_desired_pool_size(request.role)  # type: ignore[arg-type]
        await self._set_desired(request.role, request.size)
        response = pb.ScalePoolResponse(pool=await self._pool(request.role))
        if previous is not None:
            response.previous_desired = previous
        return response

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        live = {info.worker_id for info, _ in await self._registry.list_workers()}
        if request.worker_id not in live:
            raise InvalidRequest(f"worker_id {request.worker_id!r} is not a live registered worker")
        changed = request.worker_id not in await self._registry.list_draining()
        await self._registry.add_draining(request.worker_id)
        log.info("admin: drain worker_id=%s (changed %s)", request.worker_id, changed)
        return pb.DrainResponse(changed=changed)

    async def Undrain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        changed = request.worker_id in await self._registry.list_draining()
        await self._registry.remove_draining(request.worker_id)
        log.info("admin: undrain worker_id=%s (changed %s)", request.worker_id, changed)
        return pb.DrainResponse(changed=changed)

    async def Plan(self, request: pb.PlanRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        window = self._window(request.traffic_window_s) if request.from_traffic else None
        traffic = _traffic(request, window)
        prefill, decode, profile_terms = await self._profiles(request, traffic.mean_isl + traffic.mean_osl / 2)
        corrections, extra = _corrections(request), []
        if window is not None:
            live = [info.role for info, _ in await self._registry.list_workers()]
            measured, extra = traffic_mod.corrections(window, prefill, decode, prefill_workers=live.count("prefill"),
                                                      decode_workers=live.count("decode"), dispatch=self._dispatch)
            given = request.HasField("decode_correction")  # an operator's decode correction stands for both
            corrections = planner.Corrections(
                prefill=corrections.prefill if request.HasField("prefill_correction") else measured.prefill,
                decode=corrections.decode if given else measured.decode,
                decode_mean=None if given else measured.decode_mean)
            extra = traffic_terms(window) + extra
        state = planner.PoolState(prefill=await self._current("prefill"), decode=await self._current("decode"),
                                  last_change_s=self._last_change_s)
        plan = planner.plan_pools(
            planner.Slo(ttft_p90_s=request.ttft_p90_ms / 1e3, itl_p90_s=request.itl_p90_ms / 1e3), traffic,
            prefill, decode, corrections=corrections, config=self._planner_config, state=state, now_s=time.monotonic(),
            dispatch=self._dispatch,
        )
        if request.apply:
            for role, size in (("prefill", plan.prefill), ("decode", plan.decode)):
                if size != await self._registry.get_desired_pool_size(role):  # type: ignore[arg-type]
                    await self._set_desired(role, size)
        return plan_to_proto(plan, applied=request.apply, extra_terms=[*profile_terms, *extra], window=window)

    async def StoreProfile(self, request: pb.StoreProfileRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        curves = [(role, request.HasField(field), getattr(request, field))
                  for role, field in (("prefill", "prefill_curve"), ("decode", "decode_curve"))]
        stored = {role: dict(curve_dict(curve), measured_on=request.measured_on, stored_unix_s=int(time.time()))
                  for role, present, curve in curves if present}
        if not stored:
            raise InvalidRequest("StoreProfile needs a prefill_curve, a decode_curve or both")
        for role, raw in stored.items():
            _parse_profile(role, raw)  # refuse a malformed curve before anything is written
        for role, raw in stored.items():
            await self._redis.set(self._registry.keys.profile(role), json.dumps(raw, sort_keys=True))
            log.info("admin: stored the %s profile (measured on %s)", role, request.measured_on or "?")
        return pb.StoreProfileResponse(keys=[self._registry.keys.profile(role) for role in stored])

    async def GetTraffic(self, request: pb.GetTrafficRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        return window_to_proto(self._window(request.window_s))

    def _window(self, window_s: float) -> traffic_mod.Window:
        if self._traffic is None:
            raise InvalidRequest("this router keeps no traffic window (started without its metrics)")
        if window_s < 0 or not math.isfinite(window_s):
            raise InvalidRequest(f"window_s must be >= 0, got {window_s}")
        return self._traffic.window(time.monotonic(), window_s or DEFAULT_WINDOW_S)

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self._token is None:
            return
        sent = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self._token}".encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin token")

    async def _set_desired(self, role: str, size: int) -> None:
        await self._registry.set_desired_pool_size(role, size)  # type: ignore[arg-type]
        self._last_change_s = time.monotonic()
        log.info("admin: desired %s pool size = %d", role, size)

    async def _pool(self, role: str) -> pb.PoolStatus:
        draining = await self._registry.list_draining()
        ids = [info.worker_id for info, _ in await self._registry.list_workers() if info.role == role]
        pool = pb.PoolStatus(role=role, actual=len(ids), draining=sum(i in draining for i in ids))
        desired = await self._registry.get_desired_pool_size(role)  # type: ignore[arg-type]
        if desired is not None:
            pool.desired = desired
        return pool

    async def _current(self, role: str) -> int | None:
        desired = await self._registry.get_desired_pool_size(role)  # type: ignore[arg-type]
        if desired is not None:
            return desired
        actual = sum(info.role == role for info, _ in await self._registry.list_workers())
        return actual or None

    async def _profiles(self, request: pb.PlanRequest, context_tokens: float
                        ) -> tuple[planner.PrefillProfile, planner.DecodeProfile, list[planner.Term]]:
        """The request's curves, else the stored ones, else the workers' start-up calibration (said in the terms)."""
        p_raw = curve_dict(request.prefill_curve) if request.HasField("prefill_curve") else await self._stored("prefill")
        d_raw = curve_dict(request.decode_curve) if request.HasField("decode_curve") else await self._stored("decode")
        calibrated = await self._calibrated() if p_raw is None or d_raw is None else None
        prefill = _parse_profile("prefill", p_raw) if p_raw is not None else calibrated.prefill
        decode = _parse_profile("decode", d_raw, context_tokens) if d_raw is not None else calibrated.decode
        for role, profile in (("prefill", prefill), ("decode", decode)):
            if profile is None:
                key = self._registry.keys.profile(role)
                raise InvalidRequest(f"no {role} profile: pass one with the request (--profile FILE), store one in "
                                     f"{key} (`baton admin profile`), or start a worker that calibrates")
        return prefill, decode, [t for t in (calibrated.terms if calibrated else ())
                                 if (t.pool == "prefill" and p_raw is None) or (t.pool == "decode" and d_raw is None)]

    async def _calibrated(self) -> Calibrated:
        workers = await self._registry.list_workers()
        loads = [(info.role, load) for info, load in workers if load is not None]
        kv = [info.total_blocks * size for info, _ in workers
              if info.role == "decode" and info.total_blocks and (size := _block_size(info.layout_json))]
        return from_calibration(loads, min(kv) if kv else None)

    async def _stored(self, role: str) -> dict[str, Any] | None:
        key = self._registry.keys.profile(role)
        raw = await self._redis.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise InvalidRequest(f"{key} is not JSON: {exc}") from exc


def _count(counts: dict, worker_id: str) -> int:
    """A worker's count in a Redis HASH read without decoding (bytes keys and values)."""
    raw = counts.get(worker_id.encode(), counts.get(worker_id, 0))
    return int(raw)


def _block_size(layout_json: str) -> int | None:
    try:
        return KVLayout.from_json(layout_json).block_size
    except KVTransferError:  # an old or foreign registration: no KV limit from it
        return None


def _corrections(request: pb.PlanRequest) -> planner.Corrections:
    return planner.Corrections(
        prefill=request.prefill_correction if request.HasField("prefill_correction") else 1.0,
        decode=request.decode_correction if request.HasField("decode_correction") else 1.0,
    )


def _parse_profile(role: str, raw: dict[str, Any],
                   context_tokens: float | None = None) -> planner.PrefillProfile | planner.DecodeProfile:
    try:
        if role == "prefill":
            return planner.PrefillProfile(prompt_lens=tuple(int(x) for x in raw["prompt_lens"]),
                                          tokens_per_s=tuple(float(y) for y in raw["tokens_per_s"]))
        batches, itl_ms = tuple(int(x) for x in raw["batch_sizes"]), tuple(float(y) for y in raw["itl_ms"])
        contexts, grid = tuple(int(c) for c in raw.get("context_lens") or ()), raw.get("itl_ms_grid") or ()
        if contexts:
            itl_ms = planner.itl_row_at_context(contexts, tuple(float(y) for y in grid), len(batches),
                                                contexts[-1] if context_tokens is None else context_tokens)
        kv = raw.get("kv_tokens_per_worker")
        return planner.DecodeProfile(batch_sizes=batches, itl_s=tuple(y / 1e3 for y in itl_ms),
                                     kv_tokens_per_worker=None if kv is None else int(kv))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"malformed {role} profile: {exc!r}") from exc


def _traffic(request: pb.PlanRequest, window: traffic_mod.Window | None) -> planner.Traffic:
    if window is None:
        return planner.Traffic(rate_per_s=request.rate, mean_isl=request.isl, mean_osl=request.osl)
    if window.num_requests == 0 or window.mean_isl is None or window.mean_osl is None:
        raise InvalidRequest(f"no finished requests in the last {window.span_s:.0f} s of traffic: "
                             "plan with --rate/--isl/--osl instead")
    return traffic_mod.traffic_of(window)
