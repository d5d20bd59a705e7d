"""Router overhead: latency of a request through the router vs calling the decode worker directly.

    python -m bench.router_overhead [--requests 300] [--max-tokens 1]

Starts a private redis-server, one decode worker and the router (the tiny model, 1 torch thread),
then sends the same short prompt sequentially both ways over persistent channels and reports
p50/p99 end-to-end latency and the router's added milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from deploy.up import Child, spawn, start_redis, stop_all
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc

RESULTS = Path(__file__).parent / "results" / "router_overhead.json"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_calls(call, n: int) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        call(i)
        out.append((time.perf_counter() - started) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=1)
    args = p.parse_args(argv)
    from engine.tiny import ensure_model

    model = str(ensure_model("tiny"))
    log_dir = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    children: list[Child] = []
    try:
        redis_url = start_redis(log_dir, children)
        decode_port, router_port = 50761, 50762
        spawn("decode", ["decode", "--redis-url", redis_url, "--model", model, "--port", str(decode_port),
                         "--num-threads", "1", "--worker-id", "d0"], log_dir, children)
        spawn("router", ["router", "--redis-url", redis_url, "--model", model, "--port", str(router_port),
                         "--http-port", "0", "--metrics-port", "0"],
              log_dir, children)
        return _measure(args, f"127.0.0.1:{decode_port}", f"127.0.0.1:{router_port}")
    finally:
        stop_all(children)


def _measure(args, decode_address: str, router_address: str) -> int:
    worker = pb_grpc.WorkerStub(grpc.insecure_channel(decode_address))
    router = pb_grpc.GenerationStub(grpc.insecure_channel(router_address))
    grpc.channel_ready_future(grpc.insecure_channel(router_address)).result(timeout=90)
    prompt = list(range(10, 42))
    params = pb.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    _wait_routable(router, prompt, params)

    def direct(i: int) -> None:
        list(worker.Decode(pb.DecodeRequest(request_id=f"b{i}", token_ids=prompt, sampling=params)))

    def routed(i: int) -> None:
        list(router.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)))

    _time_calls(direct, 20), _time_calls(routed, 20)  # warm up both paths
    direct_ms, routed_ms = [], []
    for _ in range(args.requests // 50):  # interleave so drift hits both alike
        direct_ms += _time_calls(direct, 50)
        routed_ms += _time_calls(routed, 50)
    report = {
        "requests": len(direct_ms), "max_tokens": args.max_tokens,
        "direct_p50_ms": statistics.median(direct_ms), "direct_p99_ms": _percentile(direct_ms, 0.99),
        "router_p50_ms": statistics.median(routed_ms), "router_p99_ms": _percentile(routed_ms, 0.99),
    }
    report["added_p50_ms"] = report["router_p50_ms"] - report["direct_p50_ms"]
    report["added_p99_ms"] = report["router_p99_ms"] - report["direct_p99_ms"]
    for key, value in report.items():
        print(f"{key:>16}: {value:.2f}" if isinstance(value, float) else f"{key:>16}: {value}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    return 0


def _wait_routable(router, prompt, params, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            list(router.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)))
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
