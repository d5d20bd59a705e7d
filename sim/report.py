"""``baton simulate``'s output: the table, the explained terms, the JSON document and the plots (the shell's I/O)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from workload.plots import pyplot
from sim.metrics import RequestRecord

nan = float("nan")

COLUMNS = ("policy", "scale", "req/s", "done", "refused", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "ITL p50",
           "p99", "SLO att.", "good req/s", "hit rate", "KV GB", "remote/local", "GPU-h", "busy", "decide p50/p99 ms",
           "wall s")


def run_row(run: dict) -> list[str]:
    s = run["summary"]
    kinds = s["route_kinds"]
    gpu = s["gpu_seconds"]
    return [run["policy"], f"{run['time_scale']:g}", f"{s['request_rate']:.2f}", str(s["finished"]), str(s["refused"]),
            *(_ms(s["ttft_ms"][p]) for p in ("p50", "p90", "p99")), *(_ms(s["tpot_ms"][p]) for p in ("p50", "p90")),
            *(_ms(s["itl_ms"][p]) for p in ("p50", "p99")), f"{s['slo_attainment']:.1%}", f"{s['good_rps']:.2f}",
            f"{s['cache_hit_rate']:.1%}", f"{s['kv_bytes_moved'] / 1e9:,.1f}",
            f"{kinds.get('remote', 0)}/{kinds.get('local', 0)}",
            f"{gpu['provisioned'] / 3600:,.2f}", f"{gpu['busy'] / max(gpu['provisioned'], 1e-9):.1%}",
            f"{run['decision_ms'].get('p50', nan):.2f}/{run['decision_ms'].get('p99', nan):.2f}", f"{run['wall_s']:.1f}"]


def table(runs: Sequence[dict]) -> str:
    rows = [list(COLUMNS)] + [run_row(r) for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]]) + "\n"


def print_report(doc: dict, out: TextIO, *, explain: bool) -> None:
    c = doc["config"]
    out.write(f"{c['prefill_workers']} prefill + {c['decode_workers']} decode workers of {c['tp']} x {c['gpu']} "
              f"serving {c['model']} ({c['num_blocks']:,} KV blocks of {c['block_size']} tokens each, "
              f"{c['kv_bytes_per_block'] / 2**20:,.1f} MiB per block); links {_link(c['intra_link'])} within a host, "
              f"{_link(c['inter_link'])} between hosts; time model: {c['time_model']}; workload {c['workload']}\n")
    if explain:
        out.write(explain_text(doc["explain"]))
        out.write("planner (router.admin.planner on these curves and this traffic):\n" + doc["planner"]["explain"] + "\n")
    out.write(table(doc["runs"]))
    for policy, rate in doc.get("distserve_goodput", {}).items():
        out.write(f"DistServe goodput of {policy}: " + ("no rate met" if rate is None else f"{rate:.2f} req/s") +
                  f" (>= {c['slo']['attainment']:.0%} of requests within TTFT {c['slo']['ttft_ms']:g} ms and "
                  f"TPOT {c['slo']['tpot_ms']:g} ms)\n")


def explain_text(explain: dict) -> str:
    lines = ["time model terms (per step):"]
    for name, terms in explain.items():
        if isinstance(terms, dict):
            parts = ", ".join(f"{k} {_num(v)}" for k, v in terms.items())
            lines.append(f"  {name}: {parts}")
        else:
            lines.append(f"  {name}: {_num(terms)}")
    return "\n".join(lines) + "\n"


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def plot(runs: Sequence[tuple[dict, list[RequestRecord]]], path: Path) -> Path | None:
    """TTFT CDFs of each run at the first time scale, and SLO attainment against the request rate per policy.
    The path written, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None

    fig, (cdf, sweep) = plt.subplots(1, 2, figsize=(12, 4.5))
    first_scale = runs[0][0]["time_scale"]
    for run, records in runs:
        if run["time_scale"] != first_scale:
            continue
        ttfts = sorted(r.ttft_s for r in records if r.ttft_s is not None)
        if ttfts:
            cdf.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=run["policy"])
    cdf.set(xscale="log", xlabel="TTFT (s)", ylabel="share of requests", title=f"TTFT at time scale {first_scale:g}")
    cdf.grid(alpha=0.3)
    cdf.legend()
    for policy in dict.fromkeys(run["policy"] for run, _ in runs):
        points = sorted((run["summary"]["request_rate"], run["summary"]["slo_attainment"])
                        for run, _ in runs if run["policy"] == policy)
        sweep.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
    sweep.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(0, 1.05), title="SLO attainment")
    sweep.grid(alpha=0.3)
    sweep.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _link(link: dict) -> str:
    return f"{link['name']} ({link['gb_per_s']:g} GB/s, {link['latency_s'] * 1e6:g} us)"


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _num(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
