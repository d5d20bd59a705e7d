"""What a simulated run measured, per request and in summary: TTFT / TPOT / ITL / E2E percentiles, SLO
attainment and goodput, the prefix cache's hit rate, KV bytes moved, GPU-seconds. Pure.

Goodput, two ways: ``good_rps`` is the requests per second that met both SLOs in this run (``bench serve``'s
figure); DistServe's goodput is the highest request rate a deployment serves with at least ``attainment`` of its
requests inside both SLOs, which needs runs at several rates (``distserve_goodput`` over a sweep).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from workload.stats import percentile

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True, kw_only=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1
    attainment: float = 0.9  # DistServe's goal: this share of requests within both SLOs


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    route_kind: str = ""  # remote | local (as decided)
    prefill_id: str = ""
    decode_id: str = ""
    cached_tokens: int = 0  # prompt tokens the computing worker found cached (or imported) instead of computing
    kv_bytes: int = 0  # moved between workers for this request (P -> D pull, prefix import)
    first_token_s: float | None = None
    finished_s: float | None = None
    refused: str = ""  # why the request was not served ("" when it was)
    fell_back: bool = False  # routed remote, D computed it (no room to reserve its blocks)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finished_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)

    def meets(self, slo: Slo) -> bool:
        tpot = self.tpot_s
        return (self.finished_s is not None and self.ttft_s is not None and self.ttft_s <= slo.ttft_s
                and (tpot is None or tpot <= slo.tpot_s))


def weighted_percentile(counts: Mapping[float, int], q: float) -> float:
    """The q-th percentile of values given with their counts (the lower value at a tie, no interpolation)."""
    total = sum(counts.values())
    if not total:
        return math.nan
    rank, seen = q / 100 * total, 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    return max(counts)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float]:
    out = {"mean": sum(values_s) / len(values_s) * 1e3 if values_s else math.nan}
    out.update({f"p{q}": percentile(values_s, q) * 1e3 for q in PERCENTILES})
    return out


def summarize(records: Sequence[RequestRecord], itl: Counter[float], slo: Slo, *, gpus: int,
              busy_gpu_s: float) -> dict:
    done = [r for r in records if r.finished_s is not None]
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.finished_s for r in done), default=start)
    span_s = max(end - start, 1e-9)
    good = sum(r.meets(slo) for r in records)
    prompt = sum(r.prompt_tokens for r in done)
    itl_ms = {"mean": (sum(v * n for v, n in itl.items()) / max(sum(itl.values()), 1)) * 1e3}
    itl_ms.update({f"p{q}": weighted_percentile(itl, q) * 1e3 for q in PERCENTILES})
    refused = Counter(r.refused for r in records if r.refused)
    return {
        "requests": len(records), "finished": len(done), "refused": sum(refused.values()),
        "refused_why": dict(sorted(refused.items())), "span_s": span_s,
        "request_rate": len(records) / span_s,
        "ttft_ms": distribution_ms([t for r in done if (t := r.ttft_s) is not None]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": itl_ms,
        "e2e_ms": distribution_ms([r.finished_s - r.arrival_s for r in done]),
        "slo": {"ttft_ms": slo.ttft_s * 1e3, "tpot_ms": slo.tpot_s * 1e3, "attainment_goal": slo.attainment},
        "slo_attainment": good / max(len(records), 1),
        "good_rps": good / span_s,
        "cache_hit_rate": sum(r.cached_tokens for r in done) / max(prompt, 1),
        "kv_bytes_moved": sum(r.kv_bytes for r in done),
        "route_kinds": dict(sorted(Counter(r.route_kind for r in done).items())),
        "fallbacks": sum(r.fell_back for r in done),
        "gpu_seconds": {"provisioned": gpus * span_s, "busy": busy_gpu_s},
        "goodput_per_gpu": good / span_s / max(gpus, 1),
    }


def distserve_goodput(runs: Sequence[tuple[float, dict]], attainment: float) -> float | None:
    """The highest request rate among ``(rate, summary)`` runs whose SLO attainment met the goal (DistServe:
    the max rate served with >= ``attainment`` of requests inside both SLOs); None when none did."""
    met = [rate for rate, summary in runs if summary["slo_attainment"] >= attainment]
    return max(met) if met else None
