"""A remote prompt's KV moved by Baton's connector for vLLM against Baton's own workers, same bytes, same transport.

``python -m bench vllm-transfer [--model smollm2] [--tokens 512,1024,2000] [--reps 5] [--kv-transport tcp]``

Two ``baton up`` (one prefill, one decode worker each), started one after the other: Baton's engine, then vLLM's
(``--engine vllm --vllm-kv-connector baton``). Every prompt is fresh random token ids (no prefix cache anywhere)
sent through the router's gRPC with the threshold at 0 (always remote), 2 new tokens; each decode worker reports
its pull in ``Timings`` (bytes, and the seconds ``KVClient.pull`` took, request to last byte, on both engines). The
table gives the median per prompt length and the ratio vLLM/Baton of time and of GB/s (vLLM moves whole 128-token
blocks, Baton 16-token ones: the bytes differ a little, so compare GB/s too). Issue 38's goal: time <= 1.5x.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import grpc

from bench.trace_replay.up import ROOT, Up
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc

TARGETS = {"baton": [], "baton-vllm": ["--engine", "vllm", "--vllm-kv-connector", "baton"]}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench vllm-transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", default="512,1024,2000", help="prompt lengths (comma-separated)")
    parser.add_argument("--reps", type=int, default=5, help="prompts per length (after one warm-up)")
    parser.add_argument("--kv-transport", default="tcp", help="tcp or cma (both targets)")
    parser.add_argument("--vocab", type=int, default=49152, help="token ids drawn below this")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm_transfer.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    lengths = [int(n) for n in args.tokens.split(",")]
    flags = ["--max-model-len", "4096", "--num-threads", "1", "--kv-transport", args.kv_transport,
             "--disagg-threshold-tokens", "0", "--policy", "least_loaded"]
    runs: dict[str, dict[int, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-transfer-") as work:
        for name, extra in TARGETS.items():
            print(f"[{name}] starting baton up ...", file=sys.stderr, flush=True)
            up = Up.start(args.model, flags + extra, Path(work) / name, prefill=1, decode=1, ready_timeout_s=600)
            try:
                runs[name] = _measure(up.grpc_address, lengths, args, name)
            finally:
                up.stop()
    report = {"kv_transport": args.kv_transport, "model": args.model, "reps": args.reps, "runs": runs,
              "summary": summary(runs)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report))
    return 0


def _measure(address: str, lengths: list[int], args, name: str) -> dict[int, list[dict]]:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    rng = random.Random(f"{name}-{args.kv_transport}")
    out: dict[int, list[dict]] = {}
    for n in lengths:
        out[n] = []
        for rep in range(args.reps + 1):  # the first warms the connections
            prompt = [rng.randrange(100, args.vocab) for _ in range(n)]
            params = pb.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            last = None
            for last in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params),
                                      timeout=300):
                pass
            t = last.timings
            if t.route_kind != "remote" or t.local_fallback or t.transfer_bytes <= 0:
                raise SystemExit(f"[{name}] a {n}-token prompt did not move its KV: {t}")
            if rep:
                out[n].append({"bytes": t.transfer_bytes, "ms": t.transfer_ms, "transport": t.transport})
            print(f"[{name}] {n} tokens: {t.transfer_bytes / 1e6:.1f} MB in {t.transfer_ms:.1f} ms ({t.transport})",
                  file=sys.stderr, flush=True)
    return out


def summary(runs: dict[str, dict[int, list[dict]]]) -> list[dict]:
    rows = []
    for n in runs["baton"]:
        row = {"tokens": n}
        for name in runs:
            pulls = runs[name][n]
            ms = statistics.median(p["ms"] for p in pulls)
            num_bytes = statistics.median(p["bytes"] for p in pulls)
            row[name] = {"ms": ms, "bytes": num_bytes, "gbps": num_bytes / ms / 1e6, "transport": pulls[0]["transport"]}
        row["time_ratio"] = row["baton-vllm"]["ms"] / row["baton"]["ms"]
        row["gbps_ratio"] = row["baton-vllm"]["gbps"] / row["baton"]["gbps"]
        rows.append(row)
    return rows


def table(report: dict) -> str:
    lines = [f"KV pull per remote prompt, median of {report['reps']}, --kv-transport {report['kv_transport']}",
             "| prompt tokens | Baton workers: MB, ms, GB/s | vLLM workers, Baton connector: MB, ms, GB/s "
             "| time vLLM/Baton | GB/s vLLM/Baton |", "|---:|---:|---:|---:|---:|"]
    for row in report["summary"]:
        b, v = row["baton"], row["baton-vllm"]
        lines.append(f"| {row['tokens']} | {b['bytes'] / 1e6:.1f}, {b['ms']:.1f}, {b['gbps']:.2f} "
                     f"| {v['bytes'] / 1e6:.1f}, {v['ms']:.1f}, {v['gbps']:.2f} "
                     f"| {row['time_ratio']:.2f}x | {row['gbps_ratio']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
