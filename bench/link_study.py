"""The cost model against a real link (issue 21, item 3): what ``python -m bench.hosts --study`` measures per request,
and how it sums a (link rate, policy) cell up.

Each request of the study is timed by the client: the first token's arrival (TTFT: for a remote prefill it comes
from P, before any KV moves) and the arrival of the **first token the decode worker sent** (``d_first_ms``: the
second message for a remote prefill, after P's compute *and* the pull; the first one for a local prefill). The cost
model's "ttft" of a plan is the time until D holds the prompt's KV (remote: P's queue + compute + the pull; local:
D's own prefill), so ``d_first_ms`` is what it is compared with (it adds one decode step and a router hop). From the
cost router's route reason (``router.routing.policy.route_by_cost``) each request also keeps both plans' predicted
terms: the remote plan's ttft and transfer, the local plan's ttft and the stall it inflicts on D's running
sequences; with one decode worker and the ITL rule out of play (``--itl-target-ms`` high), the cost model chooses
remote exactly when ``remote ttft < local ttft + stall``, which ``agrees`` checks against the route taken.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from workload.plots import pyplot

_REMOTE = re.compile(r"remote on (\S+) ([0-9.]+) s = .*?\+ transfer ([0-9.]+)")
_LOCAL = re.compile(r"local ([0-9.]+) s = .*?stall of running ([0-9.]+)\)")


@dataclass(slots=True, kw_only=True)
class Sample:
    rate: str
    link_mbit: float
    policy: str
    kind: str  # remote | local
    ttft_ms: float
    d_first_ms: float  # the first token from the decode worker (see the module docstring)
    e2e_ms: float
    stall_ms: float = 0.0  # measured: how much later the background streams' tokens came while it ran
    predicted_ms: float = 0.0  # the chosen plan's ttft, as the router predicted it (Timings.predicted_ttft_ms)
    remote_s: float | None = None  # both plans' predicted terms, from the cost router's reason
    transfer_s: float | None = None
    local_s: float | None = None
    stall_s: float | None = None
    transfer_ms: float = 0.0  # measured by D
    transfer_mib: float = 0.0
    fallback: bool = False

    @property
    def cost_ms(self) -> float:
        """What the cost model prices, measured: the wait for D's first token plus the stall of D's other streams."""
        return self.d_first_ms + self.stall_ms

    @property
    def agrees(self) -> bool | None:
        """The route taken is the cheaper predicted plan (None: the reason does not price both)."""
        if self.remote_s is None or self.local_s is None or self.stall_s is None:
            return None
        return self.kind == ("local" if self.local_s + self.stall_s < self.remote_s else "remote")

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, of the time until D's first token; None without a prediction."""
        if not self.predicted_ms or not self.d_first_ms:
            return None
        return (self.predicted_ms - self.d_first_ms) / self.d_first_ms


def plans(reason: str) -> dict[str, float]:
    """Both plans' predicted seconds from a cost router's reason: remote_s, transfer_s, local_s, stall_s (those it
    names)."""
    out: dict[str, float] = {}
    if (m := _REMOTE.search(reason)) is not None:
        out["remote_s"], out["transfer_s"] = float(m.group(2)), float(m.group(3))
    if (m := _LOCAL.search(reason)) is not None:
        out["local_s"], out["stall_s"] = float(m.group(1)), float(m.group(2))
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarise(samples: list[Sample]) -> dict:
    """One (rate, policy) cell: routes, TTFT and D's first token p50/p90, the prediction's median error."""
    first = samples[0]
    errors = [e for s in samples if (e := s.error) is not None]
    agreed = [a for s in samples if (a := s.agrees) is not None]
    median = lambda values: statistics.median(values) if values else None  # noqa: E731
    return {
        "rate": first.rate, "link_mbit": first.link_mbit, "policy": first.policy, "requests": len(samples),
        "remote": sum(s.kind == "remote" for s in samples), "local": sum(s.kind == "local" for s in samples),
        "fallbacks": sum(s.fallback for s in samples),
        "ttft_p50_ms": percentile([s.ttft_ms for s in samples], 0.5),
        "ttft_p90_ms": percentile([s.ttft_ms for s in samples], 0.9),
        "d_first_p50_ms": percentile([s.d_first_ms for s in samples], 0.5),
        "d_first_p90_ms": percentile([s.d_first_ms for s in samples], 0.9),
        "e2e_p50_ms": percentile([s.e2e_ms for s in samples], 0.5),
        "stall_p50_ms": percentile([s.stall_ms for s in samples], 0.5),
        "cost_p50_ms": percentile([s.cost_ms for s in samples], 0.5),
        "median_abs_error": median([abs(e) for e in errors]), "median_error": median(errors),
        "agrees": f"{sum(agreed)}/{len(agreed)}" if agreed else "-",
        "predicted_remote_s": median([s.remote_s for s in samples if s.remote_s is not None]),
        "predicted_local_s": median([s.local_s + s.stall_s for s in samples
                                     if s.local_s is not None and s.stall_s is not None]),
        "pull_ms": median([s.transfer_ms for s in samples if s.transfer_ms]),
        "predicted_pull_ms": median([s.transfer_s * 1e3 for s in samples if s.transfer_s is not None]),
    }


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (docs/benchmarks.md)."""
    head = ("| link | policy | remote / local | TTFT p50 | TTFT p90 | D's first token p50 | p90 | pull p50 (predicted) | "
            "stall p50 | D's first + stall p50 | predicted remote / local+stall | chosen = cheaper predicted | "
            "median abs error |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        pr, pl = r["predicted_remote_s"], r["predicted_local_s"]
        predicted = f"{pr:.2f} / {pl:.2f} s" if pr is not None and pl is not None else "-"
        error = f"{100 * r['median_abs_error']:.0f}%" if r["median_abs_error"] is not None else "-"
        pull = f"{r['pull_ms']:,.0f} ms" if r["pull_ms"] else "-"
        if r.get("predicted_pull_ms") is not None:
            pull += f" ({r['predicted_pull_ms']:,.0f} ms)"
        lines.append(f"| {_mbit(r['link_mbit'])} | {r['policy']} | {r['remote']} / {r['local']} | "
                     f"{r['ttft_p50_ms']:,.0f} | {r['ttft_p90_ms']:,.0f} | {r['d_first_p50_ms']:,.0f} | "
                     f"{r['d_first_p90_ms']:,.0f} | {pull} | {r['stall_p50_ms']:,.0f} | {r['cost_p50_ms']:,.0f} | "
                     f"{predicted} | {r['agrees']} | {error} |")
    return "\n".join(lines)


def _mbit(mbit: float) -> str:
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def plot(rows: list[dict], path: Path) -> Path | None:
    """Top: per link rate, the cost policy's share of remote prefills and both plans' predicted costs (medians).
    Bottom: per policy, the measured cost p50 (D's first token + the stall of D's other streams) and TTFT p50.
    The path written, or None without matplotlib."""
    if pyplot() is None:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 7))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    cost = [r for r in rows if r["policy"] == "cost"]
    x = [r["link_mbit"] for r in cost]
    top.plot(x, [r["remote"] / r["requests"] for r in cost], "o-", color="black", label="remote share (cost)")
    top.set_ylabel("share of requests prefilled remotely")
    top.set_ylim(-0.05, 1.05)
    twin = top.twinx()
    for key, style, label in (("predicted_remote_s", "s--", "predicted remote ttft"),
                              ("predicted_local_s", "^--", "predicted local ttft + stall")):
        pts = [(r["link_mbit"], r[key]) for r in cost if r[key] is not None]
        twin.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    twin.set_ylabel("predicted seconds (median)")
    lines = top.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    top.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="best")
    top.set_title("the cost router's choice and its predictions as the P -> D link slows (left to right)", fontsize=10)
    for policy in sorted({r["policy"] for r in rows}):
        cell = [r for r in rows if r["policy"] == policy]
        bottom.plot([r["link_mbit"] for r in cell], [r["cost_p50_ms"] / 1e3 for r in cell], "o-",
                    label=f"{policy}: D's first token + stall p50")
        bottom.plot([r["link_mbit"] for r in cell], [r["ttft_p50_ms"] / 1e3 for r in cell], "x:",
                    label=f"{policy}: TTFT p50")
    bottom.set_xscale("log")
    bottom.invert_xaxis()  # fast on the left: the link slows as one reads
    bottom.set_xlabel("link rate (Mbit/s)")
    bottom.set_ylabel("seconds")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def as_dicts(samples: list[Sample]) -> list[dict]:
    return [{**asdict(s), "agrees": s.agrees, "error": s.error} for s in samples]
