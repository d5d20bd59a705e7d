"""Decision latency against the number of workers, with a filled KV index (issue 23, item 4).

    python -m bench decision-latency --workers 16 64 256 1000 [--index-entries 200000] [--scale-decisions 500]

Per worker count N (half prefill, half decode, loads as ``bench.decision_latency`` draws them), 64 prompts of
4,096 tokens that share a 512-token system prompt: every worker holds the system prompt's 32 blocks (the
worst case for holders per block), each prompt's whole chain is held by 3 workers and its first half by 2 more,
and every worker holds synthetic blocks besides, up to ``--index-entries`` (block, holder) entries in all. With
a private redis-server (skipped with ``--no-redis`` or without the binary) the N workers are registered and the
prompts' holdings published there through ``KVIndex``, the mirror is built from it by ``MirrorSync.sync`` (one
resync per holder; timed) and the synthetic blocks are added to it directly; the Redis script's lookup is timed
beside. The router's books: 2 requests in flight on every decode worker, 3 prompts sent to every worker, 4
decode workers computing prompts of the cycle.

Two paths, timed alternately on the same prompts (one decision = what ``router.relay`` computes between the
registry snapshot and the first RPC, the index lookup included):

- **old**: the path before issue 23: ``served_scheme``, ``hash_blocks``, the set-based mirror's walk
  (``bench.set_mirror``, holding the prompts' blocks only), a ``Candidate`` for every worker, every worker's
  backlog, ``route`` (the cost model quotes every prefill worker and samples two decode workers past 8);
- **new**: ``hash_blocks``, the bitmap mirror's ``match``, ``PoolView.candidates`` (pre-selection past 64 workers;
  the view rebuilt every 0.5 s, as often as the directory refreshes its listing, inside the decision that finds
  it stale), ``route`` pricing the pre-selected.

Memory: ``tracemalloc`` over filling each mirror with ``--memory-entries`` entries (1,000 holders, the same mix),
in bytes per (block, holder) entry, keys included; and the RSS growth of the new mirror's fill at each N.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.decision_latency import BLOCK_SIZE, InProgress, make_workers, summary
from bench.set_mirror import SetMirror
from kv_transfer.hashing import hash_blocks, root_hash
from router.routing.directory import Snapshot, build_candidates, served_scheme
from router.routing.index_mirror import IndexMirror
from router.routing.policy import PolicyConfig, RouteRequest, RoutingState, route
from router.routing.preselect import Books, PoolView, PreselectConfig, preselect_for

SYSTEM_TOKENS, PROMPT_TOKENS, NUM_PROMPTS = 512, 4096, 64
VIEW_TTL_S = 0.5  # WorkerDirectory's listing TTL (RouterConfig.worker_list_ttl_s)


@dataclass(slots=True)
class Scenario:
    snapshot: Snapshot
    prompts: list[list[int]]
    chains: list[list[bytes]]
    holdings: list[tuple[str, list[bytes]]]  # (worker, blocks) for the prompts' prefixes
    busy: InProgress


def scenario(rng: random.Random, fingerprint: bytes, num_workers: int) -> Scenario:
    snapshot = make_workers(rng, fingerprint, num_workers // 2, num_workers - num_workers // 2)
    system = [rng.randrange(4, 32_000) for _ in range(SYSTEM_TOKENS)]
    prompts = [system + [rng.randrange(4, 32_000) for _ in range(PROMPT_TOKENS - SYSTEM_TOKENS)]
               for _ in range(NUM_PROMPTS)]
    root = root_hash(fingerprint, BLOCK_SIZE, "")
    chains = [hash_blocks(p, BLOCK_SIZE, root) for p in prompts]
    ids = [info.worker_id for info, _ in snapshot.workers]
    holdings = [(w, chains[0][: SYSTEM_TOKENS // BLOCK_SIZE]) for w in ids]
    for chain in chains:
        picked = rng.sample(ids, min(5, len(ids)))
        holdings += [(w, chain) for w in picked[:3]] + [(w, chain[: len(chain) // 2]) for w in picked[3:]]
    busy = InProgress(inflight={w: 2 for w in ids if w.startswith("d")})
    for w in ids:
        for k in range(3):
            busy.prefills.add(w, f"{w}-{k}", 1024 * (k + 1))
    for i, chain in enumerate(chains[:4]):
        busy.pending.add(f"busy-{i}", f"d{i}", chain)
    return Scenario(snapshot, prompts, chains, holdings, busy)


def fill_filler(mirror: Any, workers: list[str], entries: int, rng: random.Random) -> None:
    """Synthetic blocks, spread evenly over ``workers``, until the index holds about ``entries`` entries."""
    per_worker = max(entries // len(workers), 0)
    for w in workers:
        mirror.store(w, [rng.randbytes(16) for _ in range(per_worker)])


def old_decision(s: Scenario, prompt: list[int], mirror: SetMirror, config: PolicyConfig,
                 state: RoutingState) -> int:
    scheme = served_scheme(s.snapshot.workers)
    assert scheme is not None
    hashes = hash_blocks(prompt, scheme.block_size, root_hash(scheme.fingerprint, scheme.block_size, ""))
    tiers = mirror.lookup_tiers(hashes)
    candidates = build_candidates(s.snapshot, scheme, tiers.gpu, s.busy.inflight,
                                  s.busy.prefills.backlogs(s.snapshot.workers, state.rates),
                                  s.busy.pending.lookup(hashes), tiers.gpu_or_cpu)
    request = RouteRequest(num_prompt_tokens=len(prompt), block_size=scheme.block_size)
    route(request, candidates, config, state=state)
    return len(candidates)


class NewPath:
    """The relay's path after issue 23, with its per-listing view."""

    def __init__(self, s: Scenario, mirror: IndexMirror, config: PolicyConfig, preselect: PreselectConfig) -> None:
        self.s, self.mirror, self.config, self.preselect = s, mirror, config, preselect_for(config, preselect)
        self.state = RoutingState.for_config(config, seed=0)
        self.view: PoolView | None = None
        self.view_built_s = 0.0

    def decide(self, prompt: list[int]) -> int:
        now = time.monotonic()
        if self.view is None or now - self.view_built_s > VIEW_TTL_S:  # a fresh listing, as the directory's
            snapshot = Snapshot(self.s.snapshot.workers, self.s.snapshot.draining, now)
            self.view, self.view_built_s = PoolView(snapshot), now
        scheme = self.view.scheme
        assert scheme is not None
        hashes = hash_blocks(prompt, scheme.block_size, root_hash(scheme.fingerprint, scheme.block_size, ""))
        match = self.mirror.match(hashes)
        busy = self.s.busy
        books = Books(busy.inflight, busy.prefills, busy.pending.lookup(hashes), self.state.rates)
        candidates, preselected = self.view.candidates(match, books, self.preselect, self.state.rng)
        request = RouteRequest(num_prompt_tokens=len(prompt), block_size=scheme.block_size)
        route(request, candidates, self.config, state=self.state, preselected=preselected)
        return len(candidates)


def time_paths(s: Scenario, old_mirror: SetMirror, new: NewPath, n: int) -> dict[str, Any]:
    """``n`` decisions per path, alternating (the same load noise on both), after a warm-up."""
    old_state = RoutingState.for_config(new.config, seed=0)
    times: dict[str, list[float]] = {"old": [], "new": []}
    priced: dict[str, list[int]] = {"old": [], "new": []}
    for i in range(n + 20):
        prompt = s.prompts[i % len(s.prompts)]
        for name, decide in (("old", lambda: old_decision(s, prompt, old_mirror, new.config, old_state)),
                             ("new", lambda: new.decide(prompt))):
            started = time.perf_counter_ns()
            count = decide()
            if i >= 20:
                times[name].append((time.perf_counter_ns() - started) / 1e6)
                priced[name].append(count)
    return {name: {**summary(ms), "candidates": sum(priced[name]) / len(priced[name])} for name, ms in times.items()}


def time_lookups(s: Scenario, old_mirror: SetMirror, mirror: IndexMirror, n: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"old_walk": [], "new_match": []}
    for i in range(n):
        chain = s.chains[i % len(s.chains)]
        for name, fn in (("old_walk", old_mirror.lookup_tiers), ("new_match", mirror.match)):
            started = time.perf_counter_ns()
            fn(chain)
            out[name].append((time.perf_counter_ns() - started) / 1e6)
    return {name: summary(ms) for name, ms in out.items()}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def memory_per_entry(entries: int, rng: random.Random) -> dict[str, float]:
    """Bytes per (block, holder) entry, by ``tracemalloc``, of each mirror filled with ``entries`` entries over
    1,000 holders (a 32-block prefix every holder shares, the rest of each holder's blocks its own)."""
    workers = [f"w{i}" for i in range(1000)]
    shared = [rng.randbytes(16) for _ in range(32)]
    out = {}
    for name, make in (("old_set_mirror", SetMirror), ("new_bitmap_mirror", IndexMirror)):
        gc.collect()
        tracemalloc.start()
        mirror = make()
        for w in workers:
            mirror.store(w, shared)
        fill_filler(mirror, workers, entries - 32 * len(workers), rng)
        used, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[name] = used / entries
        del mirror
    return out


def run(args: Any, rng: random.Random, fingerprint: bytes) -> dict[str, Any]:
    redis = None if args.no_redis else _start_redis()
    rows = []
    try:
        for n in args.workers:
            rows.append(_one_size(args, rng, fingerprint, n, redis))
    finally:
        if redis is not None:
            from deploy.up import stop_all

            stop_all(redis[1])
    print(f"measuring memory per entry at {args.memory_entries:,} entries ...", flush=True)
    memory = memory_per_entry(args.memory_entries, rng) if args.memory_entries else {}
    return {"workers": args.workers, "index_entries": args.index_entries, "decisions": args.scale_decisions,
            "prompt_tokens": PROMPT_TOKENS, "rows": rows, "memory_bytes_per_entry": memory,
            "preselect": dataclasses.asdict(PreselectConfig())}


def _one_size(args: Any, rng: random.Random, fingerprint: bytes, n: int, redis: Any) -> dict[str, Any]:
    print(f"{n} workers: filling the index to {args.index_entries:,} entries ...", flush=True)
    s = scenario(rng, fingerprint, n)
    old_mirror = SetMirror()
    for w, blocks in s.holdings:
        old_mirror.store(w, blocks)
    gc.collect()
    rss_before = rss_bytes()
    row: dict[str, Any] = {"workers": n}
    if redis is not None:
        mirror, row["redis"] = asyncio.run(_via_redis(redis[0], s, args.lookups))
    else:
        mirror = IndexMirror()
        for w, blocks in s.holdings:
            mirror.store(w, blocks)
    ids = [info.worker_id for info, _ in s.snapshot.workers]
    fill_filler(mirror, ids, args.index_entries - mirror.num_entries, rng)
    row["index_entries"] = mirror.num_entries
    row["rss_bytes_per_entry"] = (rss_bytes() - rss_before) / max(mirror.num_entries, 1)
    new = NewPath(s, mirror, PolicyConfig(), PreselectConfig())
    started = time.perf_counter()
    PoolView(s.snapshot)
    row["view_build_ms"] = (time.perf_counter() - started) * 1e3
    print(f"{n} workers: timing {args.scale_decisions} decisions per path ...", flush=True)
    row["decision"] = time_paths(s, old_mirror, new, args.scale_decisions)
    row["lookup"] = time_lookups(s, old_mirror, mirror, min(args.scale_decisions, 300))
    del mirror, new
    gc.collect()
    return row


def _start_redis() -> tuple[str, list[Any]] | None:
    import tempfile

    from bench.decision_latency import _wait_for_redis
    from deploy.up import Child, start_redis

    children: list[Child] = []
    try:
        url = start_redis(Path(tempfile.mkdtemp(prefix="baton-bench-")), children)
    except FileNotFoundError:
        print("no redis-server binary: the index is filled in memory only")
        return None
    _wait_for_redis(url)
    return url, children


async def _via_redis(url: str, s: Scenario, lookups: int) -> tuple[IndexMirror, dict[str, Any]]:
    """Register the workers and publish the prompts' holdings in Redis; build the mirror by ``MirrorSync.sync``."""
    from kv_transfer.redis_index import KVIndex
    from kv_transfer.registry import connect
    from router.routing.mirror_sync import MirrorSync

    redis = connect(url)
    try:
        await redis.flushdb()
        index = KVIndex(redis, "bench")
        await redis.sadd(index.keys.workers, *[info.worker_id for info, _ in s.snapshot.workers])
        for w, blocks in s.holdings:
            await index.publish(w, blocks, [])
        sync = MirrorSync(index)
        started = time.perf_counter()
        await sync.sync()
        sync_s = time.perf_counter() - started
        assert sync.mirror.lookup_tiers(s.chains[0]) == await index.lookup_tiers(s.chains[0])
        script = []
        for i in range(lookups):
            t0 = time.perf_counter_ns()
            await index.lookup_tiers(s.chains[i % len(s.chains)])
            script.append((time.perf_counter_ns() - t0) / 1e6)
        return sync.mirror, {"sync_s": sync_s, "published_entries": sync.mirror.num_entries,
                             "script_lookup": summary(script[min(20, len(script) // 2):])}
    finally:
        await redis.flushdb()
        await redis.aclose()


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'workers':>8}{'entries':>12}{'old p50/p99 ms':>20}{'new p50/p99 ms':>20}{'priced old/new':>16}"
          f"{'walk old/new ms':>18}{'script ms':>11}{'resync s':>10}")
    for row in report["rows"]:
        old, new, lookup = row["decision"]["old"], row["decision"]["new"], row["lookup"]
        redis = row.get("redis")
        script = f"{redis['script_lookup']['p50_ms']:.3f}" if redis else "-"
        resync = f"{redis['sync_s']:.2f}" if redis else "-"
        print(f"{row['workers']:>8}{row['index_entries']:>12,}{old['p50_ms']:>10.3f} /{old['p99_ms']:>7.3f}"
              f"{new['p50_ms']:>10.3f} /{new['p99_ms']:>7.3f}{old['candidates']:>9.0f} /{new['candidates']:>5.1f}"
              f"{lookup['old_walk']['p50_ms']:>10.3f} /{lookup['new_match']['p50_ms']:>6.3f}{script:>11}{resync:>10}")
    for name, per_entry in report["memory_bytes_per_entry"].items():
        print(f"memory, {name}: {per_entry:.0f} B per entry ({per_entry:.0f} MB per million entries)")
    for row in report["rows"]:
        print(f"  {row['workers']} workers: the new mirror's fill grew RSS by {row['rss_bytes_per_entry']:.0f} B "
              f"per entry; PoolView built in {row['view_build_ms']:.2f} ms")
