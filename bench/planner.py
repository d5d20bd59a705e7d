"""The pool planner under a changing load: planner-driven pools vs a fixed pool sized for the peak.

    python -m bench planner [--preset tiny|small] [--phases 2:40,12:70,2:80] [--interval-s 15]
                            [--slo-ttft-ms 500] [--slo-itl-ms 60] [--max-prefill 1] [--max-decode 2]
                            [--no-profile] [--out bench/results]

Starts ``baton up`` (1 prefill + 1 decode worker, 1 torch thread each), runs ``baton admin profile`` so the
planner has measured curves, then drives the same piecewise-constant Poisson load (``--phases`` of
``RATE:SECONDS``, synthetic ShareGPT-like prompts, streaming gRPC) twice:

- **planner**: every ``--interval-s`` the router's ``Admin/Plan`` runs on the traffic it saw in the last
  interval (``from_traffic``: rate, ISL, OSL and the measured correction factors); the plan is clamped to
  ``--max-prefill`` / ``--max-decode`` and set with ``Admin/ScalePool`` (the router's planner has no size
  cap of its own, so ``Plan(apply=True)`` could ask this machine for more workers than it has cores);
  ``baton up`` then starts or drains workers.
- **fixed**: both pools set to the maximum sizes, no planning.

Pool sizes (``Admin/GetPools``: desired in Redis, actual = registered workers) are sampled every
``--sample-s``. Per interval: TTFT p90 of the requests sent in it (a failed request counts as infinite) and
ITL p90 of the token gaps that ended in it; an interval meets the SLO when both p90s are within it.
Worker-seconds integrate the registered workers over the run. Writes ``planner.json`` and ``planner.png``
(pool sizes and load rate; p90s against the SLO lines) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.client import greedy_request, stream_generate
from bench.launcher import ROOT
from workload.plots import pyplot
from workload.synthetic import sharegpt_like
from kv_transfer.ports import free_port

ROLES = ("prefill", "decode")
TARGET_ATTAINMENT = 0.9


# ---- schedule (pure) ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Phase:
    rate_per_s: float
    duration_s: float


def parse_phases(text: str) -> tuple[Phase, ...]:
    """``"2:40,12:70,2:80"`` -> phases of (requests/s, seconds)."""
    try:
        phases = tuple(Phase(float(r), float(d)) for r, d in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"phases are RATE:SECONDS,...; got {text!r}") from None
    if not phases or any(p.rate_per_s < 0 or p.duration_s <= 0 or not math.isfinite(p.rate_per_s) for p in phases):
        raise argparse.ArgumentTypeError(f"rates must be >= 0 and durations > 0; got {text!r}")
    return phases


def total_s(phases: tuple[Phase, ...]) -> float:
    return sum(p.duration_s for p in phases)


def rate_at(phases: tuple[Phase, ...], t_s: float) -> float:
    """The scheduled rate at ``t_s`` (0 past the end)."""
    start = 0.0
    for phase in phases:
        if start <= t_s < start + phase.duration_s:
            return phase.rate_per_s
        start += phase.duration_s
    return 0.0


def arrival_offsets(phases: tuple[Phase, ...], seed: int) -> list[float]:
    """Poisson arrivals, each phase at its own rate inside its own time span (seeded: same list every run)."""
    rng, out, start = random.Random(seed), [], 0.0
    for phase in phases:
        t = start
        while phase.rate_per_s > 0:
            t += rng.expovariate(phase.rate_per_s)
            if t >= start + phase.duration_s:
                break
            out.append(t)
        start += phase.duration_s
    return out


# ---- measurements (pure) ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Trace:
    """One request; times are seconds since the run's start."""

    sent_s: float
    token_times_s: tuple[float, ...]
    ok: bool

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.sent_s if self.ok and self.token_times_s else math.inf


@dataclass(frozen=True, slots=True)
class PoolSample:
    t_s: float
    desired: dict[str, int | None]
    actual: dict[str, int]


@dataclass(frozen=True, slots=True)
class Interval:
    start_s: float
    rate_per_s: float  # scheduled, at the interval's middle
    num_requests: int  # sent in it
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    met: bool | None  # None: no request sent in it


def p90(values: list[float]) -> float | None:
    """The 90th percentile (linear between order statistics); infinite when it touches an infinite value
    (a failed request); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * 0.9
    lo = math.floor(pos)
    if pos == lo:
        return ordered[lo]
    if math.isinf(ordered[lo + 1]):
        return math.inf
    return ordered[lo] + (ordered[lo + 1] - ordered[lo]) * (pos - lo)  # bench.serve.percentile, inf-safe


def bucket(traces: list[Trace], phases: tuple[Phase, ...], interval_s: float, ttft_slo_ms: float,
           itl_slo_ms: float) -> list[Interval]:
    """Per interval of the schedule: TTFT p90 of the requests sent in it, ITL p90 of the gaps ending in it."""
    n = math.ceil(total_s(phases) / interval_s - 1e-9)
    ttfts: list[list[float]] = [[] for _ in range(n)]
    itls: list[list[float]] = [[] for _ in range(n)]
    for trace in traces:
        ttfts[min(n - 1, int(trace.sent_s // interval_s))].append(trace.ttft_s)
        for before, after in zip(trace.token_times_s, trace.token_times_s[1:]):
            itls[min(n - 1, int(after // interval_s))].append(after - before)
    out = []
    for i in range(n):
        ttft, itl = p90(ttfts[i]), p90(itls[i])
        ttft_ms, itl_ms = (None if v is None else v * 1e3 for v in (ttft, itl))
        met = None if ttft_ms is None else ttft_ms <= ttft_slo_ms and (itl_ms is None or itl_ms <= itl_slo_ms)
        middle_s = (i * interval_s + min((i + 1) * interval_s, total_s(phases))) / 2  # the last may be short
        out.append(Interval(i * interval_s, rate_at(phases, middle_s), len(ttfts[i]), ttft_ms, itl_ms, met))
    return out


def attainment(intervals: list[Interval]) -> float | None:
    """Share of the intervals with traffic whose TTFT p90 and ITL p90 both met the SLO."""
    judged = [i.met for i in intervals if i.met is not None]
    return sum(judged) / len(judged) if judged else None


def worker_seconds(samples: list[PoolSample], end_s: float) -> float:
    """Registered workers integrated over time: each sample holds until the next (the last until ``end_s``)."""
    total = 0.0
    for sample, nxt in zip(samples, samples[1:] + [None]):
        until = end_s if nxt is None else nxt.t_s
        total += sum(sample.actual.values()) * max(0.0, min(until, end_s) - sample.t_s)
    return total


def clamp(size: int, maximum: int) -> int:
    return max(1, min(size, maximum))


# ---- the platform: `baton up` and its Admin API -------------------------------------------------
class Up:
    """``baton up`` in its own process group; stopped by PID (its SIGTERM handler stops router, workers, redis)."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "deploy.cli", "up", "--prefill", "1", "--decode", "1", "--model", str(model_dir),
               "--port", self.address.rsplit(":", 1)[1], "--metrics-port", str(free_port()), "--http-port", "0",
               "--num-threads", "1", "--log-dir", str(log_dir), "--namespace", "bench-planner"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        with (log_dir / "up.log").open("wb") as log:
            self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                          start_new_session=True)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:  # its own children too: they share its process group
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(5)


async def get_pools(admin) -> tuple[dict[str, int | None], dict[str, int]]:
    from proto import baton_pb2 as pb

    response = await admin.GetPools(pb.GetPoolsRequest(), timeout=5)
    desired = {p.role: (p.desired if p.HasField("desired") else None) for p in response.pools}
    return desired, {p.role: p.actual for p in response.pools}


async def wait_for_pools(admin, up: Up, timeout_s: float) -> None:
    """Until every pool has as many registered workers as it should (bounded)."""
    import grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.popen.poll() is not None:
            raise RuntimeError(f"baton up exited with {up.popen.returncode}")
        try:
            desired, actual = await get_pools(admin)
            if all(desired.get(r) is not None and actual.get(r) == desired[r] for r in ROLES):
                return
        except grpc.aio.AioRpcError:
            pass  # the router is still starting
        await asyncio.sleep(0.5)
    raise TimeoutError(f"pools did not reach their desired sizes in {timeout_s:.0f} s")


def profile(address: str, out: Path) -> dict:
    """``baton admin profile`` against the running workers; the curves it stored."""
    cmd = [sys.executable, "-m", "deploy.cli", "admin", "--router", address, "--timeout", "60", "profile",
           "-o", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=300, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


# ---- one run: the load, the pool sampler and (planner mode) the planner ---------------------------
@dataclass
class Run:
    name: str
    t0: float  # perf_counter() at the schedule's start
    traces: list[Trace]
    samples: list[PoolSample]
    plans: list[dict]


async def send(gen, prompt: list[int], max_tokens: int, at_s: float, run: Run, timeout_s: float) -> None:
    import grpc

    await asyncio.sleep(max(0.0, run.t0 + at_s - time.perf_counter()))
    sent = time.perf_counter()
    try:
        stream = await stream_generate(gen, greedy_request(prompt, max_tokens), timeout_s)
        run.traces.append(Trace(stream.sent_s - run.t0, tuple(t - run.t0 for t in stream.token_times_s),
                                bool(stream.token_times_s)))
    except grpc.aio.AioRpcError:
        run.traces.append(Trace(sent - run.t0, (), False))


async def sample_pools(admin, run: Run, every_s: float, stop: asyncio.Event) -> None:
    import grpc

    while not stop.is_set():
        try:
            desired, actual = await get_pools(admin)
            run.samples.append(PoolSample(time.perf_counter() - run.t0, desired, actual))
        except grpc.aio.AioRpcError as exc:  # a slow answer: the previous sample holds a little longer
            print(f"[{run.name}] GetPools failed ({exc.code().name}); retrying", flush=True)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def plan_once(admin, args: argparse.Namespace, run: Run) -> dict:
    """``Admin/Plan`` on the last interval's traffic, clamped to the max sizes, applied with ``ScalePool``."""
    import grpc

    from proto import baton_pb2 as pb

    t_s = time.perf_counter() - run.t0
    request = pb.PlanRequest(ttft_p90_ms=args.slo_ttft_ms, itl_p90_ms=args.slo_itl_ms, from_traffic=True,
                             traffic_window_s=args.interval_s - 1.0)
    maximum = {"prefill": args.max_prefill, "decode": args.max_decode}
    try:
        plan = await admin.Plan(request, timeout=10)
        wanted = {"prefill": plan.prefill, "decode": plan.decode}
        set_to = {role: clamp(wanted[role], maximum[role]) for role in ROLES}
        desired, _ = await get_pools(admin)
        for role in ROLES:
            if set_to[role] != desired.get(role):
                await admin.ScalePool(pb.ScalePoolRequest(role=role, size=set_to[role]), timeout=10)
    except grpc.aio.AioRpcError as exc:  # e.g. no finished request in the window: the pools stay as they are
        return {"t_s": t_s, "error": f"{exc.code().name}: {exc.details()}"}
    terms = {f"{t.pool} {t.name}": t.value for t in plan.terms if "correction" in t.name}
    return {"t_s": t_s, "planned": wanted, "raw": {"prefill": plan.prefill_raw, "decode": plan.decode_raw},
            "set": set_to, "feasible": plan.feasible, "rate": plan.traffic.rate, "corrections": terms}


async def tick(admin, args: argparse.Namespace, run: Run, phases: tuple[Phase, ...], planning: bool) -> None:
    """Every interval: plan (planner mode) and print a progress line."""
    for k in range(1, math.ceil(total_s(phases) / args.interval_s)):
        await asyncio.sleep(max(0.0, run.t0 + k * args.interval_s - time.perf_counter()))
        note = ""
        if planning:
            record = await plan_once(admin, args, run)
            run.plans.append(record)
            note = (f"  plan {record['planned']['prefill']}P+{record['planned']['decode']}D -> set "
                    f"{record['set']['prefill']}P+{record['set']['decode']}D" if "error" not in record
                    else f"  plan: {record['error']}")
        last = [t for t in run.traces if (k - 1) * args.interval_s <= t.sent_s < k * args.interval_s]
        ttft = p90([t.ttft_s for t in last])
        pools = run.samples[-1] if run.samples else None
        shape = "?" if pools is None else " ".join(f"{r[0].upper()} {pools.desired.get(r)}/{pools.actual.get(r)}"
                                                    for r in ROLES)
        print(f"[{run.name}] t={k * args.interval_s:4.0f}s rate {rate_at(phases, k * args.interval_s - 1e-6):g}/s "
              f"done {len(run.traces)}  TTFT p90 {_ms(ttft)} (finished only)  pools desired/actual {shape}{note}",
              flush=True)


async def run_load(address: str, args: argparse.Namespace, name: str, phases: tuple[Phase, ...],
                   planning: bool) -> Run:
    from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc, tls

    async with tls.aio_channel(address, None) as channel:
        admin, gen = pb_grpc.AdminStub(channel), pb_grpc.GenerationStub(channel)
        info = await gen.ModelInfo(pb.ModelInfoRequest(), timeout=30)
        offsets = arrival_offsets(phases, args.seed)
        requests = sharegpt_like(len(offsets), vocab_size=info.vocab_size, seed=args.seed,
                                 output_range=(16, args.max_output_len))
        await send(gen, [4] * 8, 2, 0.0, Run(name, time.perf_counter(), [], [], []), args.timeout_s)  # warm-up
        run, stop = Run(name, time.perf_counter(), [], [], []), asyncio.Event()
        sampler = asyncio.create_task(sample_pools(admin, run, args.sample_s, stop))
        ticker = asyncio.create_task(tick(admin, args, run, phases, planning))
        try:
            await asyncio.gather(*(send(gen, r.prompt_token_ids, r.max_tokens, at, run, args.timeout_s)
                                   for r, at in zip(requests, offsets)))
            await ticker
        finally:
            stop.set()
            ticker.cancel()
            await asyncio.gather(sampler, ticker, return_exceptions=True)
    return run


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else "inf" if math.isinf(value_s) else f"{value_s * 1e3:.0f} ms"


# ---- report -------------------------------------------------------------------------------------
def summarize(run: Run, args: argparse.Namespace, phases: tuple[Phase, ...]) -> dict:
    intervals = bucket(run.traces, phases, args.interval_s, args.slo_ttft_ms, args.slo_itl_ms)
    return {"attainment": attainment(intervals), "worker_seconds": worker_seconds(run.samples, total_s(phases)),
            "requests": len(run.traces), "failed": sum(not t.ok for t in run.traces),
            "intervals": [asdict(i) for i in intervals], "pools": [asdict(s) for s in run.samples],
            "plans": run.plans, "traces": [asdict(t) for t in run.traces]}


def print_table(report: dict) -> None:
    planner, fixed = report["runs"]["planner"], report["runs"]["fixed"]
    slo = report["config"]
    print(f"\n{'t (s)':>6} {'rate':>5} | {'planner P+D':>11} {'TTFT p90':>9} {'ITL p90':>8} {'met':>4} | "
          f"{'fixed TTFT p90':>14} {'ITL p90':>8} {'met':>4}")
    for p, f in zip(planner["intervals"], fixed["intervals"]):
        shape = _shape_at(planner["pools"], p["start_s"] + slo["interval_s"])
        print(f"{p['start_s']:>6.0f} {p['rate_per_s']:>5g} | {shape:>11} {_num(p['ttft_p90_ms']):>9} "
              f"{_num(p['itl_p90_ms']):>8} {_met(p['met']):>4} | {_num(f['ttft_p90_ms']):>14} "
              f"{_num(f['itl_p90_ms']):>8} {_met(f['met']):>4}")
    print(f"(ms; SLO TTFT p90 <= {slo['slo_ttft_ms']:g}, ITL p90 <= {slo['slo_itl_ms']:g}; "
          f"planner P+D = actual pools at the interval's end)")
    for name, run in (("planner", planner), ("fixed", fixed)):
        att = run["attainment"]
        print(f"{name:>8}: SLO attainment {'n/a' if att is None else f'{att:.0%}'} of intervals, "
              f"{run['worker_seconds']:.0f} worker-seconds, {run['requests']} requests ({run['failed']} failed)")
    verdict = report["target"]
    print(f"target (planner attainment >= {TARGET_ATTAINMENT:.0%} with fewer worker-seconds than fixed): "
          f"{'met' if verdict['met'] else 'not met'} (attainment {verdict['attainment_met']}, "
          f"worker-seconds {verdict['ratio']:.2f}x fixed)")


def _shape_at(pools: list[dict], t_s: float) -> str:
    before = [s for s in pools if s["t_s"] <= t_s] or pools[:1]
    return "?" if not before else f"{before[-1]['actual']['prefill']}+{before[-1]['actual']['decode']}"


def _num(value: float | None) -> str:
    return "-" if value is None else "inf" if math.isinf(value) else f"{value:.0f}"


def _met(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def plot(report: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    cfg, runs = report["config"], report["runs"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    pools, fixed = runs["planner"]["pools"], cfg["max_prefill"] + cfg["max_decode"]
    times = [s["t_s"] for s in pools]
    for role, color in (("prefill", "tab:purple"), ("decode", "tab:blue")):
        top.step(times, [s["desired"][role] for s in pools], where="post", color=color, ls="--",
                 label=f"{role} desired")
        top.step(times, [s["actual"][role] for s in pools], where="post", color=color, label=f"{role} actual")
    top.axhline(fixed, color="gray", ls=":", label=f"fixed pool total ({fixed})")
    top.set(ylabel="workers", title="planner-driven pools (baton up) under a changing load",
            ylim=(0, fixed + 0.5), yticks=range(fixed + 1))
    rate = top.twinx()
    phases = parse_phases(cfg["phases"])
    grid = [i * 0.5 for i in range(int(total_s(phases) * 2) + 1)]
    rate.plot(grid, [rate_at(phases, t) for t in grid], color="tab:orange", alpha=0.6, label="load (req/s)")
    rate.set_ylabel("offered load (req/s)")
    top.legend(loc="upper left", fontsize=8)
    rate.legend(loc="upper right", fontsize=8)
    for name, style in (("planner", "-o"), ("fixed", "--x")):
        rows = runs[name]["intervals"]
        mid = [r["start_s"] + cfg["interval_s"] / 2 for r in rows]
        for key, label, color in (("ttft_p90_ms", "TTFT", "tab:red"), ("itl_p90_ms", "ITL", "tab:green")):
            values = [math.nan if r[key] is None or math.isinf(r[key]) else r[key] for r in rows]
            bottom.plot(mid, values, style, color=color, label=f"{name} {label} p90", ms=4)
    bottom.axhline(cfg["slo_ttft_ms"], color="tab:red", ls=":", label="TTFT SLO")
    bottom.axhline(cfg["slo_itl_ms"], color="tab:green", ls=":", label="ITL SLO")
    bottom.set(yscale="log", xlabel="time since the load started (s)", ylabel="ms (per interval)")
    bottom.legend(fontsize=8, ncol=3)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- main ---------------------------------------------------------------------------------------
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baton bench planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="`baton model` preset to serve")
    p.add_argument("--phases", type=parse_phases, default=parse_phases("2:40,12:70,2:80"),
                   help="load schedule RATE:SECONDS,... (default: 2:40,12:70,2:80)")
    p.add_argument("--interval-s", type=float, default=15.0, help="planning and reporting interval")
    p.add_argument("--sample-s", type=float, default=1.0, help="pool sampling period")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0, help="TTFT p90 target")
    p.add_argument("--slo-itl-ms", type=float, default=60.0, help="ITL p90 target")
    p.add_argument("--max-prefill", type=int, default=1, help="largest prefill pool (also the fixed pool's)")
    p.add_argument("--max-decode", type=int, default=2, help="largest decode pool (also the fixed pool's)")
    p.add_argument("--max-output-len", type=int, default=128, help="cap on the log-normal output lengths")
    p.add_argument("--no-profile", action="store_true", help="skip `baton admin profile` (a profile must be stored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    if args.interval_s <= 1 or args.sample_s <= 0 or min(args.max_prefill, args.max_decode) < 1:
        p.error("--interval-s must be > 1 s, --sample-s > 0 and the max sizes >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from engine.tiny import ensure_model

    model_dir = ensure_model(args.preset)
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-planner-"))
    print(f"model {model_dir}; logs {log_dir}; schedule {args.phases} ({total_s(args.phases):.0f} s per run)",
          flush=True)
    load_before, up = os.getloadavg(), Up(model_dir, log_dir)
    try:
        report = asyncio.run(_bench(args, up, log_dir))
    finally:
        up.stop()
    report["machine"] = {"cores": sorted(os.sched_getaffinity(0)), "loadavg_before": load_before,
                         "loadavg_after": os.getloadavg()}
    (args.out / "planner.json").write_text(json.dumps(report, indent=1, default=_json_default))
    path = plot(report, args.out / "planner.png")
    print_table(report)
    print(f"wrote {args.out / 'planner.json'}" + (f", {path}" if path else ""))
    return 0


async def _bench(args: argparse.Namespace, up: Up, log_dir: Path) -> dict:
    from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc, tls

    async with tls.aio_channel(up.address, None) as channel:
        admin = pb_grpc.AdminStub(channel)
        await wait_for_pools(admin, up, 180.0)
        print(f"baton up ready at {up.address} (1P+1D)", flush=True)
        curves = None
        if not args.no_profile:
            start = time.perf_counter()
            curves = await asyncio.to_thread(profile, up.address, log_dir / "profile.json")
            print(f"profiled in {time.perf_counter() - start:.0f} s: {json.dumps(curves)}", flush=True)
        planner = await run_load(up.address, args, "planner", args.phases, planning=True)
        for role, size in (("prefill", args.max_prefill), ("decode", args.max_decode)):
            await admin.ScalePool(pb.ScalePoolRequest(role=role, size=size), timeout=10)
        await wait_for_pools(admin, up, 180.0)
        print(f"fixed pool: {args.max_prefill}P+{args.max_decode}D, planner off", flush=True)
        fixed = await run_load(up.address, args, "fixed", args.phases, planning=False)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["phases"] = ",".join(f"{p.rate_per_s:g}:{p.duration_s:g}" for p in args.phases)
    runs = {"planner": summarize(planner, args, args.phases), "fixed": summarize(fixed, args, args.phases)}
    return {"config": config, "profile": curves, "runs": runs,
            "target": target(runs["planner"], runs["fixed"])}


def target(planner: dict, fixed: dict) -> dict:
    attained = planner["attainment"] is not None and planner["attainment"] >= TARGET_ATTAINMENT
    ratio = planner["worker_seconds"] / fixed["worker_seconds"] if fixed["worker_seconds"] > 0 else math.nan
    return {"attainment_met": attained, "ratio": ratio, "met": attained and ratio < 1.0}


def _json_default(value: object) -> object:
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
