"""``baton simulate check``'s output: the comparison table, the rankings, the fitted terms and what each is worth
(the simulator with one calibrated term taken away at a time). Pure apart from writing to ``out``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TextIO

from sim.calibration import FIGURES, Calibration


def ablations(calibration: Calibration, per_stream_s: float) -> dict[str, Calibration]:
    """The calibrated model less one term at a time, less all of them (the profile's curves as they are), and plus
    the router's growth with requests in flight as the training replay fitted it (``per_stream_s``: not in the
    calibrated model, see docs/benchmarks.md)."""
    off = dict(step_overhead_s=0.0, router_s=0.0, cores=None, background=0.0)
    out = {f"without {name}": dataclasses.replace(calibration, **{field: off[field]})
           for name, field in (("the step overhead", "step_overhead_s"), ("the router's time", "router_s"),
                               ("the background load", "background"), ("shared cores", "cores"))}
    out["with the router beside the background only (not the busy workers)"] = dataclasses.replace(
        calibration, router_beside_workers=False)
    out["without the loaded hops"] = dataclasses.replace(calibration, local_return_s=0.0, remote_return_s=0.0,
                                                         local_handoff_s=0.0)
    out["without D's local hand-off"] = dataclasses.replace(calibration, local_handoff_s=0.0)
    out["curves only"] = dataclasses.replace(calibration, **off, local_return_s=0.0, remote_return_s=0.0,
                                             local_handoff_s=0.0)
    out["with the router's growth per request in flight"] = dataclasses.replace(calibration,
                                                                                router_per_stream_s=per_stream_s)
    return out


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:+.0%}"


def _abs(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def comparison_rows(comparison: dict[str, Any]) -> list[str]:
    head = ("| policy | TTFT p50 real / sim (ms) | error | TTFT p90 real / sim (ms) | error | hit rate real / sim "
            "| error |")
    rows = [head, "|---" * 7 + "|"]
    for name, row in comparison["policies"].items():
        cells = []
        for f in FIGURES:
            real, sim = row[f]["real"], row[f]["sim"]
            cells.append(f"{real:.1%} / {sim:.1%}" if f == "hit_rate" else f"{real:,.1f} / {sim:,.1f}")
            cells.append(_pct(row[f]["error"]))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def ranking_lines(comparison: dict[str, Any]) -> list[str]:
    lines = []
    for f, r in comparison["rankings"].items():
        verdict = "same" if r["same"] else f"differs ({r['pairs_in_order']:.0%} of pairs in the same order)"
        lines.append(f"ranking by {f} (best first): real {' > '.join(r['real'])}; sim {' > '.join(r['sim'])}: "
                     f"{verdict}")
    return lines


def ablation_rows(ablated: dict[str, dict[str, Any]], full: dict[str, Any]) -> list[str]:
    policies = list(full["policies"])
    rows = ["| simulator | " + " | ".join(f"{p} TTFT p50 error" for p in policies) + " | worst | p50 ranking |",
            "|---" * (len(policies) + 3) + "|"]
    for label, comparison in {"calibrated": full, **ablated}.items():
        errors = [_pct(comparison["policies"][p]["ttft_p50_ms"]["error"]) for p in policies]
        same = comparison["rankings"]["ttft_p50_ms"]["same"]
        rows.append(f"| {label} | " + " | ".join(errors) + f" | {_abs(comparison['worst_ttft_p50_error'])} | "
                    f"{'same' if same else 'differs'} |")
    return rows


def print_check(doc: dict[str, Any], out: TextIO) -> None:
    w, lay = doc["workload"], doc["layout"]
    out.write(f"{w['requests']} requests of {w['trace']} (lengths / {w['length_scale']}, arrivals x "
              f"{w['time_scale']:g}) on {lay['prefill']} prefill + {lay['decode']} decode workers of the tiny model, "
              f"{lay['num_blocks']} KV blocks each\n\nfitted terms:\n")
    for term in doc["calibration"]["terms"]:
        value = (f"{term['cores']} cores" if "cores" in term else "per policy, see the loads below"
                 if "background" in term else f"{term['value_ms']:.2f} ms")
        out.write(f"  {term['term']}: {value}  ({term['from']})\n")
    out.write("\n" + "\n".join(comparison_rows(doc["comparison"])) + "\n")
    out.write("\n".join(ranking_lines(doc["comparison"])) + "\n")
    out.write(f"worst TTFT p50 error: {_abs(doc['comparison']['worst_ttft_p50_error'])} (target within 20%)\n")
    loads = {name: f"{r['loadavg_before']} -> {r['loadavg_after']}" + (
        f" (runnable: ours {r['runnable']['ours']:.1f}, others {r['runnable']['others']:.1f})" if "runnable" in r
        else "") for name, r in doc["real"].items()}
    out.write("load average during the real runs: " + "; ".join(f"{n} {v}" for n, v in loads.items()) + "\n")
    out.write("\nwhat each calibrated term is worth (the simulator without it; the last row adds one it leaves out):\n")
    out.write("\n".join(ablation_rows(doc["ablations"], doc["comparison"])) + "\n")
