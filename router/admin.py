"""``baton.v1.Admin`` on the router: workers and pools from the Redis registry, scale, drain, plan.

A thin shell (STYLE.md rule 1): the registry holds the state, ``router.planner`` does the math. When an
admin token is configured every call must carry ``authorization: Bearer <token>``; otherwise it is refused
with UNAUTHENTICATED before anything is read or changed.

Profiles for ``Plan`` come with the request, or from ``{ns}:profile:prefill`` / ``{ns}:profile:decode``
(JSON, written by a profiling run: ``{"prompt_lens": [...], "tokens_per_s": [...]}`` and
``{"batch_sizes": [...], "itl_ms": [...], "kv_tokens_per_worker": N}``).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any

import grpc

from engine.errors import InvalidRequest
from kv_transfer.registry import ROLES, Registry, WorkerInfo, WorkerLoad
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router import planner

log = logging.getLogger(__name__)

ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, registry: Registry, redis: Any, *, token: str | None = None,
                 planner_config: planner.PlannerConfig = planner.PlannerConfig()) -> None:
        self._registry, self._redis = registry, redis
        self._token = token or None
        self._planner_config = planner_config
        self._last_change_s: float | None = None  # monotonic; the planner's cool-down clock

    async def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        draining, now_ms = await self._registry.list_draining(), int(time.time() * 1000)
        workers = [_worker_to_proto(info, load, info.worker_id in draining, now_ms)
                   for info, load in await self._registry.list_workers()]
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
        prefill, decode = await self._profiles(request)
        state = planner.PoolState(prefill=await self._current("prefill"), decode=await self._current("decode"),
                                  last_change_s=self._last_change_s)
        plan = planner.plan_pools(
            planner.Slo(ttft_p90_s=request.ttft_p90_ms / 1e3, itl_p90_s=request.itl_p90_ms / 1e3),
            planner.Traffic(rate_per_s=request.rate, mean_isl=request.isl, mean_osl=request.osl), prefill, decode,
            corrections=_corrections(request), config=self._planner_config, state=state, now_s=time.monotonic(),
        )
        if request.apply:
            for role, size in (("prefill", plan.prefill), ("decode", plan.decode)):
                if size != await self._registry.get_desired_pool_size(role):  # type: ignore[arg-type]
                    await self._set_desired(role, size)
        return _plan_to_proto(plan, applied=request.apply)

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

    async def _profiles(self, request: pb.PlanRequest) -> tuple[planner.PrefillProfile, planner.DecodeProfile]:
        has_p, has_d = request.HasField("prefill_curve"), request.HasField("decode_curve")
        p_raw = _curve_dict(request.prefill_curve) if has_p else await self._stored("prefill")
        d_raw = _curve_dict(request.decode_curve) if has_d else await self._stored("decode")
        try:
            prefill = planner.PrefillProfile(prompt_lens=tuple(int(x) for x in p_raw["prompt_lens"]),
                                             tokens_per_s=tuple(float(y) for y in p_raw["tokens_per_s"]))
            kv = d_raw.get("kv_tokens_per_worker")
            decode = planner.DecodeProfile(batch_sizes=tuple(int(x) for x in d_raw["batch_sizes"]),
                                           itl_s=tuple(float(y) / 1e3 for y in d_raw["itl_ms"]),
                                           kv_tokens_per_worker=None if kv is None else int(kv))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed profile: {exc!r}") from exc
        return prefill, decode

    async def _stored(self, role: str) -> dict[str, Any]:
        key = f"{self._registry.keys.ns}:profile:{role}"
        raw = await self._redis.get(key)
        if raw is None:
            raise InvalidRequest(f"no {role} profile: pass one with the request (--profile FILE) or store it in {key}")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise InvalidRequest(f"{key} is not JSON: {exc}") from exc


def _curve_dict(curve: pb.PrefillCurve | pb.DecodeCurve) -> dict[str, Any]:
    if isinstance(curve, pb.PrefillCurve):
        return {"prompt_lens": list(curve.prompt_lens), "tokens_per_s": list(curve.tokens_per_s)}
    kv = curve.kv_tokens_per_worker if curve.HasField("kv_tokens_per_worker") else None
    return {"batch_sizes": list(curve.batch_sizes), "itl_ms": list(curve.itl_ms), "kv_tokens_per_worker": kv}


def _corrections(request: pb.PlanRequest) -> planner.Corrections:
    return planner.Corrections(
        prefill=request.prefill_correction if request.HasField("prefill_correction") else 1.0,
        decode=request.decode_correction if request.HasField("decode_correction") else 1.0,
    )


def _worker_to_proto(info: WorkerInfo, load: WorkerLoad | None, draining: bool, now_ms: int) -> pb.AdminWorker:
    worker = pb.AdminWorker(
        worker_id=info.worker_id, role=info.role, grpc_address=info.grpc_address, kv_uri=info.kv_uri,
        state=pb.WORKER_STATE_DRAINING if draining else pb.WORKER_STATE_UP, num_total_blocks=info.total_blocks,
    )
    if load is not None:
        worker.has_load, worker.num_running, worker.num_waiting = True, load.running, load.waiting
        worker.num_free_blocks, worker.queued_prefill_tokens = load.free_blocks, load.queued_prefill_tokens
        if info.total_blocks > 0:
            worker.kv_cache_usage = 1.0 - load.free_blocks / info.total_blocks
        if load.reported_unix_ms is not None:
            worker.load_age_ms = max(0, now_ms - load.reported_unix_ms)
    return worker


def _plan_to_proto(plan: planner.Plan, *, applied: bool) -> pb.PlanResponse:
    terms = [pb.PlanTerm(pool=t.pool, name=t.name, value=t.value, unit=t.unit, note=t.note) for t in plan.terms]
    return pb.PlanResponse(prefill=plan.prefill, decode=plan.decode, prefill_raw=plan.prefill_plan.raw,
                           decode_raw=plan.decode_plan.raw, feasible=plan.feasible, terms=terms,
                           reasoning=plan.explain(), applied=applied)
