"""``bench/kv_transfer.py --isolate``: one phase per system, so no system runs while another is measured.

On a small machine a peer's background threads (NIXL's UCX progress thread spins on a core for as long
as its agent lives) slow every other system sharing the run. So each phase starts only the raw baseline's
server and one system's server. It then runs the client side (the raw pulls, that system's client: a
Baton connection, a NIXL agent, a Mooncake engine) in a child process of its own, measures every prompt
size with the same block lists and byte checks as a shared run (``kv_transfer.run``), and stops all of
them before the next phase starts. The client runs in a child process because a peer's close does not
always stop its threads: importing ``mooncake.engine`` starts threads that last as long as the process.
Raw (and plain, per pattern) is measured in every phase, so each system's ratios are taken against the raw
(plain) figures of its own phase. Each phase's thread counts are recorded as evidence: the client's peak,
what is still running after its closers ran, and how many of the phase's processes were still alive after it
ended.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

from bench import kv_transfer as kt

BASELINE = kt.BASELINE
# measured in every phase, pooled over them (raw: the faster variant)
POOLED = (*kt.RAW_VARIANTS, kt.REFERENCE, *(f"{kt.PLAIN}/{p}" for p in kt.PATTERNS))


def task_count(pid: int | None = None) -> int:
    """Threads of process ``pid`` (this one by default); 0 once it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid or 'self'}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def phase_client(args: argparse.Namespace, endpoints: dict[str, dict], total_blocks: int, conn) -> None:
    """Child process: raw plus the phase's system, every prompt size (``kv_transfer.run``), closers run;
    replies ("ok", {...}) or ("error", reason)."""
    try:
        kt._install_loop(args.uvloop)
        servers = kt.Servers(stop=None, endpoints=endpoints)
        results = kt.run(args, servers, total_blocks)
        conn.send(("ok", {"results": results, "skipped": servers.skipped, "threads_after_close": task_count()}))
    except Exception as exc:  # noqa: BLE001 - the parent reports it (a raw failure ends the run)
        conn.send(("error", kt._reason(exc)))


def plan(args: argparse.Namespace) -> list[tuple[str, list[str], list[str]]]:
    """(phase name, transports, peers) per phase; a raw-only phase when no system was asked for."""
    phases = [(kind, [kind], []) for kind in args.transports] + [(kt.peer_system(name), [], [name]) for name in args.peers]
    return phases or [(BASELINE, [], [])]


def run_isolated(args: argparse.Namespace, total_blocks: int) -> tuple[list[dict], dict[str, str], list[str], dict]:
    """Every phase in turn: (merged results, skipped, systems started, per-phase record)."""
    skipped: dict[str, str] = {}
    started: list[str] = [BASELINE]
    phases: dict[str, dict] = {}
    todo = plan(args)
    for i, (label, transports, peers) in enumerate(todo, 1):
        print(f"== phase {i}/{len(todo)}: {label} (only raw and {label} running; "
              f"parent threads {task_count()}) ==", flush=True)
        sub = argparse.Namespace(**{**vars(args), "transports": transports, "peers": peers})
        servers = kt.start_servers(sub, total_blocks)
        client, reply, peaks = None, None, {}
        try:
            if BASELINE not in servers.endpoints:
                raise RuntimeError(f"the raw baseline did not start: {servers.skipped.get(BASELINE)}")
            skipped.update(servers.skipped)
            if label == BASELINE or label in servers.endpoints:
                client, reply, peaks = _run_client(sub, servers, total_blocks)
        finally:
            if client is not None:
                client.join(10)
                if client.is_alive():
                    client.terminate()
                    client.join(5)
            kt.stop_servers(servers)
        left = [p.pid for p in mp.active_children()]
        if reply is None:
            continue  # the system's server did not start: skipped with its reason
        status, payload = reply
        if status == "error":  # escaped kv_transfer.run: the raw baseline failed, as in a shared run
            raise RuntimeError(f"phase {label}: {payload}")
        if status == "exited":  # e.g. a peer's library crashed the client process
            skipped[label] = f"phase client: {payload}"
            continue
        skipped.update(payload["skipped"])
        started += [name for name in servers.endpoints if name not in started]
        threads = {"client_peak": peaks.pop("client"), "client_after_close": payload["threads_after_close"],
                   "servers_peak": peaks, "processes_left_after_phase": len(left)}
        phases[label] = {"raw": [_raw_entry(r) for r in payload["results"]], "threads": threads,
                         "results": payload["results"]}
        print(f"  phase {label} done: client threads peak {threads['client_peak']}, "
              f"{threads['client_after_close']} after its closers ran (then the process exited); "
              f"server threads peak {peaks}; processes left {len(left)}; parent threads {task_count()}",
              flush=True)
    return merge(phases), skipped, started, {k: {"raw": v["raw"], "threads": v["threads"]} for k, v in phases.items()}


def _run_client(sub: argparse.Namespace, servers: kt.Servers, total_blocks: int) -> tuple[mp.Process, tuple, dict]:
    """Start the phase's client process and wait for its reply, sampling every process's thread count."""
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    client = ctx.Process(target=phase_client, args=(sub, servers.endpoints, total_blocks, child), daemon=True)
    client.start()
    peaks = {"client": 0, **{name: 0 for name in servers.endpoints}}
    pids = {"client": client.pid, **{name: servers.procs[name].pid for name in servers.endpoints}}
    while True:  # sampled before the first wait too: a phase faster than one period still has its counts
        for name, pid in pids.items():
            peaks[name] = max(peaks[name], task_count(pid))
        if pipe.poll(0.2):
            break
        if not client.is_alive():
            return client, ("exited", f"client process exited with code {client.exitcode} before it replied"), peaks
    reply = pipe.recv()
    time.sleep(0.05)  # let it exit
    return client, reply, peaks


def _raw_entry(result: dict) -> dict:
    raw = result["systems"][BASELINE]
    return {"tokens": result["tokens"], **{k: raw[k] for k in ("gbps", "p50_ms", "p99_ms", "seconds", "best_of")}}


def merge(phases: dict[str, dict]) -> list[dict]:
    """One result per prompt size: each system's figures from its own phase (its ratio against that
    phase's raw, ``raw_gbps`` beside it, and its plain); ``raw``, ``memcpy`` and ``plain/*`` pooled over every
    phase's."""
    merged: dict[int, dict] = {}
    pooled_seconds: dict[int, dict[str, list[float]]] = {}  # raw, memcpy and plain, every phase's
    for label, phase in phases.items():
        for result in phase["results"]:
            tokens, raw = result["tokens"], result["systems"][BASELINE]
            sizes = {k: result[k] for k in ("tokens", "blocks", "num_bytes")}
            entry = merged.setdefault(tokens, {**sizes, "systems": {}})
            for name, stats in result["systems"].items():
                if name == BASELINE:
                    continue  # a copy of the faster variant: chosen again from the pooled ones
                if name in POOLED:
                    pooled_seconds.setdefault(tokens, {}).setdefault(name, []).extend(stats["seconds"])
                else:
                    entry["systems"][name] = {**stats, "phase": label, "raw_gbps": raw["gbps"]}
    out = []
    for tokens, entry in merged.items():
        seconds = pooled_seconds[tokens]
        pooled = kt.summarize(seconds, dict.fromkeys(seconds, entry["num_bytes"]), entry["num_bytes"])
        out.append({**entry, "systems": pooled | entry["systems"]})
    return out
