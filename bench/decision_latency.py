"""Router decision latency: what the router computes per request, per policy, with 16 registered workers.

    python -m bench.decision_latency [--decisions 2000] [--lookups 1000]
    python -m bench.decision_latency --workers 16 64 256 1000 [--index-entries 200000] [--scale-decisions 500]

With ``--workers``: decision latency against the worker count with a filled KV index, the path before issue 23
beside the one after (pre-selection, the bitmap mirror), and the mirror's memory per entry:
``bench.decision_scale`` says what is measured.

One decision is what ``router.relay`` does between the registry snapshot and the first RPC: pick the
served hash scheme, hash the prompt's blocks (``hash_blocks``, a 4,096-token prompt, block size 16: 256
hashes), build the candidates (8 prefill + 8 decode, hand-built loads, some holding a cached prefix) and
run ``router.routing.policy.route`` with one long-lived ``RoutingState``, with the relay's bookkeeping read as it
reads it (every worker with prompts in flight, four decode workers computing prompts of the cycle). No
processes, no Redis: the index round trip (``KVIndex.lookup`` of the 256 hashes) is timed separately
against a private redis-server, beside the same lookup answered by the in-memory mirror (``baton router
--index-mirror``) synced from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kv_transfer.hashing import hash_blocks, root_hash
from kv_transfer.layout import KVLayout
from kv_transfer.workers import WorkerInfo, WorkerLoad
from router.routing.cost_model import CostConfig
from router.routing.directory import Snapshot, build_candidates, served_scheme
from router.routing.in_progress import InflightPrefills, PendingPrefixes
from router.routing.policy import POLICIES, PolicyConfig, RouteRequest, RoutingState, route

RESULTS = Path(__file__).parent / "results" / "decision_latency.json"
BLOCK_SIZE = 16
PROMPT_TOKENS = 4096
TOTAL_BLOCKS = 8192  # per worker (an 8B-class model on an 80 GB GPU holds ~130k tokens)
# (policy name in the report, config): every policy, plus the cost model with a softmax temperature.
VARIANTS = [(name, PolicyConfig(policy=name)) for name in POLICIES] + [
    ("cost_t0.05", PolicyConfig(policy="cost", cost=CostConfig(temperature_s=0.05)))
]


def _layout_json(fingerprint: bytes) -> str:
    layout = KVLayout(model_fingerprint=fingerprint, dtype="bfloat16", block_size=BLOCK_SIZE, num_layers=32,
                      num_kv_heads=8, head_dim=128)  # Llama-3-8B-like
    return layout.to_json()


def make_snapshot(rng: random.Random, fingerprint: bytes) -> Snapshot:
    """8 prefill + 8 decode workers with varied, realistic loads (as their last heartbeats reported)."""
    return make_workers(rng, fingerprint, 8, 8)


def make_workers(rng: random.Random, fingerprint: bytes, num_prefill: int, num_decode: int) -> Snapshot:
    """Prefill and decode workers with varied, realistic loads (as their last heartbeats reported)."""
    layout_json = _layout_json(fingerprint)
    entries = []
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(count):
            info = WorkerInfo(worker_id=f"{role[0]}{i}", role=role, grpc_address=f"10.0.{i // 256}.{i % 256}:50051",
                              kv_uri=f"tcp://10.0.{i // 256}.{i % 256}:6000", model_fingerprint=fingerprint.hex(),
                              layout_json=layout_json, total_blocks=TOTAL_BLOCKS)
            running = rng.randint(8, 48) if role == "decode" else rng.randint(0, 2)
            load = WorkerLoad(running=running, waiting=rng.randint(0, 4),
                              free_blocks=rng.randint(TOTAL_BLOCKS // 8, TOTAL_BLOCKS),
                              queued_prefill_tokens=rng.randint(0, 16_384),
                              prefill_tokens_per_s=rng.uniform(8_000, 12_000),
                              decode_step_s=rng.uniform(0.015, 0.035))
            entries.append((info, load))
    return Snapshot(workers=tuple(entries), draining=frozenset(), taken_at_s=time.monotonic())


def cached_map(num_blocks: int) -> dict[str, int]:
    """What an index lookup returns: a few workers hold leading parts of the prompt's chain."""
    return {"d2": num_blocks, "d5": num_blocks // 2, "d7": num_blocks // 8, "p1": num_blocks // 2, "p4": 16}


@dataclass(slots=True)
class InProgress:
    """What the relay keeps between decisions and reads in each: in-flight counts, prompts sent to compute
    (``InflightPrefills``), prefixes being computed (``PendingPrefixes``)."""

    inflight: dict[str, int] = field(default_factory=dict)
    prefills: InflightPrefills = field(default_factory=InflightPrefills)
    pending: PendingPrefixes = field(default_factory=PendingPrefixes)


def in_progress(prompts: list[list[int]], fingerprint: bytes) -> InProgress:
    """Every worker busy with a few prompts: 4 of them computing the bench's prompts (prefixes pending)."""
    state = InProgress(inflight={f"d{i}": 2 for i in range(8)})
    root = root_hash(fingerprint, BLOCK_SIZE, "")
    for i in range(8):
        for role in "pd":
            for k in range(3):
                state.prefills.add(f"{role}{i}", f"{role}{i}-{k}", 1024 * (k + 1))
    for i, prompt in enumerate(prompts[:4]):
        state.pending.add(f"busy-{i}", f"d{i}", hash_blocks(prompt, BLOCK_SIZE, root))
    return state


def decide(snapshot: Snapshot, prompt: list[int], cached: dict[str, int], config: PolicyConfig,
           state: RoutingState, busy: InProgress) -> str:
    """One routing decision as the relay makes it, minus the Redis round trip (``cached`` stands in)."""
    scheme = served_scheme(snapshot.workers)
    assert scheme is not None
    root = root_hash(scheme.fingerprint, scheme.block_size, "")
    hashes = hash_blocks(prompt, scheme.block_size, root)
    assert len(hashes) == PROMPT_TOKENS // BLOCK_SIZE
    candidates = build_candidates(snapshot, scheme, cached, busy.inflight,
                                  busy.prefills.backlogs(snapshot.workers, state.rates), busy.pending.lookup(hashes))
    request = RouteRequest(num_prompt_tokens=len(prompt), block_size=scheme.block_size)
    return route(request, candidates, config, state=state).decode_id


def time_policy(config: PolicyConfig, snapshot: Snapshot, prompts: list[list[int]], n: int,
                fingerprint: bytes) -> list[float]:
    """Per-decision milliseconds over ``n`` decisions (prompts cycled, a fresh prompt hash each time)."""
    state = RoutingState.for_config(config, seed=0)
    cached = cached_map(PROMPT_TOKENS // BLOCK_SIZE)
    busy = in_progress(prompts, fingerprint)
    for prompt in prompts[:20]:  # warm up
        decide(snapshot, prompt, cached, config, state, busy)
    out = []
    for i in range(n):
        started = time.perf_counter_ns()
        decide(snapshot, prompts[i % len(prompts)], cached, config, state, busy)
        out.append((time.perf_counter_ns() - started) / 1e6)
    return out


def time_hashing(prompts: list[list[int]], n: int, fingerprint: bytes) -> list[float]:
    root = root_hash(fingerprint, BLOCK_SIZE, "")
    out = []
    for i in range(n):
        started = time.perf_counter_ns()
        hash_blocks(prompts[i % len(prompts)], BLOCK_SIZE, root)
        out.append((time.perf_counter_ns() - started) / 1e6)
    return out


async def _time_lookups(redis_url: str, hashes: list[bytes], n: int) -> tuple[list[float], list[float]]:
    from kv_transfer.redis_index import KVIndex
    from kv_transfer.registry import connect
    from router.routing.mirror_sync import MirrorSync

    redis = connect(redis_url)
    try:
        index = KVIndex(redis, "bench")
        await redis.sadd(index.keys.workers, *cached_map(len(hashes)))  # only registered workers are indexed
        for worker_id, blocks in cached_map(len(hashes)).items():
            await index.publish(worker_id, hashes[:blocks], [])
        assert (await index.lookup(hashes))["d2"] == len(hashes)
        out = []
        for _ in range(n + 20):
            started = time.perf_counter_ns()
            await index.lookup(hashes)
            out.append((time.perf_counter_ns() - started) / 1e6)
        sync = MirrorSync(index)
        await sync.sync()
        assert sync.mirror.lookup(hashes) == await index.lookup(hashes)
        mirrored = []
        for _ in range(n + 20):
            started = time.perf_counter_ns()
            sync.mirror.lookup(hashes)
            mirrored.append((time.perf_counter_ns() - started) / 1e6)
        return out[20:], mirrored[20:]
    finally:
        await redis.aclose()


def time_redis_lookup(hashes: list[bytes], n: int) -> tuple[list[float], list[float]] | None:
    from deploy.up import Child, start_redis, stop_all

    children: list[Child] = []
    try:
        redis_url = start_redis(Path(tempfile.mkdtemp(prefix="baton-bench-")), children)
    except FileNotFoundError:
        print("no redis-server binary: skipping the KVIndex.lookup timing")
        return None
    try:
        _wait_for_redis(redis_url)
        return asyncio.run(_time_lookups(redis_url, hashes, n))
    finally:
        stop_all(children)


def _wait_for_redis(redis_url: str, timeout_s: float = 10.0) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50_ms": statistics.median(ordered), "p99_ms": p99, "mean_ms": statistics.fmean(ordered),
            "per_s": 1e3 / statistics.fmean(ordered)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decision_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decisions", type=int, default=2000, help="timed decisions per policy")
    p.add_argument("--lookups", type=int, default=1000, help="timed KVIndex.lookup calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, nargs="+", default=None,
                   help="worker counts (half prefill, half decode): the at-scale sweep instead of the policy table")
    p.add_argument("--index-entries", type=int, default=200_000,
                   help="with --workers: (block, holder) entries in the index at each worker count")
    p.add_argument("--scale-decisions", type=int, default=500, help="with --workers: timed decisions per path")
    p.add_argument("--memory-entries", type=int, default=200_000,
                   help="with --workers: entries each mirror is filled with to measure its memory (0: skip)")
    p.add_argument("--no-redis", action="store_true", help="with --workers: fill the index in memory only")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    fingerprint = rng.randbytes(32)
    if args.workers:
        return _scale(args, rng, fingerprint)
    snapshot = make_snapshot(rng, fingerprint)
    prompts = [[rng.randrange(4, 32_000) for _ in range(PROMPT_TOKENS)] for _ in range(64)]
    policies = {}
    for name, config in VARIANTS:
        print(f"timing {args.decisions} decisions: {name} ...", flush=True)
        policies[name] = summary(time_policy(config, snapshot, prompts, args.decisions, fingerprint))
    hashing = summary(time_hashing(prompts, args.decisions, fingerprint))
    lookups = time_redis_lookup(hash_blocks(prompts[0], BLOCK_SIZE, root_hash(fingerprint, BLOCK_SIZE, "")),
                                  args.lookups)
    report = {
        "workers": {"prefill": 8, "decode": 8}, "prompt_tokens": PROMPT_TOKENS, "block_size": BLOCK_SIZE,
        "decisions_per_policy": args.decisions, "hash_blocks": hashing, "policies": policies,
        "redis_lookup_256": None if lookups is None else summary(lookups[0]),
        "mirror_lookup_256": None if lookups is None else summary(lookups[1]),
    }
    _print_table(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS}")
    return 0


def _scale(args: argparse.Namespace, rng: random.Random, fingerprint: bytes) -> int:
    from bench import decision_scale

    report = decision_scale.run(args, rng, fingerprint)
    decision_scale.print_table(report)
    path = RESULTS.with_name("decision_scale.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


def _print_table(report: dict) -> None:
    print(f"\n{'step':<28}{'p50 ms':>10}{'p99 ms':>10}{'per s':>12}")
    rows = [(f"decision: {name}", s) for name, s in report["policies"].items()]
    rows.append(("  of which hash_blocks", report["hash_blocks"]))
    if report["redis_lookup_256"] is not None:
        rows.append(("KVIndex.lookup (256, redis)", report["redis_lookup_256"]))
        rows.append(("mirror lookup (256, memory)", report["mirror_lookup_256"]))
    for label, s in rows:
        print(f"{label:<28}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}{s['per_s']:>12,.0f}")


if __name__ == "__main__":
    raise SystemExit(main())
