"""Pool sizing from SLOs: how many prefill and decode workers for this traffic (pure math, no I/O).

Prefill (DistServe-style queueing): requests reach the prefill pool Poisson at the rate of those the router
prefills there (``Traffic.remote``, measured by the router: the cost policy keeps short prompts on the decode
worker; ``None``: every request at full length, as before it was measured). How the router picks a prefill worker
decides the queue (``router.admin.queueing``, ``plan_pools(dispatch=...)``): **pooled** (the cost, least-loaded and
prefix-overlap policies price each worker's queue, so a prompt goes to the worker that frees first) is one M/G/n
queue, **split** (round-robin, random: blind to the queues) is ``n`` M/G/1 queues fed ``rate / n`` each, which
needs about twice the workers. A prompt of ``L`` tokens of which the prefill worker finds a share ``h`` cached
takes ``S = T(L) - T(h L)`` with ``T(x) = x / throughput(x)`` on the profiled prefill curve (``service_mix``; an
approximation, stated there); ``isl_mix`` gives the prompt lengths' spread (the router's prompt-token histogram),
so the service time has a mean ``E[S]`` and a squared coefficient of variation ``cs2`` (0 when only the mean is
known). A prompt waits with the model's probability (Erlang C pooled, ``rho`` split) and then for an exponential
time (Allen-Cunneen's mean pooled, Pollaczek-Khinchine's split); TTFT is its own service time plus that wait, and
the p90 over the prefill pool's prompts is solved over the mix and held to the TTFT SLO (the prompts kept on a
decode worker are not this pool's: the measured correction, over every request's TTFT, accounts for them).

Decode (Dynamo-style throughput at ITL): the profiled ITL-vs-batch curve, scaled by the correction factor,
gives the largest batch ``B*`` a worker can run within the ITL target (linear interpolation, no
extrapolation, capped by the KV capacity). By Little's law the cluster holds ``rate * osl * ITL`` decoding
sequences, so ``ceil(rate * osl * ITL / B*)`` workers are needed.

Correction factors are measured / predicted latency (1.0 = the model is right); they scale the prediction.
Hysteresis: a pool grows as soon as the plan asks for more (after ``up_cooldown_s``), but shrinks only after
``down_cooldown_s`` since the last change and only to what would still hold at ``1 + down_headroom`` times
the traffic, so a rate near a boundary does not flap the pool. Never below 1 worker per pool.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from engine.errors import InvalidRequest
from router.admin.profiles import DecodeProfile, PrefillProfile, interpolate, itl_row_at_context
from router.admin.queueing import Dispatch, model_name, moments, prefill_ttft_p90_s

__all__ = [  # the profiles are the planner's inputs: importable from here as before
    "Corrections", "DecodeProfile", "Plan", "PlannerConfig", "PoolPlan", "PoolState", "PrefillProfile", "RemotePrefill",
    "Slo", "Term", "Traffic", "damp", "interpolate", "itl_row_at_context", "max_batch_at_itl", "plan_pools",
    "prefill_ttft_p90_s", "service_mix", "size_decode", "size_prefill"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Slo:
    ttft_p90_s: float
    itl_p90_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RemotePrefill:
    """The prefill pool's own traffic: the requests the router prefilled on a prefill worker, their prompts, and the
    share of those prompts' tokens the prefill worker found cached (the router's remote-prefill series)."""

    rate_per_s: float  # requests per second
    mean_isl: float  # prompt tokens
    isl_mix: tuple[tuple[float, float], ...] = ()  # (prompt tokens, share of requests); (): every prompt at mean_isl
    cached_fraction: float = 0.0  # of their prompt tokens, found cached on the prefill worker


@dataclass(frozen=True, slots=True, kw_only=True)
class Traffic:
    rate_per_s: float  # requests per second
    mean_isl: float  # prompt tokens
    mean_osl: float  # output tokens
    isl_mix: tuple[tuple[float, float], ...] = ()  # (prompt tokens, share of requests); (): every prompt at mean_isl
    remote: RemotePrefill | None = None  # None: every request prefilled on a prefill worker, at full length

    def prefill_side(self) -> RemotePrefill:
        """What the prefill pool serves: ``remote``, or every request uncached."""
        return self.remote or RemotePrefill(rate_per_s=self.rate_per_s, mean_isl=self.mean_isl, isl_mix=self.isl_mix)

    def scaled(self, factor: float) -> Traffic:
        """The same traffic at ``factor`` times the rate (the prefill pool's share too)."""
        remote = None if self.remote is None else replace(self.remote, rate_per_s=self.remote.rate_per_s * factor)
        return replace(self, rate_per_s=self.rate_per_s * factor, remote=remote)


@dataclass(frozen=True, slots=True, kw_only=True)
class Corrections:
    """Measured / predicted latency per pool; 1.0 trusts the profile as is. ``decode`` is the ITL p90's (the SLO's
    percentile: it bounds the batch); ``decode_mean`` the mean ITL's, for Little's law (a sequence lives ``osl``
    mean gaps, not ``osl`` p90 gaps); None: ``decode`` for both, as before the mean was measured."""

    prefill: float = 1.0
    decode: float = 1.0
    decode_mean: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    max_workers: int = 64  # per pool; the search stops here
    infeasible_utilization: float = 0.8  # prefill target when no count meets the TTFT SLO
    down_headroom: float = 0.2  # shrink only to a size that holds 1.2x the traffic
    up_cooldown_s: float = 0.0
    down_cooldown_s: float = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolState:
    """The sizes now in force and when either last changed (None: never)."""

    prefill: int | None = None
    decode: int | None = None
    last_change_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Term:
    pool: str  # prefill | decode | plan
    name: str
    value: float
    unit: str
    note: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolPlan:
    raw: int  # what the traffic needs now
    sticky: int  # what would still hold at (1 + down_headroom) x traffic
    feasible: bool  # False: no count meets the SLO (see the terms)
    terms: tuple[Term, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    prefill: int
    decode: int
    prefill_plan: PoolPlan
    decode_plan: PoolPlan
    decisions: tuple[Term, ...] = field(default=())

    @property
    def feasible(self) -> bool:
        return self.prefill_plan.feasible and self.decode_plan.feasible

    @property
    def terms(self) -> tuple[Term, ...]:
        return self.prefill_plan.terms + self.decode_plan.terms + self.decisions

    def explain(self) -> str:
        """The reasoning, one term per line: ``pool  name = value unit  (note)``."""
        lines = [f"{t.pool:<8} {t.name:<28} = {_num(t.value)} {t.unit}" + (f"  ({t.note})" if t.note else "")
                 for t in self.terms]
        lines.append(f"plan: {self.prefill} prefill, {self.decode} decode" + ("" if self.feasible else
                     "  (SLO not reachable with these profiles: best effort)"))
        return "\n".join(lines)


def plan_pools(slo: Slo, traffic: Traffic, prefill: PrefillProfile, decode: DecodeProfile, *,
               corrections: Corrections = Corrections(), config: PlannerConfig = PlannerConfig(),
               state: PoolState = PoolState(), now_s: float = 0.0, dispatch: Dispatch = "pooled") -> Plan:
    """Recommend pool sizes; with ``state``, damp the change (hysteresis, cool-downs). ``dispatch``: how the
    router's policy feeds the prefill pool (``router.admin.queueing.dispatch_of``)."""
    _check_inputs(slo, traffic, corrections)
    busier = traffic.scaled(1.0 + config.down_headroom)
    p_plan = replace(size_prefill(slo, traffic, prefill, corrections.prefill, config, dispatch=dispatch),
                     sticky=size_prefill(slo, busier, prefill, corrections.prefill, config, dispatch=dispatch).raw)
    d_plan = replace(size_decode(slo, traffic, decode, corrections.decode, config, corrections.decode_mean),
                     sticky=size_decode(slo, busier, decode, corrections.decode, config, corrections.decode_mean).raw)
    since_s = None if state.last_change_s is None else now_s - state.last_change_s
    p_count, p_why = damp(state.prefill, p_plan, since_s, config)
    d_count, d_why = damp(state.decode, d_plan, since_s, config)
    decisions = (Term(pool="prefill", name="decision", value=p_count, unit="workers", note=p_why),
                 Term(pool="decode", name="decision", value=d_count, unit="workers", note=d_why))
    return Plan(prefill=p_count, decode=d_count, prefill_plan=p_plan, decode_plan=d_plan, decisions=decisions)


def service_mix(profile: PrefillProfile, mean_isl: float, isl_mix: tuple[tuple[float, float], ...] = (),
                cached_fraction: float = 0.0) -> tuple[tuple[float, float], ...]:
    """(prefill seconds, share) of each prompt length of the mix (or of the mean alone), shares summing to 1.

    A prompt of ``L`` tokens with a share ``h`` of them cached costs ``T(L) - T(h L)``, ``T(x) = x /
    throughput(x)``: the compute of tokens ``[h L, L)`` when each token's cost depends only on its position (its
    attention over those before it), which the profile's whole-prompt times sum. Approximations: every prompt gets
    the pool's token-weighted cached share ``h`` (the router counts cached tokens, not each prompt's hit), and a
    prompt's fixed cost falls out of the difference; never below those tokens at the profile's best throughput."""
    mix = isl_mix or ((mean_isl, 1.0),)
    total = sum(share for _, share in mix)
    fastest = max(profile.tokens_per_s)

    def seconds(isl: float) -> float:
        if cached_fraction <= 0.0:
            return profile.service_time_s(isl)
        computed_s = profile.service_time_s(isl) - profile.service_time_s(cached_fraction * isl)
        return max(computed_s, (1.0 - cached_fraction) * isl / fastest)

    return tuple((seconds(isl), share / total) for isl, share in mix)


def size_prefill(slo: Slo, traffic: Traffic, profile: PrefillProfile, correction: float, config: PlannerConfig, *,
                 dispatch: Dispatch = "pooled") -> PoolPlan:
    remote = traffic.prefill_side()
    services = service_mix(profile, remote.mean_isl, remote.isl_mix, remote.cached_fraction)
    service_s, cs2 = moments(services)
    spread = "over the prompt-length mix" if len(services) > 1 else "isl / throughput"
    cached = f", {remote.cached_fraction:.1%} of tokens cached: T(L) - T(hL)" if remote.cached_fraction > 0 else ""
    model = model_name(dispatch)
    terms = [Term(pool="prefill", name="prefill rate", value=remote.rate_per_s, unit="req/s",
                  note="every request" if traffic.remote is None else
                  f"prefilled on a prefill worker, {remote.rate_per_s / max(traffic.rate_per_s, 1e-12):.1%} of all"),
             Term(pool="prefill", name="throughput at isl", value=remote.mean_isl / service_s, unit="tok/s"),
             Term(pool="prefill", name="service time D", value=service_s * 1e3, unit="ms",
                  note=f"mean, {spread}{cached}"),
             Term(pool="prefill", name="service time cs2", value=cs2, unit="", note="variance / mean^2"),
             Term(pool="prefill", name="correction", value=correction, unit="x", note="measured / predicted TTFT")]
    for n in range(1, config.max_workers + 1):
        rho, ttft_s = prefill_ttft_p90_s(remote.rate_per_s, services, n, dispatch)
        if ttft_s * correction <= slo.ttft_p90_s:
            terms += [Term(pool="prefill", name="utilization rho", value=rho, unit="", note=f"rate / n * D at n = {n}"),
                      Term(pool="prefill", name="predicted TTFT p90", value=ttft_s * correction * 1e3, unit="ms",
                           note=f"{model}, <= SLO {slo.ttft_p90_s * 1e3:g} ms")]
            return PoolPlan(raw=n, sticky=n, feasible=True, terms=tuple(terms))
    n = max(1, math.ceil(remote.rate_per_s * service_s / config.infeasible_utilization))
    n = min(n, config.max_workers)
    terms.append(Term(pool="prefill", name="utilization rho", value=remote.rate_per_s / n * service_s, unit="",
                      note=f"{model}: no count meets the TTFT SLO; sized for rho <= {config.infeasible_utilization:g}"))
    return PoolPlan(raw=n, sticky=n, feasible=False, terms=tuple(terms))


def max_batch_at_itl(profile: DecodeProfile, itl_target_s: float) -> float | None:
    """Largest (interpolated) batch whose ITL stays within the target; None when even the smallest misses."""
    sizes, itls = profile.batch_sizes, profile.itl_s
    if itls[0] > itl_target_s:
        return None
    i = bisect.bisect_right(itls, itl_target_s)
    if i == len(itls):
        return float(sizes[-1])  # no extrapolation past the profile
    lo, hi = i - 1, i
    return sizes[lo] + (sizes[hi] - sizes[lo]) * (itl_target_s - itls[lo]) / (itls[hi] - itls[lo])


def size_decode(slo: Slo, traffic: Traffic, profile: DecodeProfile, correction: float,
                config: PlannerConfig, mean_correction: float | None = None) -> PoolPlan:
    batch = max_batch_at_itl(profile, slo.itl_p90_s / correction)
    feasible = batch is not None
    batch = batch if batch is not None else float(profile.batch_sizes[0])
    terms = [Term(pool="decode", name="correction", value=correction, unit="x", note="measured / predicted ITL"),
             Term(pool="decode", name="batch at ITL target", value=batch, unit="seqs",
                  note=f"profile ITL * correction <= {slo.itl_p90_s * 1e3:g} ms" if feasible
                  else "smallest profiled batch already misses the ITL SLO")]
    if profile.kv_tokens_per_worker is not None:
        kv_batch = profile.kv_tokens_per_worker / (traffic.mean_isl + traffic.mean_osl)
        terms.append(Term(pool="decode", name="batch by KV capacity", value=kv_batch, unit="seqs",
                          note="kv tokens / (isl + osl)"))
        batch = max(1.0, min(batch, kv_batch))
    profiled_s = interpolate(profile.batch_sizes, profile.itl_s, batch)
    itl_s = profiled_s * (correction if mean_correction is None else mean_correction)  # the mean gap at that batch
    concurrent = traffic.rate_per_s * traffic.mean_osl * itl_s
    n = min(config.max_workers, max(1, math.ceil(concurrent / batch - 1e-9)))
    terms += [Term(pool="decode", name="concurrent sequences", value=concurrent, unit="seqs",
                   note="Little: rate * osl * mean ITL" + ("" if mean_correction is None else
                                                            f" (profile x {mean_correction:.3g}, measured mean)")),
              Term(pool="decode", name="per-worker throughput", value=batch / itl_s, unit="tok/s",
                   note="batch / ITL"),
              Term(pool="decode", name="workers needed", value=concurrent / batch, unit="", note="ceil -> raw")]
    return PoolPlan(raw=n, sticky=n, feasible=feasible, terms=tuple(terms))


def damp(current: int | None, plan: PoolPlan, since_change_s: float | None, config: PlannerConfig) -> tuple[int, str]:
    """The size to set now and why: grow to ``raw``; shrink to ``sticky`` only after the cool-down."""
    if current is None:
        return plan.raw, "no current size: take the plan"
    ready_up = since_change_s is None or since_change_s >= config.up_cooldown_s
    ready_down = since_change_s is None or since_change_s >= config.down_cooldown_s
    if plan.raw > current:
        return (plan.raw, "scale up") if ready_up else (current, "scale up waits for the cool-down")
    target = max(plan.raw, plan.sticky)
    if target < current:
        return (target, f"scale down (holds {1 + config.down_headroom:g}x traffic)") if ready_down else (
            current, "scale down waits for the cool-down")
    return current, "hold (within the hysteresis band)"


def _check_inputs(slo: Slo, traffic: Traffic, corrections: Corrections) -> None:
    checks = {"ttft_p90": slo.ttft_p90_s, "itl_p90": slo.itl_p90_s, "isl": traffic.mean_isl,
              "osl": traffic.mean_osl, "prefill correction": corrections.prefill,
              "decode correction": corrections.decode}
    for name, value in checks.items():
        if not (value > 0 and math.isfinite(value)):
            raise InvalidRequest(f"{name} must be a positive number, got {value}")
    if not (traffic.rate_per_s >= 0 and math.isfinite(traffic.rate_per_s)):
        raise InvalidRequest(f"rate must be >= 0, got {traffic.rate_per_s}")
    for mix in (traffic.isl_mix, () if traffic.remote is None else traffic.remote.isl_mix):
        if any(not (isl > 0 and share > 0 and math.isfinite(isl) and math.isfinite(share)) for isl, share in mix):
            raise InvalidRequest(f"isl_mix needs positive (prompt tokens, share) pairs, got {mix}")
    remote = traffic.remote
    if remote is not None and not (remote.rate_per_s >= 0 and math.isfinite(remote.rate_per_s)
                                   and remote.mean_isl > 0 and math.isfinite(remote.mean_isl)
                                   and 0.0 <= remote.cached_fraction < 1.0):
        raise InvalidRequest(f"remote prefill traffic needs rate >= 0, isl > 0 and 0 <= cached < 1, got {remote}")


def _num(value: float) -> str:
    return f"{value:.0f}" if value == int(value) and abs(value) < 1e12 else f"{value:.3g}"
