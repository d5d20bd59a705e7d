"""What host staging (``--kv-staging always``) costs a pull, side by side with the same pull served in place.

For the KV of 1k/4k/16k-token prompts of ``bench.kv_transfer``'s "small" preset (128 KiB per block), a tcp
server process holds the source blocks and this process pulls a prompt's blocks into scattered destination
blocks, alternating in each round:
- ``in place``: ``client.pull`` straight into the destination cache (what a CPU worker does);
- ``staged``: what a staging worker pair does per request: P's ``copy_out`` of the prompt's blocks into its
  staging blocks (timed here, on this process's copy of the source, since the server's copy happens at lease
  open), ``pull_staged`` (the pull into D's staging blocks plus D's ``copy_in`` into its cache).
Each staged pull is checked byte for byte against the in-place one. Prints median GB/s and the staged /
in-place ratio; writes ``bench/results/kv_staging.json``.

    python -m bench.kv_staging [--tokens 1024 4096 16384] [--runs 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.kv_transfer import SMALL, source_buffer, transport_server
from kv_transfer.staging import KVRegion, StagingPool, pull_staged
from kv_transfer.transport import connect

RESULTS = Path(__file__).parent / "results" / "kv_staging.json"


def _blocks(tokens: int, total: int) -> tuple[list[int], list[int]]:
    n = -(-tokens // SMALL.block_size)
    rng = np.random.default_rng(tokens)
    return sorted(int(b) for b in rng.permutation(total)[:n]), [int(b) for b in rng.permutation(total)[:n]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    total = -(-max(args.tokens) // SMALL.block_size) + 8
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    stop = ctx.Event()
    server = ctx.Process(target=transport_server, args=("tcp", total, False, "cpu", [], child, stop), daemon=True)
    server.start()
    status, endpoint = parent.recv()
    if status != "ok":
        raise SystemExit(f"tcp server did not start: {endpoint}")
    src_region = KVRegion(SMALL, torch.from_numpy(source_buffer(total).array))  # what P's staging copies from
    p_pool = StagingPool(src_region, total)
    dst_region = KVRegion(SMALL, torch.zeros((SMALL.num_layers, total, SMALL.bytes_per_block_per_layer),
                                            dtype=torch.uint8))
    d_pool = StagingPool(dst_region, total)
    client, loop = connect(endpoint["uri"]), asyncio.new_event_loop()
    uri, lease = endpoint["uri"], endpoint["lease_id"]
    results = []
    try:
        for tokens in args.tokens:
            src, dst = _blocks(tokens, total)
            num_bytes = len(src) * SMALL.bytes_per_block
            in_place: list[float] = []
            staged: list[float] = []
            for run in range(args.runs + 1):  # the first round warms up (and is checked)
                start = time.perf_counter()
                loop.run_until_complete(client.pull(uri, SMALL, lease, src, dst_region.host_buffer(), dst))
                t_in_place = time.perf_counter() - start
                expected = dst_region.kv[:, dst].clone() if run == 0 else None
                dst_region.kv[:, dst] = 0
                start = time.perf_counter()
                ids = p_pool.allocate(len(src))
                p_pool.copy_out(src, ids)  # P stages the lease as it opens
                p_pool.free(ids)
                loop.run_until_complete(pull_staged(client, d_pool, uri, SMALL, lease, src, dst))
                t_staged = time.perf_counter() - start
                if run == 0:
                    assert torch.equal(dst_region.kv[:, dst], expected), "the staged pull landed other bytes"
                    continue
                in_place.append(t_in_place)
                staged.append(t_staged)
            row = {"tokens": tokens, "bytes": num_bytes,
                   "in_place_gbps": num_bytes / statistics.median(in_place) / 1e9,
                   "staged_gbps": num_bytes / statistics.median(staged) / 1e9}
            row["staged_ratio"] = row["staged_gbps"] / row["in_place_gbps"]
            results.append(row)
            print(f"{tokens:>6} tokens {num_bytes / 2**20:7.1f} MiB   in place {row['in_place_gbps']:5.2f} GB/s   "
                  f"staged {row['staged_gbps']:5.2f} GB/s   staged / in place {row['staged_ratio']:.2f}", flush=True)
    finally:
        client.close()
        loop.close()
        stop.set()
        server.join(10)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.platform(), "runs": args.runs, "results": results},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
