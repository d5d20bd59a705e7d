"""What a replay reports: one line per run, a markdown table of the runs, a plot; the machine's load."""

from __future__ import annotations

import math
from pathlib import Path

from workload.plots import pyplot


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


def line_of(run_: dict, block_size: int = 16) -> str:
    c = run_.get("counters", {})
    host = sum(w.get("kv_host_tier_loaded", 0) for w in c.values() if isinstance(w, dict)) * block_size
    store = sum(w.get("kv_store_blocks_fetched", 0) for w in c.values() if isinstance(w, dict)) * block_size
    return (f"[{label(run_)}] {run_['completed']}/{run_['requests']} ok, hit rate {run_['hit_rate']:.3f} "
            f"({run_['cached_tokens']}/{run_['prompt_tokens']} prompt tokens; host loads {host:.0f}, store fetches "
            f"{store:.0f} tokens), TTFT p50 {run_['ttft_ms']['p50']:.1f} ms p90 {run_['ttft_ms']['p90']:.1f} ms, "
            f"{run_['requests_per_s']:.2f} req/s, {run_['output_tokens_per_s']:.1f} out tok/s over "
            f"{run_['duration_s']:.0f} s; load {run_['loadavg_before']} -> {run_['loadavg_after']}"
            + (f"; errors {run_['errors']}" if run_["errors"] else ""))


def label(run_: dict) -> str:
    return f"{run_['config']} #{run_['pass_']}" if run_.get("passes", 1) > 1 else run_["config"]


def table(report: dict) -> str:
    """The runs as a markdown table, the oracle's hit rate and TTFT as the reference."""
    runs = {(r["config"], r.get("pass_", 1)): r for r in report["runs"]}
    rows = ["| configuration | hit rate | vs (a) | vs oracle | TTFT p50 ms | p90 ms | p50 vs oracle | reusable p50 ms "
            "| vs oracle | req/s | out tok/s | failed | load avg |", "|---" * 13 + "|"]
    def reuse(r):
        return r.get("ttft_reusable_ms", {}).get("p50", math.nan)

    for r in report["runs"]:
        def ratio(a, b):
            return f"{a / b:.2f}x" if b and not math.isnan(b) and not math.isnan(a) else "-"
        base, oracle = runs.get(("none", r.get("pass_", 1))), runs.get(("oracle", r.get("pass_", 1)))
        rows.append(
            f"| {label(r)} | {r['hit_rate']:.1%} | {ratio(r['hit_rate'], base['hit_rate']) if base else '-'} | "
            f"{ratio(r['hit_rate'], oracle['hit_rate']) if oracle else '-'} | {r['ttft_ms']['p50']:.1f} | "
            f"{r['ttft_ms']['p90']:.1f} | {ratio(r['ttft_ms']['p50'], oracle['ttft_ms']['p50']) if oracle else '-'} | "
            f"{reuse(r):.1f} | {ratio(reuse(r), reuse(oracle)) if oracle else '-'} | "
            f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['requests'] - r['completed']} | "
            f"{r['loadavg_before']} -> {r['loadavg_after']} |")
    return "\n".join(rows)


def plot(report: dict, path: Path) -> Path | None:
    """Hit rate (with the trace's ceiling), TTFT p50/p90 (with the load average at each run's start and end: this
    machine is shared) and output throughput, one bar per run."""
    plt = pyplot()
    if plt is None:
        return None
    runs = report["runs"]
    names = [label(r) for r in runs]
    x = list(range(len(runs)))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(max(15, 2.2 * len(runs)), 4.5))
    _hit_rate_panel(a, runs, report["slice"].get("ceiling_hit_rate"))
    _ttft_panel(b, runs)
    c.bar(x, [r["output_tokens_per_s"] for r in runs], color="tab:green")
    c.set(ylabel="output tokens/s", title="throughput (open loop: the offered load unless saturated)")
    fig.suptitle(_title(report), fontsize=9)
    for ax in (a, b, c):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _hit_rate_panel(ax, runs: list[dict], ceiling: float | None) -> None:
    ax.bar(list(range(len(runs))), [r["hit_rate"] * 100 for r in runs], color="tab:blue")
    if ceiling:
        ax.axhline(ceiling * 100, color="k", ls="--", lw=1, label="unbounded-cache ceiling (from the trace)")
        ax.legend(loc="upper left", fontsize=8)
    ax.set(ylabel="prompt tokens served from cache (%)", title="cache hit rate (as the workers report it)")


def _ttft_panel(ax, runs: list[dict]) -> None:
    x = list(range(len(runs)))
    ax.bar([i - 0.2 for i in x], [r["ttft_ms"]["p50"] for r in runs], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [r["ttft_ms"]["p90"] for r in runs], 0.4, label="p90")
    for i, r in enumerate(runs):
        loads = f"{r['loadavg_before'].split()[0]}-{r['loadavg_after'].split()[0]}"
        ax.annotate(f"load\n{loads}", (i, r["ttft_ms"]["p90"]), ha="center", va="bottom", fontsize=7)
    ax.set(ylabel="TTFT (ms)", title="TTFT (1-min load average of the machine, start-end)")
    ax.set_ylim(0, 1.25 * max(r["ttft_ms"]["p90"] for r in runs))
    ax.legend(loc="upper left", fontsize=8)


def _title(report: dict) -> str:
    s = report["slice"]
    return (f"{s['requests']} requests of {Path(s['trace']).name} from #{s['start']}, lengths / "
            f"{s['length_scale']}, time x {s['time_scale']}; model {report['model']}, KV pool "
            f"{report['num_blocks']} blocks/worker, host tier {report['host_blocks']}; client "
            f"{report.get('client', 'grpc')}")
