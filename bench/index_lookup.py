"""KV index lookup cost, index v2 (per tier) vs v1 (one tier), at a few holder counts.

    python -m bench index-lookup [--lookups 300] [--holders 1 4 16 64] [--blocks 256]

Against a private redis-server: ``--holders`` workers each hold a prompt's whole chain of ``--blocks`` hashes
(the walk's worst case: nobody's prefix ends early), half of them in the KV pool and half in the host tier,
and the store holds it too. Timed per lookup of the whole chain, one client, one at a time:

- **v1 script**: the index's lookup before v2 (``HKEYS`` of each block's hash, one count per worker), kept
  here verbatim as the baseline; it reads the same ``{ns}:kv:{hash}`` keys (v2 only adds values to them);
- **v2 script**: ``KVIndex.lookup_tiers`` (``HGETALL``, per worker a KV-pool and a pool-or-host count, and the
  store's count);
- **v1 mirror**: the in-memory mirror's walk before v2 (holder sets intersected along the chain), verbatim;
- **v2 mirror**: ``KVIndex.lookup_tiers``'s answer from the in-memory mirror of index v2 (per block a set of holder
  names, ``bench.set_mirror``: the router's mirror until issue 23);
- **v3 match**: the router's mirror since issue 23 (``IndexMirror.match``: bitmaps over compact holder ids, only
  where prefixes end recorded; holders named on demand);
- **v3 named**: the same with every holder named (``IndexMirror.lookup_tiers``, the full ``TieredLookup``).

Both scripts and both older mirrors walk O(blocks x holders); v3's match costs O(blocks) big-int operations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.set_mirror import SetMirror
from kv_transfer.redis_index import STORE, KVIndex

RESULTS = Path(__file__).parent / "results" / "index_lookup.json"

V1_LOOKUP_LUA = """
local alive, counts = {}, {}
for i = 1, #KEYS do
  local next_alive, any = {}, false
  for _, w in ipairs(redis.call('HKEYS', KEYS[i])) do
    if i == 1 or alive[w] then next_alive[w] = true; counts[w] = i; any = true end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for w, n in pairs(counts) do out[#out + 1] = w; out[#out + 1] = n end
return out
"""


def v1_mirror_lookup(holders_of: dict[bytes, set[str]], hashes: list[bytes]) -> dict[str, int]:
    counts: dict[str, int] = {}
    alive: set[str] | None = None
    for i, h in enumerate(hashes):
        holders = holders_of.get(h)
        if not holders:
            break
        alive = set(holders) if alive is None else alive & holders
        if not alive:
            break
        for worker_id in alive:
            counts[worker_id] = i + 1
    return counts


async def _fill(redis: Any, index: KVIndex, holders: int, hashes: list[bytes]) -> list[str]:
    """Register ``holders`` workers holding every hash (even ones in the KV pool, odd ones in the host tier)
    and the store holding them too; returns the holders' ids."""
    workers = [f"w{i}" for i in range(holders)]
    await redis.sadd(index.keys.workers, *workers)
    for i, worker_id in enumerate(workers):
        await index.publish(worker_id, hashes, [], tier="gpu" if i % 2 == 0 else "cpu")
    await index.publish_store(hashes, [])
    return workers + [STORE]


async def _timed(fn, n: int) -> list[float]:
    for _ in range(min(20, n)):  # warm up (script load, connection)
        await fn()
    out = []
    for _ in range(n):
        started = time.perf_counter_ns()
        await fn()
        out.append((time.perf_counter_ns() - started) / 1e6)
    return out


async def measure(redis_url: str, holder_counts: list[int], num_blocks: int, n: int) -> list[dict]:
    from kv_transfer.registry import connect
    from router.routing.mirror_sync import MirrorSync

    redis = connect(redis_url)
    rows = []
    try:
        v1 = redis.register_script(V1_LOOKUP_LUA)
        rng = random.Random(0)
        for holders in holder_counts:
            await redis.flushdb()
            index = KVIndex(redis, "bench")
            hashes = [rng.randbytes(32) for _ in range(num_blocks)]
            every_holder = set(await _fill(redis, index, holders, hashes))
            keys = [index.keys.kv(h) for h in hashes]
            got = await index.lookup_tiers(hashes)
            assert len(got.gpu_or_cpu) == holders and got.store == num_blocks
            assert len(await v1(keys=keys)) == 2 * (holders + 1)  # v1 counts the store as one more "worker"
            sync = MirrorSync(index)
            await sync.sync()
            assert sync.mirror.lookup_tiers(hashes) == got
            sets = SetMirror()
            for holder in sync.followed:
                for tier in ("gpu", "cpu", "store"):
                    sets.store(holder, [h for h, t in sync.mirror.held(holder).items() if t == tier], tier)
            assert sets.lookup_tiers(hashes) == got

            v1_holders = {h: every_holder for h in hashes}  # the same holders, no tiers
            assert len(v1_mirror_lookup(v1_holders, hashes)) == holders + 1

            async def mirrored() -> None:
                sets.lookup_tiers(hashes)

            async def matched() -> None:
                sync.mirror.match(hashes)

            async def named() -> None:
                sync.mirror.lookup_tiers(hashes)

            async def v1_mirrored() -> None:
                v1_mirror_lookup(v1_holders, hashes)

            print(f"timing {n} lookups of {num_blocks} blocks x {holders} holders ...", flush=True)
            rows.append({"holders": holders, "blocks": num_blocks,
                         "v1_script": summary(await _timed(lambda: v1(keys=keys), n)),
                         "v2_script": summary(await _timed(lambda: index.lookup_tiers(hashes), n)),
                         "v1_mirror": summary(await _timed(v1_mirrored, n)),
                         "v2_mirror": summary(await _timed(mirrored, n)),
                         "v3_match": summary(await _timed(matched, n)),
                         "v3_named": summary(await _timed(named, n))})
        await redis.flushdb()
    finally:
        await redis.aclose()
    return rows


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {"p50_ms": statistics.median(ordered), "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench index-lookup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lookups", type=int, default=300, help="timed lookups per configuration")
    p.add_argument("--holders", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--blocks", type=int, default=256, help="blocks in the prompt's chain (4,096 tokens of 16)")
    args = p.parse_args(argv)
    from bench.decision_latency import _wait_for_redis
    from deploy.up import Child, start_redis, stop_all

    children: list[Child] = []
    redis_url = start_redis(Path(tempfile.mkdtemp(prefix="baton-bench-")), children)
    try:
        _wait_for_redis(redis_url)
        rows = asyncio.run(measure(redis_url, args.holders, args.blocks, args.lookups))
    finally:
        stop_all(children)
    columns = ("v1_script", "v2_script", "v1_mirror", "v2_mirror", "v3_match", "v3_named")
    print(f"\n{'holders':>8}" + "".join(f"{c.replace('_', ' ') + ' p50/p99 ms':>22}" for c in columns))
    for row in rows:
        cells = [f"{row[k]['p50_ms']:.3f} / {row[k]['p99_ms']:.3f}" for k in columns]
        print(f"{row['holders']:>8}" + "".join(f"{c:>22}" for c in cells))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"lookups": args.lookups, "rows": rows}, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
