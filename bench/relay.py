"""Relay capacity: output tokens/s through one router (and through 2 router processes on one port) against the
worker's own stream, with synthetic fast workers, on uvloop and on asyncio's default loop.

    python -m bench relay [--concurrency 1 16 64 256] [--max-tokens 512] [--duration-s 3] [--warmup-s 1]
        [--loops uvloop asyncio] [--router-processes 1 2] [--apis grpc http] [--json OUT] [--plot PNG]

Every output token passes through the router process: read from the decode worker's ``Worker/Decode`` stream,
detokenized, written to the client's ``Generate`` stream (or its SSE stream). The worker here is
``bench.relay_worker``: a real process serving ``baton.v1.Worker`` over real gRPC, registered in a private
redis-server like a real decode worker, whose engine is no model (it streams each request's tokens as fast as
the stream takes them), so the figures are the plumbing's: router, gRPC, event loop. Per concurrency the client
(this process, on uvloop) runs that many streams of ``--max-tokens`` tokens each, back to back, and counts what
arrives in the window; the router's CPU time over the window (``psutil``, every process of it) gives tokens per
router core-second, the figure that does not depend on what else shares this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.relay_load import GrpcStreams, HttpStreams, Point, measure
from bench.relay_worker import text_lengths
from deploy.up import Child, start_redis, stop_all
from engine.tokenizer import Tokenizer
from kv_transfer.ports import free_port

RESULTS = Path(__file__).parent / "results" / "relay.json"
NS = "relay"


class Processes:
    """The bench's children (redis, the synthetic worker, the router), each stopped by PID."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.children = log_dir, []
        self.redis_url = start_redis(log_dir, self.children)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        with (self.log_dir / f"{name}.log").open("wb") as log:
            popen = subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
        self.children.append(Child(name, popen))
        return popen

    def stop(self, name: str) -> None:
        stop_all([c for c in self.children if c.name == name], grace_s=10)
        self.children = [c for c in self.children if c.name != name]

    def wait_for_line(self, name: str, text: str, timeout_s: float = 60.0) -> str:
        deadline, path = time.monotonic() + timeout_s, self.log_dir / f"{name}.log"
        while time.monotonic() < deadline:
            log = path.read_text(errors="replace")
            if text in log:
                return log
            child = next(c for c in self.children if c.name == name)
            if child.popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {child.popen.returncode}:\n{log[-2000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{name} did not print {text!r} in {timeout_s:.0f} s (log: {path})")

    def close(self) -> None:
        stop_all(self.children, grace_s=10)


def _loop_flag(loop: str) -> list[str]:
    return [] if loop == "uvloop" else ["--no-uvloop"]


def start_worker(procs: Processes, model: Path, loop: str, tokens_per_message: int = 1) -> tuple[str, int]:
    port = free_port()
    popen = procs.start("worker", ["bench.relay_worker", "--redis-url", procs.redis_url, "--ns", NS, "--port",
                                   str(port), "--model", str(model), "--tokens-per-message", str(tokens_per_message),
                                   *_loop_flag(loop)])
    log = procs.wait_for_line("worker", "ready:")
    assert f"loop={loop}" in log, log
    return f"127.0.0.1:{port}", popen.pid


def start_router(procs: Processes, model: Path, loop: str, processes: int) -> tuple[str, str, list[int]]:
    grpc_port, http_port = free_port(), free_port()
    argv = ["deploy.cli", "router", "--redis-url", procs.redis_url, "--ns", NS, "--model", str(model),
            "--host", "127.0.0.1", "--port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", "0",
            "--log-level", "WARNING", *_loop_flag(loop)]
    if processes > 1:
        argv += ["--processes", str(processes)]
    popen = procs.start("router", argv)
    deadline = time.monotonic() + 90
    while procs.wait_for_line("router", "baton router listening", timeout_s=90).count("listening on") < processes:
        if time.monotonic() > deadline:  # each process prints its own line once it listens
            raise TimeoutError(f"not all {processes} router processes started (log: {procs.log_dir})")
        time.sleep(0.1)
    pids = [popen.pid, *(child.pid for child in psutil.Process(popen.pid).children())]
    return f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}", pids


async def sweep(path: str, make: Any, pids: dict[str, int], args: argparse.Namespace) -> list[list[Point]]:
    """Per concurrency, ``--repeat`` consecutive windows of the same streams."""
    out = []
    for concurrency in args.concurrency:
        streams = make(concurrency)
        try:
            await measure(streams, concurrency, path=path, pids=pids, max_tokens=args.max_tokens, warmup_s=0.0,
                          duration_s=0.3)  # connect every channel
            points = await measure(streams, concurrency, path=path, pids=pids, max_tokens=args.max_tokens,
                                   warmup_s=args.warmup_s, duration_s=args.duration_s, windows=args.repeat)
        finally:
            await streams.close()
        for point in points:
            print(f"  {path:<22} c={concurrency:<4} {point.tokens_per_s:>9,.0f} tok/s  "
                  f"{point.messages / max(point.tokens, 1):.2f} msg/token  "
                  + "  ".join(f"{k} {point.cores(k):.2f} cores" for k in sorted(point.cpu_s) if k != "machine")
                  + f"  others {point.other_cores:.2f} cores", flush=True)
        out.append(points)
    return out


async def run(args: argparse.Namespace, model: Path, procs: Processes) -> list[dict[str, Any]]:
    rows = []
    channels = args.channels
    lengths = text_lengths(Tokenizer.from_pretrained(model), args.max_tokens) if "http" in args.apis else []
    for loop in args.loops:
        worker_address, worker_pid = start_worker(procs, model, loop, args.tokens_per_message)
        direct = await sweep(f"direct/{loop}", lambda c: GrpcStreams(
            worker_address, direct=True, num_channels=min(c, channels)),
            {"worker": worker_pid}, args)
        rows += [_row(p, loop, 0, "grpc") for p in direct]
        for processes in args.router_processes:
            grpc_address, http_address, router_pids = start_router(procs, model, loop, processes)
            pids = {"worker": worker_pid, **{f"router{i}": pid for i, pid in enumerate(router_pids)}}
            for api in args.apis:
                if api == "grpc":
                    make = lambda c: GrpcStreams(grpc_address, direct=False,  # noqa: E731
                                                 num_channels=min(c, channels))
                else:
                    make = lambda c: HttpStreams(http_address, text_lengths=lengths)  # noqa: E731
                points = await sweep(f"router x{processes}/{api}/{loop}", make, pids, args)
                rows += [_row(p, loop, processes, api) for p in points]
            procs.stop("router")
        procs.stop("worker")
    return rows


def _row(points: list[Point], loop: str, router_processes: int, api: str) -> dict[str, Any]:
    """The window of median tokens/s; tokens per router core-second is the median over the windows on its own."""
    def router_cpu_s(point: Point) -> float:
        return sum(v for k, v in point.cpu_s.items() if k.startswith("router"))

    point = sorted(points, key=lambda p: p.tokens_per_s)[len(points) // 2]
    per_core = [p.tokens / router_cpu_s(p) for p in points if router_cpu_s(p) > 0]
    return {
        "path": "direct" if router_processes == 0 else "router", "api": api, "loop": loop,
        "router_processes": router_processes, "concurrency": point.concurrency,
        "tokens_per_s": round(point.tokens_per_s, 1), "messages_per_token": round(point.messages / max(point.tokens, 1), 3),
        "requests": point.requests, "seconds": round(point.seconds, 3),
        "router_cores": round(router_cpu_s(point) / point.seconds, 3), "worker_cores": round(point.cores("worker"), 3),
        "router_cores_each": [round(point.cores(f"router{i}"), 3) for i in range(router_processes)],
        "client_cores": round(point.cores("client"), 3),
        "tokens_per_router_core_s": round(statistics.median(per_core), 1) if per_core else None,
        "loadavg_1m": round(point.loadavg_1m, 2), "other_cores": round(max(p.other_cores for p in points), 2),
        "tokens_per_s_windows": [round(p.tokens_per_s) for p in points],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench relay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per request (default: %(default)s)")
    parser.add_argument("--duration-s", type=float, default=3.0, help="measured window per point")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="streams run this long before the window")
    parser.add_argument("--repeat", type=int, default=3,
                        help="windows per point, back to back; the table shows the median (default: %(default)s)")
    parser.add_argument("--loops", nargs="+", choices=["uvloop", "asyncio"], default=["uvloop", "asyncio"],
                        help="event loop of the router and the worker (the client always runs on uvloop)")
    parser.add_argument("--router-processes", type=int, nargs="+", default=[1, 2],
                        help="router processes sharing one port (`baton router --processes N`)")
    parser.add_argument("--apis", nargs="+", choices=["grpc", "http"], default=["grpc"],
                        help="through the router: Generation/Generate, or the OpenAI front's SSE stream")
    parser.add_argument("--tokens-per-message", type=int, default=1,
                        help="tokens in each of the worker's Decode messages: 1 as a decode step sends them; more, as "
                        "speculative decoding (or a worker coalescing its own stream) would")
    parser.add_argument("--channels", type=int, default=8, help="client connections per path (at most one per stream)")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of tokens/s against concurrency")
    args = parser.parse_args(argv)
    from bench.relay_report import plot, print_table
    from engine.tiny import ensure_model
    from proto import event_loop

    model = ensure_model("tiny")
    procs = Processes(Path(tempfile.mkdtemp(prefix="baton-relay-")))
    load = os.getloadavg()
    try:
        rows = event_loop.run(run(args, model, procs), use_uvloop=True)
    finally:
        procs.close()
    report = {"cpus": os.cpu_count(), "loadavg_before": load, "loadavg_after": os.getloadavg(),
              "max_tokens": args.max_tokens, "tokens_per_message": args.tokens_per_message, "duration_s": args.duration_s, "rows": rows}
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    if args.plot is not None:
        if plot(report, args.plot):
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
