"""Layer-wise KV streaming through the whole serving path: time to the first *decode* token (issue 5).

One prefill and one decode worker (the "small" preset, tcp data plane unless ``--kv-transport``, one core each) behind two routers
on the same workers: one sends KV after the prefill (``Prefill``, today's default), the other with
``--kv-layerwise`` (``PrefillStream``: D pulls each layer while P computes the next). Each request is a
fresh random prompt under a fresh tenant salt (nothing cached anywhere), greedy, ``max_tokens=2``, so the
second token is D's first decode step. Per request, from the client: TTFT (P's first token, the same
path in both modes) and time to the second token (the pull and D's first step on top). Routers
alternate (who goes first rotates); medians per prompt length. Prints a table and writes
``bench/results/layerwise_serving.json``.

    python -m bench.layerwise_serving [--tokens 1024 2048 4000] [--runs 8] [--model DIR] [--kv-transport cma]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import grpc

from bench.launcher import Layout, Platform, core_plan
from bench.layerwise import MODES, mode_medians
from kv_transfer.ports import free_port
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc

RESULTS = Path(__file__).parent / "results" / "layerwise_serving.json"


def one_request(address: str, prompt: list[int], salt: str) -> dict:
    params = pb.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params, cache_salt=salt)
    stamps, final = [], None
    with grpc.insecure_channel(address) as channel:
        start = time.perf_counter()
        for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=300):
            stamps.extend([time.perf_counter()] * len(response.token_ids))
            final = response
    t = final.timings
    if len(stamps) != 2 or t.route_kind != "remote":
        raise RuntimeError(f"expected 2 tokens over a remote prefill, got {len(stamps)} ({t.route_reason})")
    return {"ttft_s": stamps[0] - start, "second_token_s": stamps[1] - start, "transfer_ms": t.transfer_ms,
            "prefill_ms": t.prefill_ms, "kv_layerwise": t.kv_layerwise, "num_bytes": t.transfer_bytes}


def run(args) -> dict:
    from engine.tiny import ensure_model

    model = Path(args.model) if args.model else ensure_model("small")
    rng = random.Random(0)
    cores = sorted(os.sched_getaffinity(0))[:2]
    plan = core_plan(Layout(name="1P+1D", prefill=1, decode=1), available=cores, router_core=cores[-1])
    worker_args = ["--kv-transport", args.kv_transport, "--max-num-batched-tokens", str(max(args.tokens) + 16),
                   "--num-blocks", str(4 * (max(args.tokens) // 16 + 8))]
    router_args = ["--policy", "least_loaded", "--disagg-threshold-tokens", "8"]
    runs = []
    with tempfile.TemporaryDirectory(prefix="baton-layerwise-") as logs, \
            Platform.start(plan, model, Path(logs), worker_args=worker_args, router_args=router_args) as platform:
        layerwise_port = free_port()
        platform.add_router("router-layerwise", [*router_args, "--kv-layerwise", "--port", str(layerwise_port)],
                            core=plan.router_core)
        addresses = {"after": platform.grpc_address, "layerwise": f"127.0.0.1:{layerwise_port}"}
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        for mode in MODES:  # warm-up: both paths, short prompt
            one_request(addresses[mode], [rng.randrange(vocab) for _ in range(64)], f"warm-{mode}")
        for num_tokens in args.tokens:
            for i in range(args.runs):
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    prompt = [rng.randrange(vocab) for _ in range(num_tokens)]
                    result = one_request(addresses[mode], prompt, f"{mode}-{num_tokens}-{i}")
                    result.update(mode=mode, num_tokens=num_tokens)
                    runs.append(result)
                    print(f"[{num_tokens} tokens, run {i + 1}/{args.runs}] {mode:9s} TTFT {result['ttft_s']:.3f} s, "
                          f"2nd token {result['second_token_s']:.3f} s, pull {result['transfer_ms']:.1f} ms", flush=True)
    return {"runs": runs, "summary": summarize(runs, args.tokens),
            "config": {"tokens": args.tokens, "runs": args.runs, "model": args.model or "small",
                       "kv_transport": args.kv_transport},
            "load_avg_1_5_15": os.getloadavg()}


def summarize(runs: list[dict], sizes: list[int]) -> list[dict]:
    rows = []
    for r in runs:
        r["gap_s"] = r["second_token_s"] - r["ttft_s"]
    for n in sizes:
        row = mode_medians(runs, n, ("ttft_s", "second_token_s", "transfer_ms", "gap_s"))
        row["gain_s"] = row["after_second_token_s"] - row["layerwise_second_token_s"]
        row["gap_gain_s"] = row["after_gap_s"] - row["layerwise_gap_s"]
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    cells = f"{'TTFT s':>7} {'2nd tok s':>9} {'gap ms':>7} {'pull ms':>8}"
    print(f"\n{'tokens':>6} {'KV MiB':>7} | {cells} | {cells} | {'gain ms':>8} {'gap gain ms':>11}")
    print(f"{'':15}| {'send after prefill':^36} | {'layer-wise (--kv-layerwise)':^36} |")
    for r in rows:
        parts = [f"{r[f'{m}_ttft_s']:7.3f} {r[f'{m}_second_token_s']:9.3f} {r[f'{m}_gap_s'] * 1e3:7.1f} "
                 f"{r[f'{m}_transfer_ms']:8.1f}" for m in MODES]
        print(f"{r['num_tokens']:6d} {r['num_bytes'] / 2**20:7.1f} | {parts[0]} | {parts[1]} | "
              f"{r['gain_s'] * 1e3:8.1f} {r['gap_gain_s'] * 1e3:11.1f}")
    print("medians; gap: 2nd token - TTFT (the pull's tail + D's first step); gain: of the time to the 2nd token; "
          "pull: D's pull, which under layer-wise includes waiting for P's layers")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.layerwise_serving", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4000], help="prompt lengths")
    parser.add_argument("--runs", type=int, default=8, help="requests per mode and prompt length")
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the small preset)")
    parser.add_argument("--kv-transport", default="tcp", choices=("tcp", "cma", "nccl"),
                        help="the workers' data plane, one that streams layers (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()}", flush=True)
    result = run(args)
    print_table(result["summary"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
