"""Baton's planner (``router.admin.planner``, the real one) on the modelled workers, and the calibration hook.

``plan_for`` profiles a modelled worker as ``baton admin profile`` profiles a real one (prefill tokens/s per
prompt length, ITL per batch size) and hands those curves, the workload's traffic and the SLOs to
``plan_pools``: what the planner would size the pools to for this trace, beside the sizes the run used.
``curves_from_profile`` reads the curves ``baton admin profile -o FILE`` wrote (its ``plan --profile`` format),
so a measured profile can replace the roofline (``CurveTimeModel``): the hook the calibration against real
runs (issue 23, item 2) fills. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.admin.planner import (DecodeProfile, Plan, PlannerConfig, PrefillProfile, Traffic, itl_row_at_context,
                                  plan_pools)
from router.admin.planner import Slo as PlannerSlo
from router.admin.queueing import Dispatch
from router.admin.traffic import histogram_of, isl_mix_of
from router.metrics import TOKEN_BUCKETS
from sim.metrics import Slo
from sim.timing import TimeModel, profiles_of
from sim.workload import SimRequest

PROFILE_PROMPT_LENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
PROFILE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def traffic_of(requests: Sequence[SimRequest], span_s: float | None = None) -> Traffic:
    """Mean rate over the workload's span (or ``span_s``), mean prompt and output lengths, and the prompt lengths'
    mix as the router's prompt-token histogram gives it to the planner (``router.admin.traffic.isl_mix_of``)."""
    n = len(requests)
    if span_s is None:
        span_s = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    lengths = [float(r.prompt_tokens) for r in requests]
    return Traffic(rate_per_s=n / span_s if span_s > 0 else float(n), mean_isl=sum(lengths) / n,
                   mean_osl=sum(r.output_tokens for r in requests) / n,
                   isl_mix=isl_mix_of(histogram_of(lengths, TOKEN_BUCKETS)))


def profiles_for(requests: Sequence[SimRequest], time_model: TimeModel, *,
                 kv_tokens: int) -> tuple[PrefillProfile, DecodeProfile]:
    """What ``baton admin profile`` would measure on the modelled worker, its ITL at the workload's mean context."""
    traffic = traffic_of(requests)
    context = round(traffic.mean_isl + traffic.mean_osl / 2)
    return profiles_of(time_model, prompt_lens=PROFILE_PROMPT_LENS, batch_sizes=PROFILE_BATCH_SIZES,
                       context=context, kv_tokens=kv_tokens)


def plan_for(requests: Sequence[SimRequest], time_model: TimeModel, slo: Slo, *, kv_tokens: int,
             max_workers: int = 4096, dispatch: Dispatch = "pooled") -> tuple[Plan, Traffic]:
    """The plan for the trace's mean traffic (every prompt on a prefill worker, uncached: a trace alone does not say
    which the router keeps local or finds cached); ``dispatch`` the simulated policy's (``dispatch_of``)."""
    traffic = traffic_of(requests)
    prefill, decode = profiles_for(requests, time_model, kv_tokens=kv_tokens)
    plan = plan_pools(PlannerSlo(ttft_p90_s=slo.ttft_s, itl_p90_s=slo.tpot_s), traffic, prefill, decode,
                      config=PlannerConfig(max_workers=max_workers), dispatch=dispatch)
    return plan, traffic


def _pick(doc: Mapping[str, Any], snake: str) -> Any:
    head, *rest = snake.split("_")
    camel = head + "".join(part.title() for part in rest)
    if snake in doc:
        return doc[snake]
    if camel in doc:
        return doc[camel]
    raise ValueError(f"profile curve lacks {snake!r}")


def curves_from_profile(doc: Mapping[str, Any], *, context_tokens: float | None = None
                        ) -> tuple[PrefillProfile, DecodeProfile]:
    """The two curves of a ``baton admin profile -o FILE`` document (proto JSON: camelCase or snake_case). With
    ``context_tokens`` and a profile measured at several contexts, the ITL row at that context (interpolated, as
    the router's planner reads it), else the curve's own row (its longest context)."""
    if "prefill" not in doc or "decode" not in doc:
        raise ValueError("a profile for the simulator needs both a 'prefill' and a 'decode' curve")
    prefill, decode = doc["prefill"], doc["decode"]
    kv = decode.get("kv_tokens_per_worker", decode.get("kvTokensPerWorker"))
    batches = tuple(int(x) for x in _pick(decode, "batch_sizes"))
    itl_ms = tuple(float(x) for x in _pick(decode, "itl_ms"))
    contexts = decode.get("context_lens", decode.get("contextLens"))
    grid = decode.get("itl_ms_grid", decode.get("itlMsGrid"))
    if context_tokens is not None and contexts and grid:
        itl_ms = itl_row_at_context(tuple(int(c) for c in contexts), tuple(float(x) for x in grid), len(batches),
                                    context_tokens)
    return (PrefillProfile(prompt_lens=tuple(int(x) for x in _pick(prefill, "prompt_lens")),
                           tokens_per_s=tuple(float(x) for x in _pick(prefill, "tokens_per_s"))),
            DecodeProfile(batch_sizes=batches, itl_s=tuple(x * 1e-3 for x in itl_ms),
                          kv_tokens_per_worker=None if kv is None else int(kv)))


def plan_dict(plan: Plan, traffic: Traffic) -> dict:
    return {"prefill": plan.prefill, "decode": plan.decode, "feasible": plan.feasible,
            "traffic": {"rate_per_s": traffic.rate_per_s, "mean_isl": traffic.mean_isl, "mean_osl": traffic.mean_osl},
            "explain": plan.explain()}
