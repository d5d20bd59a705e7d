"""``baton bench kv-store`` (``python -m bench.kv_store``): the store tier's client against a Mooncake Store on
loopback, started as ``baton up --kv-store`` starts one: GB/s of writes (``batch_put_from``, checksums included)
and of verified reads (``batch_get_into`` + xxh3 over every block), in batches of blocks of a given size.

    python -m bench.kv_store [--block-kib 256] [--batch 64] [--rounds 8] [--memory "1 GB"]

Each round writes ``batch`` blocks under fresh keys, then reads them back; the median and range over the rounds
are printed. What it measures is the client's path as a worker runs it (the store thread, the per-call deadline,
the checksums), not Mooncake alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from deploy.kv_store import start_store, store_env
from kv_transfer.kv_store import FETCHED, BlockStore, parse_store_uri


async def _rounds(uri: str, block_bytes: int, batch: int, rounds: int) -> tuple[list[float], list[float]]:
    buffer = np.zeros((2 * batch, block_bytes + 64), np.uint8)
    buffer[:batch, :block_bytes] = np.random.default_rng(0).integers(0, 256, (batch, block_bytes), dtype=np.uint8)
    client = BlockStore(parse_store_uri(uri), buffer, block_bytes)
    await client.start()
    puts, gets = [], []
    try:
        for r in range(rounds):
            hashes = [os.urandom(16) for _ in range(batch)]
            started = time.perf_counter()
            assert all(await client.put(hashes, list(range(batch))))
            puts.append(batch * block_bytes / (time.perf_counter() - started) / 1e9)
            started = time.perf_counter()
            verdicts = await client.get(hashes, list(range(batch, 2 * batch)))
            gets.append(batch * block_bytes / (time.perf_counter() - started) / 1e9)
            assert verdicts == [FETCHED] * batch, f"round {r}: {set(verdicts)}"
    finally:
        await client.close()
    return puts, gets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="baton bench kv-store", description=__doc__.split("\n\n")[0])
    p.add_argument("--block-kib", type=int, default=256, help="bytes per block, in KiB (default: %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="blocks per call (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--memory", default="1 GB", help="the standalone client's segment (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="the client's per-call deadline")
    args = p.parse_args(argv)
    procs: list[subprocess.Popen] = []

    def spawn(name, cmd, log_path):
        with log_path.open("wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=store_env()))
        return procs[-1]

    try:
        uri = start_store(Path(tempfile.mkdtemp(prefix="bench-kv-store-")), spawn, memory=args.memory)
        puts, gets = asyncio.run(_rounds(f"{uri}&timeout_s={args.timeout_s}", args.block_kib * 1024, args.batch,
                                         args.rounds))
    finally:
        for popen in reversed(procs):
            popen.terminate()
            popen.wait(10)
    mib = args.block_kib * args.batch / 1024
    for name, rates in (("write", puts), ("read+verify", gets)):
        print(f"{name:12s} {mib:.0f} MiB per call: median {statistics.median(rates):.2f} GB/s "
              f"(min {min(rates):.2f}, max {max(rates):.2f}, {len(rates)} rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
