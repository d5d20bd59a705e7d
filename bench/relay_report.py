"""``bench relay``'s table and plot: tokens/s against concurrency, per path (direct, router x N, per API and
event loop), with the router's cores and tokens per router core-second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workload.plots import pyplot


def _label(row: dict[str, Any]) -> str:
    if row["path"] == "direct":
        return f"direct ({row['loop']})"
    return f"router x{row['router_processes']} {row['api']} ({row['loop']})"


def print_table(report: dict[str, Any]) -> None:
    load = ", ".join(f"{x:.2f}" for x in report["loadavg_before"])
    print(f"\n{report['cpus']} CPU cores; load average before {load}; {report['max_tokens']} tokens per request")
    print(f"{'path':<28} {'streams':>7} {'tok/s':>9} {'msg/tok':>7} {'router cores':>12} {'tok/router core-s':>17} "
          f"{'worker cores':>12} {'client cores':>12} {'others':>6} {'load':>5}")
    for row in report["rows"]:
        per_core = row["tokens_per_router_core_s"]
        print(f"{_label(row):<28} {row['concurrency']:>7} {row['tokens_per_s']:>9,.0f} {row['messages_per_token']:>7.2f} "
              f"{row['router_cores']:>12.2f} {(f'{per_core:,.0f}' if per_core else '-'):>17} "
              f"{row['worker_cores']:>12.2f} {row['client_cores']:>12.2f} "
              f"{row.get('other_cores', 0):>6.2f} {row.get('loadavg_1m', 0):>5.1f}")


def plot(report: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None

    series: dict[str, list[dict[str, Any]]] = {}
    for row in report["rows"]:
        series.setdefault(_label(row), []).append(row)
    kinds = sorted({label.rsplit(" (", 1)[0] for label in series})  # one colour per path, a line style per loop
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in series.items():
        colour = f"C{kinds.index(label.rsplit(' (', 1)[0])}"
        style = ("s" if label.startswith("direct") else "o") + ("-" if rows[0]["loop"] == "uvloop" else ":")
        xs = [r["concurrency"] for r in rows]
        left.plot(xs, [r["tokens_per_s"] for r in rows], style, color=colour, label=label)
        if not label.startswith("direct"):
            right.plot(xs, [r["tokens_per_router_core_s"] or 0 for r in rows], style, color=colour, label=label)
    left.set(xscale="log", xlabel="concurrent streams", ylabel="tokens/s (all streams)",
             title=f"relay throughput ({report['cpus']} cores, shared by client, router, worker)")
    right.set(xscale="log", xlabel="concurrent streams", ylabel="tokens per router CPU-second",
              title="router capacity per core")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
