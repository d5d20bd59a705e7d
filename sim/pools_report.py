"""``baton simulate pools``' output: one row per pool choice, the table, the plot (GPU-seconds vs SLO attainment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

from workload.plots import pyplot


def row_of(label: str, prefill: int | list[tuple[int, int]], decode: int | None, summary: dict) -> dict[str, Any]:
    """A run's figures; a planner-driven run gives its (prefill, decode) sizes over the intervals instead."""
    if decode is None:
        sizes = prefill
        pools = (f"{min(p for p, _ in sizes)}-{max(p for p, _ in sizes)}P + "
                 f"{min(d for _, d in sizes)}-{max(d for _, d in sizes)}D") if sizes else "-"
    else:
        pools = f"{prefill}P+{decode}D"
    return {"label": label, "pools": pools, "prefill": prefill if decode is not None else None, "decode": decode,
            "slo_attainment": summary["slo_attainment"], "gpu_seconds": summary["gpu_seconds"]["provisioned"],
            "busy_gpu_seconds": summary["gpu_seconds"]["busy"], "ttft_p90_ms": summary["ttft_ms"]["p90"],
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "tpot_p90_ms": summary["tpot_ms"]["p90"],
            "hit_rate": summary["cache_hit_rate"], "refused": summary["refused"],
            "route_kinds": summary["route_kinds"]}


def cheapest(rows: list[dict], attainment: float) -> dict | None:
    """The fixed pools (of the sweep) that meet the SLOs with the fewest GPU-seconds."""
    met = [r for r in rows if r["label"].startswith("fixed") and r["slo_attainment"] >= attainment]
    return min(met, key=lambda r: (r["gpu_seconds"], -r["slo_attainment"]), default=None)


def print_pools(doc: dict, out: TextIO) -> None:
    c, t = doc["config"], doc["traffic"]
    slo = c["slo"]
    out.write(f"{c['requests']} requests of {c['trace']} ({t['rate_per_s']:.2f} req/s, mean prompt "
              f"{t['mean_isl']:,.0f}, output {t['mean_osl']:,.0f} tokens) on {c['tp']} x {c['gpu']} per worker "
              f"serving {c['model']}, policy {c['policy']}; SLO: {slo['attainment']:.0%} of requests within TTFT "
              f"{slo['ttft_s'] * 1e3:g} ms and TPOT {slo['tpot_s'] * 1e3:g} ms\n")
    out.write("| pools | workers | GPU-h | SLO attainment | meets | TTFT p50 / p90 (ms) | planner's TTFT p90: M/G/n / "
              "n x M/G/1 / old M/D/1 (ms) | TPOT p90 (ms) | hit rate |\n")
    out.write("|---|---|---|---|---|---|---|---|---|\n")
    best = cheapest(doc["rows"], slo["attainment"])
    for r in doc["rows"]:
        name = f"**{r['label']}** (cheapest)" if r is best else r["label"]
        out.write(f"| {name} | {r['pools']} | {r['gpu_seconds'] / 3600:,.2f} | {r['slo_attainment']:.1%} | "
                  f"{'yes' if r['slo_attainment'] >= slo['attainment'] else 'no'} | {r['ttft_p50_ms']:,.0f} / "
                  f"{r['ttft_p90_ms']:,.0f} | {_predicted(r)} | {r['tpot_p90_ms']:.1f} | {r['hit_rate']:.1%} |\n")
    out.write(f"queue model: {c.get('dispatch', 'pooled')}\n")
    seen = [h for h in doc.get("planner_history", ()) if "prefill_rate_per_s" in h]
    if seen:
        spread = lambda key: f"{min(key(h) for h in seen):.3g}-{max(key(h) for h in seen):.3g}"  # noqa: E731
        out.write(f"planner's windows: rate {spread(lambda h: h['rate_per_s'])} req/s, prefill pool's "
                  f"{spread(lambda h: h['prefill_rate_per_s'])} req/s, cached {spread(lambda h: h['cached_fraction'])}"
                  f", prefill correction {spread(lambda h: h['corrections']['prefill'])}\n")
    plans = doc["window_plans"]
    if plans:
        out.write(f"planner's raw sizes over {len(plans)} windows: prefill {min(w['prefill'] for w in plans)}-"
                  f"{max(w['prefill'] for w in plans)}, decode {min(w['decode'] for w in plans)}-"
                  f"{max(w['decode'] for w in plans)}\n")


def _predicted(row: dict) -> str:
    p = row.get("planner_ttft_p90_ms")
    if p is None:
        return "-"
    return " / ".join(f"{p[key]:,.0f}" if key in p else "-" for key in ("mgn_ms", "split_ms", "md1_split_ms"))


def plot(doc: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None

    fig, ax = plt.subplots(figsize=(8, 5))
    fixed = [r for r in doc["rows"] if r["label"].startswith("fixed")]
    ax.scatter([r["gpu_seconds"] / 3600 for r in fixed], [r["slo_attainment"] for r in fixed], c="tab:gray",
               label="fixed pools (sweep)")
    for r in fixed:
        ax.annotate(r["pools"], (r["gpu_seconds"] / 3600, r["slo_attainment"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    marks = {"plan (mean)": ("tab:blue", "s"), "plan (peak)": ("tab:orange", "D"), "planner": ("tab:red", "*")}
    for r in doc["rows"]:
        if r["label"] in marks:
            color, marker = marks[r["label"]]
            ax.scatter([r["gpu_seconds"] / 3600], [r["slo_attainment"]], c=color, marker=marker, s=120,
                       label=f"{r['label']}: {r['pools']}", zorder=3)
    goal = doc["config"]["slo"]["attainment"]
    ax.axhline(goal, color="tab:green", ls="--", lw=1, label=f"SLO goal {goal:.0%}")
    ax.set(xlabel="provisioned GPU-hours", ylabel="SLO attainment (share of requests within TTFT and TPOT)",
           title=f"Pools on {doc['config']['trace'].split('/')[-1]}: cost vs SLO attainment")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
