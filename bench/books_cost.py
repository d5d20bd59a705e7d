"""What sharing books across routers costs a router: per decision, and per sync period.

    python -m bench.books_cost [--workers 16 64 256 1000] [--decisions 2000] [--others 2]

Per worker count N (half prefill, half decode, loads as ``bench.decision_latency`` draws them): one decision is
``shared_books.with_others`` + ``PoolView.candidates`` (pre-selection past 64 workers, as the relay) + ``route()``
for a 4,096-token prompt, with this router's books (2 streams on every decode worker, a prompt sent to every
worker) and ``--others`` other routers' books beside them (streams on every decode worker, prompts on every
worker, 2,048 pending hashes each (the default cap) over 8 workers, a prefix of this prompt among them), against
the same decision with no other router. Per sync period (off the request path, ``books_sync``): building and
encoding this router's document, and decoding and merging the others'. No processes, no Redis.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter

from bench.decision_latency import make_workers
from workload.stats import percentile
from kv_transfer.hashing import hash_blocks, root_hash
from kv_transfer.index_schema import TieredLookup
from router.routing.chain_match import TieredMatch
from router.routing.in_progress import InflightPrefills, PendingPrefixes
from router.routing.policy import PolicyConfig, RouteRequest, RoutingState, route
from router.routing.preselect import Books, PoolView, PreselectConfig
from router.routing.rates import Rates
from router.routing.shared_books import NO_OTHERS, OtherBooks, SharedBooksConfig, decode, own_doc, with_others

FINGERPRINT = bytes(range(16))
ROOT = root_hash(FINGERPRINT, 16)


class RouterBooks:
    """One router's books over ``workers``: 2 streams on every decode worker, a prompt sent to every worker, 16
    prompts of 256 blocks computing on 8 workers (the first a half of ``prompt``), 2,048 of them published."""

    def __init__(self, rng: random.Random, name: str, workers: list, prompt: list[bytes]) -> None:
        self.name, self.workers = name, workers
        self.inflight = Counter({info.worker_id: 2 for info, _ in workers if info.role == "decode"})
        self.prefills, self.pending, self.rates = InflightPrefills(), PendingPrefixes(), Rates()
        for info, _ in workers:
            self.prefills.add(info.worker_id, f"{name}-{info.worker_id}", rng.randint(500, 8000))
        for i in range(16):
            chain = prompt[:128] if i == 0 else hash_blocks([rng.randrange(4096) for _ in range(4096)], 16, ROOT)
            self.pending.add(f"{name}-q{i}", workers[i % 8][0].worker_id, chain)

    def doc(self) -> str:
        """What ``books_sync`` writes when the books changed."""
        cap = SharedBooksConfig().max_pending_hashes
        return own_doc(self.name, int(time.time() * 1000), self.inflight,
                       self.prefills.backlogs(self.workers, self.rates), self.pending.newest(cap)).encode()

    def books(self, prompt: list[bytes]) -> Books:
        return Books(self.inflight, self.prefills, self.pending.lookup(prompt), self.rates)


def timed_us(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e6)
    return out


def measure(num_workers: int, num_others: int, decisions: int) -> dict:
    rng = random.Random(num_workers)
    snapshot = make_workers(rng, FINGERPRINT, num_workers // 2, num_workers // 2)
    workers = list(snapshot.workers)
    prompt = hash_blocks([rng.randrange(4096) for _ in range(4096)], 16, ROOT)
    mine = RouterBooks(rng, "me", workers, prompt)
    books = mine.books(prompt)
    docs = [RouterBooks(rng, f"r{i}", workers, prompt).doc() for i in range(num_others)]
    now_s, now_ms = time.monotonic(), int(time.time() * 1000)
    others = OtherBooks.merge([decode(doc, now_s, now_ms) for doc in docs])
    view, state, config = PoolView(snapshot), RoutingState.for_config(PolicyConfig(), seed=0), PolicyConfig()
    request = RouteRequest(num_prompt_tokens=4096, block_size=16, max_tokens=128)
    match = TieredMatch(TieredLookup())

    def decide(other: OtherBooks) -> None:
        shared = with_others(books, other, prompt)
        candidates, preselected = view.candidates(match, shared, PreselectConfig(), state.rng)
        route(request, candidates, config, state=state, preselected=preselected)

    alone, shared = timed_us(lambda: decide(NO_OTHERS), decisions), timed_us(lambda: decide(others), decisions)
    reads = timed_us(lambda: OtherBooks.merge([decode(d, now_s, now_ms) for d in docs]), 50)
    writes = timed_us(mine.doc, 50)
    return {"workers": num_workers, "alone_p50_us": percentile(alone, 50), "alone_p99_us": percentile(alone, 99),
            "shared_p50_us": percentile(shared, 50), "shared_p99_us": percentile(shared, 99),
            "doc_kb": sum(map(len, docs)) / len(docs) / 1024 if docs else 0.0,
            "read_merge_us": percentile(reads, 50), "build_doc_us": percentile(writes, 50)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.books_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256, 1000])
    p.add_argument("--decisions", type=int, default=2000)
    p.add_argument("--others", type=int, default=2)
    args = p.parse_args(argv)
    print(f"{'workers':>7} {'alone p50':>10} {'p99':>8} {'shared p50':>11} {'p99':>8}  {'doc KB':>6} "
          f"{'read+merge':>11} {'build doc':>10}   (us; read+merge: all {args.others} others' documents)")
    for n in args.workers:
        r = measure(n, args.others, args.decisions)
        print(f"{n:>7} {r['alone_p50_us']:>10.0f} {r['alone_p99_us']:>8.0f} {r['shared_p50_us']:>11.0f} "
              f"{r['shared_p99_us']:>8.0f}  {r['doc_kb']:>6.1f} {r['read_merge_us']:>11.0f} {r['build_doc_us']:>10.0f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
