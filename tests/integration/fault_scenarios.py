"""The fault scenarios (issue 9), each a function ``(FaultPlatform, Reference) -> ScenarioResult`` that
injects one fault with real signals, real restarts and a real TCP proxy, then restores the platform.

What each expects (beyond the checks every scenario ends with, see ``faults_lib.Checker.finish``):
- prefill_killed: P SIGKILLed after its transfers (streams go on), during prefills and before requests
  (still listed): every request completes token-exact (local recompute on the decode worker).
- decode_killed_before_first_token: d0 frozen, then SIGKILLed while requests wait on it: they are retried
  on d1 and complete token-exact.
- decode_killed_mid_stream: streams on d0 (restarted slowed, ``--fault-step-delay-s``: mid-stream on any machine;
  greedy and seeded; d1 drained while they start) when d0 is frozen mid-stream and SIGKILLed migrate to d1
  (undrained first) and complete exactly as the offline engine's, each counted once in the router's
  ``baton:request_migrations_total``.
- router_restarted: streams end in UNAVAILABLE; a new router on the same port serves.
- redis_restarted / redis_stopped (killed and started again / frozen with SIGSTOP): requests complete on
  the router's last listing or fail UNAVAILABLE; workers re-register.
- heartbeat_lost: d1 frozen (SIGSTOP: sockets open, no heartbeat) drops out of the listing after its TTL and
  gets no requests; resumed (SIGCONT), it re-registers and serves.
- kv_delayed / kv_stalled / kv_corrupted: a slow pull completes; a stalled one times out and a corrupted
  one fails its checksum, and both recompute locally, token-exact.
"""

from __future__ import annotations

import os
import signal
import time

import grpc

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.client_batch import Batch, generate
from tests.integration.faults_lib import (
    DEADLINE_S, ROUTER_LISTING_S, Checker, FaultPlatform, Reference, ScenarioResult,
)

STREAM_TOKENS = 64  # mid-stream when the fault hits (3 tokens in), and cheap to finish on a slow CPU
MIGRATING_STEP_S = 0.1  # d0's --fault-step-delay-s in decode_killed_mid_stream: 64 tokens take 6.4 s or more
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}  # sampled, and reproducible by the reference engine
# Just after a Redis restart the router may read an empty registry (a successful answer, so not replaced by its
# last listing) until the workers' next heartbeat re-registers them (ROUTER_LISTING_S).


def prefill_killed(p: FaultPlatform, ref: Reference) -> ScenarioResult:
    check = Checker("prefill_killed", ref)
    after = Batch(p.address, [p.prompt(i) for i in range(3)], 40, DEADLINE_S)
    after.wait_tokens(2)  # the transfers are done: D streams
    during = Batch(p.address, [p.prompt(i) for i in range(3, 6)], 10, DEADLINE_S)
    p.workers["p0"].kill(signal.SIGKILL)
    before = Batch(p.address, [p.prompt(i) for i in range(6, 9)], 10, DEADLINE_S)  # P dead but still listed
    for batch in (after, during, before):
        check.add(batch.results(), {"OK"})
    p.restart_worker("p0")
    return check.finish(p)


def decode_killed_before_first_token(p: FaultPlatform, ref: Reference) -> ScenarioResult:
    check = Checker("decode_killed_before_first_token", ref)
    retries_before = _router_log(p).count("retrying on worker_id=d1")
    d0 = p.workers["d0"]
    d0.popen.send_signal(signal.SIGSTOP)
    try:
        batch = Batch(p.address, [p.prompt(i) for i in range(10, 14)], 8, DEADLINE_S)
        batch.wait_any_done(timeout_s=2.0)  # the ones routed to d1 finish; those on d0 wait
        time.sleep(0.3)
    finally:
        d0.kill(signal.SIGKILL)
    outcomes = check.add(batch.results(), {"OK"})
    if any(o.last is not None and o.last.timings.decode_worker != "d1" for o in outcomes):
        check.problem("a request finished on a decode worker other than d1")
    if _router_log(p).count("retrying on worker_id=d1") == retries_before:
        check.problem("no request was waiting on d0 when it died (the router retried none)")
    p.restart_worker("d0")
    return check.finish(p)


def _router_log(p: FaultPlatform) -> str:
    assert p.router is not None
    return p.router.log_path.read_text(errors="replace")


def decode_killed_mid_stream(p: FaultPlatform, ref: Reference) -> ScenarioResult:
    check = Checker("decode_killed_mid_stream", ref)
    counted = p.router_counter("baton:request_migrations_total")
    # d0 slowed for this scenario: its streams last STREAM_TOKENS x MIGRATING_STEP_S or more on any machine, so they
    # are mid-way when it is frozen (a fast machine's d0 had finished them)
    p.restart_worker("d0", "--fault-step-delay-s", str(MIGRATING_STEP_S))
    d0 = p.workers["d0"]
    p.set_draining("d1", True)  # every stream starts on d0
    try:
        batches = [Batch(p.address, [p.prompt(i) for i in range(20, 22)], STREAM_TOKENS, DEADLINE_S),
                   Batch(p.address, [p.prompt(i) for i in range(22, 24)], STREAM_TOKENS, DEADLINE_S, SEEDED)]
        if not all(batch.wait_tokens(3) for batch in batches):
            check.problem("streams did not start")
    finally:
        p.set_draining("d1", False)  # the router routes by a listing with d1 back before d0 fails
    d0.popen.send_signal(signal.SIGSTOP)  # mid-stream
    if any(n >= STREAM_TOKENS for batch in batches for n in batch.progress):
        check.problem(f"a stream ended before d0 froze (d0's steps took less than {MIGRATING_STEP_S} s?)")
    d0.kill(signal.SIGKILL)
    outcomes = [o for batch in batches for o in check.add(batch.results(), {"OK"})]
    for o in outcomes:
        t = o.last.timings if o.last is not None else pb.Timings()
        if (t.migrations, t.decode_worker) != (1, "d1") or "migrated: decode worker d0 failed" not in t.route_reason:
            check.problem(f"not migrated once to d1: {t.migrations} migrations, on {t.decode_worker!r}")
    if p.router_counter("baton:request_migrations_total") - counted != len(outcomes):
        check.problem("the router did not count one migration per stream")
    p.restart_worker("d0")  # as the platform started it: not slowed
    return check.finish(p)


def router_restarted(p: FaultPlatform, ref: Reference) -> ScenarioResult:
    check = Checker("router_restarted", ref)
    batch = Batch(p.address, [p.prompt(i) for i in range(30, 34)], STREAM_TOKENS, DEADLINE_S)
    if not batch.wait_tokens(3):
        check.problem("streams did not start")
    port = int(p.address.rsplit(":", 1)[1])
    p.router.kill(signal.SIGKILL)
    check.add(batch.results(), {"OK", "UNAVAILABLE"})
    p.start_router(port)
    check.add(Batch(p.address, [p.prompt(i) for i in range(34, 36)], 8, DEADLINE_S).results(), {"OK"})
    return check.finish(p)


def redis_restarted(p: FaultPlatform, ref: Reference) -> ScenarioResult:
    check = Checker("redis_restarted", ref)
    p.redis.restart()  # no persistence: the registry and the index are gone until workers re-register
    for wave in range(3):
        check.add(Batch(p.address, [p.prompt(40 + 2 * wave + i) for i in range(2)], 8, DEADLINE_S).results(),
                  {"OK", "UNAVAILABLE"})
    p.wait_registered(tuple(p.workers), timeout_s=20)
    time.sleep(ROUTER_LISTING_S)
    return check.finish(p)


def redis_stopped(p: FaultPlatform, ref: Reference, stopped_s: float = 4.0) -> ScenarioResult:
    check = Checker("redis_stopped", ref)
    assert p.redis.pid is not None
    os.kill(p.redis.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        wave = 0
        while time.monotonic() - started < stopped_s:
            check.add(Batch(p.address, [p.prompt(50 + 2 * wave + i) for i in range(2)], 8, DEADLINE_S).results(),
                      {"OK", "UNAVAILABLE"})
            wave += 1
    finally:
        os.kill(p.redis.pid, signal.SIGCONT)
    p.wait_registered(tuple(p.workers), timeout_s=20)
    time.sleep(ROUTER_LISTING_S)
    return check.finish(p)


def heartbeat_lost(p: FaultPlatform, ref: Reference) -> ScenarioResult:
    check = Checker("heartbeat_lost", ref)
    d1 = p.workers["d1"]
    d1.popen.send_signal(signal.SIGSTOP)
    try:
        p.wait_registered(("d1",), timeout_s=20, present=False)
        time.sleep(ROUTER_LISTING_S)
        outcomes = check.add(Batch(p.address, [p.prompt(i) for i in range(60, 64)], 8, DEADLINE_S).results(), {"OK"})
        if any(o.last is not None and o.last.timings.decode_worker != "d0" for o in outcomes):
            check.problem("the router sent a request to the worker that stopped heartbeating")
    finally:
        d1.popen.send_signal(signal.SIGCONT)
    p.wait_registered(("d1",), timeout_s=20)
    time.sleep(ROUTER_LISTING_S)
    outcomes = check.add(Batch(p.address, [p.prompt(i) for i in range(64, 68)], 8, DEADLINE_S).results(), {"OK"})
    if not any(o.last is not None and o.last.timings.decode_worker == "d1" for o in outcomes):
        check.problem("d1 got no request after it came back")
    return check.finish(p)


def _kv_fault(p: FaultPlatform, ref: Reference, name: str, mode: str, why: str | None) -> ScenarioResult:
    """Two pulls through the proxy in ``mode``; ``why``: what the failed pull's reason names (None: it works)."""
    check = Checker(name, ref)
    prompts = [p.prompt(70 + i, 44) for i in range(2)]
    fallbacks = _pull_fallbacks(p)
    p.proxy.mode = mode
    try:
        outcomes = check.add([generate(p.address, q, 8, DEADLINE_S) for q in prompts], {"OK"})
    finally:
        p.proxy.mode = "pass"
    for o in outcomes:
        t = o.last.timings if o.last is not None else pb.Timings()
        if ("KV pull failed" in t.route_reason) != (why is not None) or why is not None and why not in t.route_reason:
            check.problem(f"{mode}: route reason {t.route_reason!r}")
        if why is None and not (t.transfer_bytes > 0 and not t.local_fallback):  # the KV moved, slowly
            check.problem(f"{mode}: no KV moved ({t.route_reason!r})")
    counted = _pull_fallbacks(p) - fallbacks  # the decode workers' own count agrees with the reasons
    if counted != (0 if why is None else len(prompts)):
        check.problem(f"{mode}: the decode workers counted {counted} pull fallbacks")
    check.add([generate(p.address, q, 8, DEADLINE_S) for q in prompts], {"OK"})  # cached blocks are sound
    return check.finish(p)


def _pull_fallbacks(p: FaultPlatform) -> int:
    """Pull fallbacks the live decode workers counted (``Stats.kv_pull_fallbacks``)."""
    total = 0
    for name, proc in p.workers.items():
        if name.startswith("d") and proc.popen.poll() is None:
            with grpc.insecure_channel(proc.address) as channel:
                total += pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).kv_pull_fallbacks
    return total


def kv_delayed(p: FaultPlatform, ref: Reference) -> ScenarioResult:
    return _kv_fault(p, ref, "kv_delayed", "delay", None)


def kv_stalled(p: FaultPlatform, ref: Reference) -> ScenarioResult:
    return _kv_fault(p, ref, "kv_stalled", "stall", "silent")


def kv_corrupted(p: FaultPlatform, ref: Reference) -> ScenarioResult:
    return _kv_fault(p, ref, "kv_corrupted", "corrupt", "checksum")


SCENARIOS = {f.__name__: f for f in (
    prefill_killed, decode_killed_before_first_token, decode_killed_mid_stream, router_restarted,
    redis_restarted, redis_stopped, heartbeat_lost, kv_delayed, kv_stalled, kv_corrupted,
)}
