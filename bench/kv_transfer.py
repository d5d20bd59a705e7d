"""KV transfer benchmark: Baton's ``tcp`` transport vs a raw socket, between two processes on 127.0.0.1.

For the KV of 1k/4k/16k-token prompts of the "small" preset (8 layers, 2 KV heads, head_dim 64,
float32, block_size 16: 128 KiB per block), the server process holds a paged KV buffer and the client
process pulls a prompt's blocks into its own buffer — destination blocks contiguous, and scattered at
random (what a decode worker's free queue hands out after churn). The baseline moves the same number of
bytes with a plain ``sendall`` / ``recv_into`` of one contiguous buffer. Both time connect to last byte;
runs alternate (raw, contiguous, scattered) so machine noise hits each alike; medians are reported.

    python -m bench.kv_transfer [--tokens 1024 4096 16384] [--runs 7] [--uvloop]

Prints a table and writes ``bench/results/kv_transfer.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import socket
import statistics
import struct
import time
from pathlib import Path

import numpy as np

from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.tcp import TcpClient, TcpServer
from kv_transfer.transport import TransportConfig

SMALL = KVLayout(
    model_fingerprint=b"bench-small", dtype="float32", block_size=16, num_layers=8, num_kv_heads=2, head_dim=64
)
RESULTS = Path(__file__).parent / "results" / "kv_transfer.json"


def _install_loop(use_uvloop: bool) -> None:
    if use_uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# --- server processes -----------------------------------------------------------------------------


def baton_server(num_blocks: int, use_uvloop: bool, conn, stop) -> None:
    """Serve one lease over every block of a random buffer until ``stop`` is set."""
    _install_loop(use_uvloop)
    buffer = KVBuffer.allocate(SMALL, num_blocks)
    buffer.array[:] = np.random.default_rng(0).integers(0, 256, buffer.array.shape, dtype=np.uint8)
    table = LeaseTable(default_ttl_s=3600.0)

    async def main() -> None:
        lease = table.create(range(num_blocks), now=time.monotonic())
        server = TcpServer(buffer=buffer, resolve=table.resolver(time.monotonic), config=TransportConfig())
        conn.send((await server.start("127.0.0.1", 0), lease.lease_id))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop()

    asyncio.run(main())


def raw_server(max_bytes: int, conn, stop) -> None:
    """Per connection: read a u64 byte count, ``sendall`` that many bytes of one buffer."""
    data = memoryview(np.random.default_rng(0).integers(0, 256, max_bytes, dtype=np.uint8))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    conn.send(listener.getsockname()[1])
    while not stop.is_set():
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            (num_bytes,) = struct.unpack("<Q", sock.recv(8, socket.MSG_WAITALL))
            sock.sendall(data[:num_bytes])


# --- client side ----------------------------------------------------------------------------------


def raw_pull(port: int, dst: memoryview) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(struct.pack("<Q", dst.nbytes))
        got = 0
        while got < dst.nbytes:
            n = sock.recv_into(dst[got:])
            if n == 0:
                raise ConnectionError("raw server closed early")
            got += n
    return time.perf_counter() - start


async def baton_pull(client: TcpClient, endpoints: dict, src_ids: list[int], dst: KVBuffer, dst_ids: list[int]) -> float:
    stats = await client.pull(endpoints["uri"], SMALL, endpoints["lease_id"], src_ids, dst, dst_ids)
    return stats.seconds


def measure(tokens: int, runs: int, endpoints: dict, loop: asyncio.AbstractEventLoop) -> dict:
    num_blocks = -(-tokens // SMALL.block_size)
    num_bytes = num_blocks * SMALL.bytes_per_block
    dst = KVBuffer.allocate(SMALL, endpoints["num_blocks"])
    raw_dst = memoryview(np.zeros(num_bytes, np.uint8))
    rng = np.random.default_rng(tokens)
    src_ids = [int(b) for b in rng.permutation(endpoints["num_blocks"])[:num_blocks]]
    src_ids.sort()  # a prompt's blocks on the prefill side: mostly in allocation order
    scattered = [int(b) for b in rng.permutation(dst.num_blocks)[:num_blocks]]
    patterns = {"contiguous": list(range(num_blocks)), "scattered": scattered}
    client = TcpClient(TransportConfig())
    seconds: dict[str, list[float]] = {"raw": [], **{name: [] for name in patterns}}
    for run in range(runs + 1):  # run 0 warms up
        timings = {"raw": raw_pull(endpoints["raw_port"], raw_dst)}
        for name, dst_ids in patterns.items():
            timings[name] = loop.run_until_complete(baton_pull(client, endpoints, src_ids, dst, dst_ids))
        if run:
            for name, value in timings.items():
                seconds[name].append(value)
    gbps = {name: num_bytes / statistics.median(values) / 1e9 for name, values in seconds.items()}
    return {"tokens": tokens, "blocks": num_blocks, "num_bytes": num_bytes, "gbps": gbps,
            "seconds": seconds, "ratio_vs_raw": {n: gbps[n] / gbps["raw"] for n in patterns}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--uvloop", action="store_true", help="run both Baton ends on uvloop")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    _install_loop(args.uvloop)
    num_blocks = 2 * -(-max(args.tokens) // SMALL.block_size)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    (b_parent, b_child), (r_parent, r_child) = ctx.Pipe(), ctx.Pipe()
    procs = [
        ctx.Process(target=baton_server, args=(num_blocks, args.uvloop, b_child, stop), daemon=True),
        ctx.Process(target=raw_server, args=(num_blocks * SMALL.bytes_per_block, r_child, stop), daemon=True),
    ]
    for proc in procs:
        proc.start()
    uri, lease_id = b_parent.recv()
    endpoints = {"uri": uri, "lease_id": lease_id, "raw_port": r_parent.recv(), "num_blocks": num_blocks}
    loop = asyncio.new_event_loop()
    results = []
    try:
        for tokens in args.tokens:
            print(f"measuring {tokens}-token prompts ({args.runs} runs)...", flush=True)
            results.append(measure(tokens, args.runs, endpoints, loop))
    finally:
        loop.close()
        stop.set()
        for proc in procs:
            proc.join(5)
    _report(results, args)


def _report(results: list[dict], args: argparse.Namespace) -> None:
    columns = ("tokens", 7), ("MiB", 7), ("raw GB/s", 9), ("tcp contig", 11), ("tcp scatter", 12)
    print("\n" + " ".join(f"{name:>{width}}" for name, width in columns) + f" {'contig/raw':>11} {'scatter/raw':>12}")
    for r in results:
        g, q = r["gbps"], r["ratio_vs_raw"]
        print(f"{r['tokens']:>7} {r['num_bytes'] / 2**20:>7.1f} {g['raw']:>9.2f} {g['contiguous']:>11.2f} "
              f"{g['scattered']:>12.2f} {q['contiguous']:>10.0%} {q['scattered']:>11.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"layout": json.loads(SMALL.to_json()), "runs": args.runs, "uvloop": args.uvloop,
           "python": platform.python_version(), "results": results}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
