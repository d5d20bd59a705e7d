"""KV transfer benchmark: every Baton transport and two peers vs a raw socket, two processes on 127.0.0.1.

For the KV of 1k/4k/16k-token prompts of the "small" preset (8 layers, 2 KV heads, head_dim 64,
float32, block_size 16: 128 KiB per block), a server process per system holds a paged KV buffer and
this process pulls a prompt's blocks into its own buffer. Patterns (``PATTERNS``), the same bytes each:

- ``contiguous``: the prompt's source blocks (sorted, scattered over the server's pool, as a prefill
  worker's free queue hands them out) into destination blocks 0..n-1;
- ``scattered``: the same source blocks into destination blocks at random (a decode worker after churn);
- ``merged``: source blocks 0..n-1 into destination blocks 0..n-1, so one run per layer on both sides:
  the fewest, largest descriptors a peer can be given ("at its best"), where the other two patterns
  drive it as Baton's layout does, with a descriptor per layer per run of blocks (mostly 1-2 blocks).

Systems:

- ``raw``: the baseline, the best a plain socket does with the same number of bytes: per prompt size
  the faster (by median) of two plain clients, each on a TCP connection opened at setup and kept (as
  Baton's pooled ones), a u64 request answered by ``sendall`` of one contiguous buffer, no framing, no
  layout: ``raw/blocking`` (one ``recv_into(MSG_WAITALL)`` into one contiguous buffer) and ``raw/epoll``
  (non-blocking ``recv_into`` until EAGAIN, then ``epoll``). Neither is always the faster here: on this
  VM a non-blocking receiver often moves 1.3-1.6x what a blocking one does, and then not;
- ``plain/<pattern>``: a control per pattern, a plain blocking socket moving the same blocks to the same
  places: the request names the source blocks, the raw server ``sendmsg``s their views (one per layer per
  run of blocks: the gather tcp's server does) and the client ``recvmsg_into``s the destination blocks'
  views (tcp's scatter), IOV_MAX views a call, ``MSG_WAITALL``. What the kernel's gather and scatter cost,
  apart from ours: each pattern system's ``vs plain`` is against the plain row of its pattern;
- ``memcpy``: a reference, not a transfer: ``np.copyto`` of the same bytes inside this process (the
  memory's own ceiling on this machine; a loopback TCP byte is copied twice, in and out of the kernel);
- every Baton transport in ``kv_transfer.transport.TRANSPORT_KINDS`` but ``local`` (``make_server`` /
  ``connect``, one client per system): a full pull, request to last byte; tcp and cma keep their connection
  alive between pulls (``kv_transfer/conn_pool.py``), so the warm-up pull opens it;
- the peers NVIDIA NIXL (UCX backend, READ) and the Mooncake Transfer Engine (TCP, P2PHANDSHAKE), in
  ``bench/kv_peers.py``: per-transfer READ descriptors of the same blocks, connected once at setup.

A system that is not installed or fails to start is reported as skipped with the reason. Every system's
first (warm-up) transfer of each size is checked byte for byte. Runs alternate systems (rotating who goes
first) so machine noise hits each alike. Reports median GB/s, per-transfer p50/p99 latency and ratios
vs raw (and vs plain, per pattern); prints a table and writes ``bench/results/kv_transfer.json`` and ``.png``
(or ``--out``).

``--device cuda`` moves the KV between two processes' CUDA tensors instead (``bench/kv_device.py``: nixl,
ucx and nccl in place, tcp and cma through pinned host staging, as a worker on a GPU serves them), with the
device's own copy as the ``memcpy`` row (``torch`` ``copy_`` device to device); the peers are not run then, and
without a GPU it refuses at once.

``--isolate`` is how to compare against the peers: a shared run is not fair on a small machine, because
NIXL's UCX progress thread spins on a core for as long as its agent lives (on 2 cores every other system,
raw included, loses about half its bandwidth). Isolated, the run has one phase per system. Only raw and
that system's processes exist during a phase, and raw is measured in every phase so that each system's
ratio is against its own phase's raw (``bench/kv_phases.py``).

    python -m bench.kv_transfer [--isolate] [--tokens 1024 4096 16384] [--runs 7] [--transports tcp ...]
                                [--peers nixl mooncake] [--nixl-ucx-tls tcp] [--uvloop] [--device cpu|cuda]
                                [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import select
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import kv_device, kv_peers
from workload.plots import pyplot
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.tcp_wire import IOV_MAX, advance
from kv_transfer.transport import TRANSPORT_KINDS, connect, make_server

SMALL = KVLayout(
    model_fingerprint=b"bench-small", dtype="float32", block_size=16, num_layers=8, num_kv_heads=2, head_dim=64
)
RESULTS = Path(__file__).parent / "results" / "kv_transfer.json"
BASELINE = "raw"  # the faster of RAW_VARIANTS, per prompt size
RAW_VARIANTS = ("raw/blocking", "raw/epoll")
PLAIN = "plain"  # plain/<pattern>: a plain blocking socket moving the same blocks as the pattern (gather, scatter)
REFERENCE = "memcpy"
PATTERNS = ("contiguous", "scattered", "merged")
BLOCKS_REQUEST = 1 << 63  # a raw request's u64 with this bit: the low bits count u32 source block ids that follow
# Mooncake's TCP transport refuses a batch with more slices than this queue (one per layer per run of
# blocks here): it must hold the largest prompt's worst case.
MOONCAKE_QUEUE = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
ENV_DEFAULTS = {
    "NIXL_LOG_LEVEL": "WARN",
    "MC_LOG_LEVEL": "ERROR",
    "UCX_WARN_UNUSED_ENV_VARS": "n",  # NIXL's older UCX does not know ucxx's variables
    MOONCAKE_QUEUE: "16384",
}
START_TIMEOUT_S = 120.0  # spawn + imports + buffer fill, on a busy 2-core machine


def default_transports() -> list[str]:
    return [kind for kind in TRANSPORT_KINDS if kind != "local"]


def _install_loop(use_uvloop: bool) -> None:
    if use_uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def source_buffer(num_blocks: int) -> KVBuffer:
    """Every 8 bytes hold their own offset: any misplaced or missing byte shows when checked."""
    buffer = KVBuffer.allocate(SMALL, num_blocks)
    flat = buffer.array.reshape(-1).view(np.uint64)
    flat[:] = np.arange(flat.size, dtype=np.uint64)
    return buffer


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --- server processes (each replies ("ok", endpoint) or ("skip", reason), then serves until stop) ---


def transport_server(kind: str, num_blocks: int, use_uvloop: bool, device: str, tokens: list[int], conn,
                     stop) -> None:
    """Serve the source buffer with Baton transport ``kind`` (on ``device``): a lease per prompt's source blocks
    (as a prefill worker leases exactly a prompt's blocks; ``leases``: [source ids, lease id] pairs), and one
    over every block (the device path's)."""
    _install_loop(use_uvloop)

    async def main() -> None:
        buffer, table = source_buffer(num_blocks), LeaseTable(default_ttl_s=3600.0)
        lease = table.create(range(num_blocks), now=time.monotonic())
        sources = {tuple(src) for n in tokens for src, _ in prompt_blocks(n, num_blocks).values()}
        leases = [[list(src), table.create(src, now=time.monotonic()).lease_id] for src in sources]
        try:
            if device == "cuda":  # pragma: no cover - never run here (no GPU)
                server = kv_device.serve(kind, SMALL, buffer.array, table, lease.lease_id, time.monotonic)
            else:
                server = make_server(kind, buffer=buffer, resolve=table.resolver(time.monotonic))
            uri = await server.start("127.0.0.1", 0)
        except Exception as exc:  # noqa: BLE001 - a missing package or no GPU: skipped, not a crash
            conn.send(("skip", _reason(exc)))
            return
        conn.send(("ok", {"uri": uri, "lease_id": lease.lease_id, "leases": leases}))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop()

    asyncio.run(main())


def peer_server(name: str, num_blocks: int, options: dict[str, str], conn, stop) -> None:
    """Register the source buffer with peer ``name`` and keep it alive until ``stop``."""
    try:
        server = kv_peers.serve(name, source_buffer(num_blocks), options)
    except Exception as exc:  # noqa: BLE001 - PeerUnavailable or a failed start: skipped
        conn.send(("skip", _reason(exc)))
        return
    conn.send(("ok", server.endpoint))
    while not stop.wait(0.001):
        server.poll()
    server.close()


def raw_server(max_bytes: int, conn, stop) -> None:
    """A thread per connection, until its client closes it: read a u64 byte count, ``sendall`` that many
    bytes of the source pattern on a blocking socket; or (``BLOCKS_REQUEST``) a count of source block ids and
    the ids, ``sendmsg`` of those blocks' views (``plain/<pattern>``)."""
    buffer = source_buffer(-(-max_bytes // SMALL.bytes_per_block))
    data = memoryview(buffer.array.reshape(-1))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    conn.send(("ok", {"port": listener.getsockname()[1]}))

    def serve(sock: socket.socket) -> None:
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while select.select([sock], [], [], 0.5)[0] or not stop.is_set():  # wakes up to see ``stop``
                request = sock.recv(8, socket.MSG_WAITALL)
                if len(request) < 8:
                    return  # the client closed its connection
                count = struct.unpack("<Q", request)[0]
                if count & BLOCKS_REQUEST:
                    ids = np.frombuffer(sock.recv(4 * (count ^ BLOCKS_REQUEST), socket.MSG_WAITALL), np.uint32)
                    send_views(sock, buffer.segments(ids.tolist()))
                else:
                    sock.sendall(data[:count])

    while not stop.is_set():
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        sock.setblocking(True)
        threading.Thread(target=serve, args=(sock,), daemon=True).start()


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Every byte of ``views`` in order on a blocking socket, IOV_MAX views a ``sendmsg``."""
    i = 0
    while i < len(views):
        i = advance(views, i, sock.sendmsg(views[i : i + IOV_MAX]))


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Every byte of ``views`` in order from a blocking socket, IOV_MAX views a ``recvmsg_into(MSG_WAITALL)``."""
    i = 0
    while i < len(views):
        n = sock.recvmsg_into(views[i : i + IOV_MAX], 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise ConnectionError("raw server closed early")
        i = advance(views, i, n)


@dataclass(slots=True)
class Servers:
    stop: object
    procs: dict[str, mp.Process] = field(default_factory=dict)
    endpoints: dict[str, dict] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def start_servers(args: argparse.Namespace, num_blocks: int) -> Servers:
    """One server process per system; waits for each to say where it listens, or why it cannot."""
    ctx = mp.get_context("spawn")
    servers, pipes = Servers(stop=ctx.Event()), {}
    targets = {BASELINE: (raw_server, (num_blocks * SMALL.bytes_per_block,))}
    for kind in args.transports:
        targets[kind] = (transport_server, (kind, num_blocks, args.uvloop, getattr(args, "device", "cpu"), args.tokens))
    for name in args.peers:  # "<peer>-peer": Baton has a nixl transport of its own, measured beside NIXL itself
        targets[peer_system(name)] = (peer_server, (name, num_blocks, _peer_options(args)))
    for name, (target, extra) in targets.items():
        pipes[name], child = ctx.Pipe()
        servers.procs[name] = ctx.Process(target=target, args=(*extra, child, servers.stop), daemon=True)
        servers.procs[name].start()
    print(f"starting servers: {', '.join(targets)}...", flush=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    for name, pipe in pipes.items():
        status, payload = _await_reply(servers.procs[name], pipe, deadline)
        (servers.endpoints if status == "ok" else servers.skipped)[name] = payload
        print(f"  {name}: {'ready' if status == 'ok' else 'skipped'}", flush=True)
    return servers


def _await_reply(proc: mp.Process, pipe, deadline: float) -> tuple[str, object]:
    while not pipe.poll(0.1):
        if not proc.is_alive():
            return "skip", f"server process exited with code {proc.exitcode} before it was ready"
        if time.monotonic() > deadline:
            return "skip", f"server not ready within {START_TIMEOUT_S:.0f} s"
    return pipe.recv()


def stop_servers(servers: Servers) -> None:
    servers.stop.set()
    for proc in servers.procs.values():
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


PEER_SUFFIX = "-peer"


def peer_system(name: str) -> str:
    """The system name of peer ``name`` (``nixl-peer``), apart from Baton's transport of the same name."""
    return name + PEER_SUFFIX


def _peer_options(args: argparse.Namespace) -> dict[str, str]:
    options = {"nixl_progress_thread": "1" if args.nixl_progress_thread else "0"}
    return options | ({"nixl_ucx_tls": args.nixl_ucx_tls} if args.nixl_ucx_tls else {})


# --- client side: a system is a name and a timed pull ---------------------------------------------

Pull = Callable[[list[int], list[int]], tuple[float, int]]  # (src ids, dst ids) -> (seconds, bytes moved)


@dataclass(frozen=True, slots=True)
class System:
    name: str  # "raw", "<kind>/<pattern>", "<peer>/<pattern>"
    pattern: str
    pull: Pull
    landed: Callable[[list[int], list[int]], np.ndarray]  # (src ids, dst ids) -> a view of where bytes land
    expected: Callable[[list[int]], np.ndarray]  # src ids -> what must have landed
    clear: Callable[[list[int], list[int]], None]  # poison the destination before a checked pull


def make_systems(
    servers: Servers, args: argparse.Namespace, dst: KVBuffer, loop: asyncio.AbstractEventLoop
) -> tuple[list[System], list[Callable[[], None]]]:
    """The client of each started server (a failing connect is skipped too); and what closes them."""
    ref = source_buffer(dst.num_blocks)  # what every server holds

    def raw_expected(src_ids: list[int]) -> np.ndarray:
        return ref.array.reshape(-1)[: len(src_ids) * SMALL.bytes_per_block]

    def kv_expected(src_ids: list[int]) -> np.ndarray:
        return ref.array[:, src_ids]  # [L, n, seg]

    raw_dst, copy_src = np.zeros(dst.array.nbytes, np.uint8), ref.array.reshape(-1)
    device = kv_device.Destination(SMALL, dst.num_blocks) if args.device == "cuda" else None
    port = servers.endpoints[BASELINE]["port"]
    raws = {"raw/blocking": RawClient(port), "raw/epoll": RawClient(port, blocking=False)}

    def raw_landed(src_ids: list[int], _dst_ids: list[int]) -> np.ndarray:
        return raw_dst[: len(src_ids) * SMALL.bytes_per_block]

    def raw_clear(src_ids: list[int], dst_ids: list[int]) -> None:
        raw_landed(src_ids, dst_ids).fill(0xFF)

    def memcpy(src_ids: list[int], dst_ids: list[int]) -> tuple[float, int]:
        out = raw_landed(src_ids, dst_ids)
        start = time.perf_counter()
        np.copyto(out, copy_src[: out.size])
        return time.perf_counter() - start, out.size

    def kv_clear(_src_ids: list[int], dst_ids: list[int]) -> None:
        dst.array[:, dst_ids] = 0xFF

    systems = [System(name, "contiguous", lambda s, d, raw=raw: raw.pull(raw_landed(s, d)), raw_landed,
                      raw_expected, raw_clear) for name, raw in raws.items()]
    if device is None:  # a plain socket moving the same blocks to the same places as each pattern
        plain = RawClient(port)
        systems += [System(f"{PLAIN}/{p}", p, lambda s, d: plain.pull_blocks(s, dst, d), lambda _s, d: dst.array[:, d],
                           kv_expected, kv_clear) for p in PATTERNS]
        raws[PLAIN] = plain
    else:  # pragma: no cover - never run here (no GPU): the device's own copy is the ceiling
        ceiling = kv_device.d2d_copy(ref.array)
        memcpy = lambda s, d: ceiling(raw_landed(s, d), None)  # noqa: E731
    systems.append(System(REFERENCE, "contiguous", memcpy, raw_landed, raw_expected, raw_clear))
    closers: list[Callable[[], None]] = [raw.close for raw in raws.values()]
    for name, endpoint in servers.endpoints.items():
        if name == BASELINE:
            continue
        try:
            pull, close = _client(name, endpoint, args, dst, loop, device)
        except Exception as exc:  # noqa: BLE001 - reported as skipped
            servers.skipped[name] = f"client: {_reason(exc)}"
            continue
        landed = (lambda _s, d: dst.array[:, d]) if device is None else device.landed  # [L, n, seg]
        clear = kv_clear if device is None else device.clear
        systems += [System(f"{name}/{p}", p, pull, landed, kv_expected, clear) for p in PATTERNS]
        closers.append(close)
    return systems, closers


def _client(name: str, endpoint: dict, args: argparse.Namespace, dst: KVBuffer, loop,
            device: kv_device.Destination | None = None) -> tuple[Pull, Callable]:
    if name.endswith(PEER_SUFFIX):
        peer = kv_peers.connect(name.removesuffix(PEER_SUFFIX), endpoint, dst, _peer_options(args))

        def peer_pull(src_ids: list[int], dst_ids: list[int]) -> tuple[float, int]:
            start = time.perf_counter()
            num_bytes = peer.read(src_ids, dst_ids)
            return time.perf_counter() - start, num_bytes

        return peer_pull, peer.close
    client = connect(endpoint["uri"])
    if device is not None:  # pragma: no cover - never run here (no GPU)
        kind = name

        def device_pull(src_ids: list[int], dst_ids: list[int]) -> tuple[float, int]:
            return device.pull(kind, client, loop, endpoint["uri"], SMALL, endpoint["lease_id"], src_ids, dst_ids)

        return device_pull, getattr(client, "close", lambda: None)

    leases = {tuple(src): lease_id for src, lease_id in endpoint["leases"]}

    def baton_pull(src_ids: list[int], dst_ids: list[int]) -> tuple[float, int]:
        pull = client.pull(endpoint["uri"], SMALL, leases[tuple(src_ids)], src_ids, dst, dst_ids)
        stats = loop.run_until_complete(pull)
        return stats.seconds, stats.num_bytes

    return baton_pull, getattr(client, "close", lambda: None)  # pooled connections (tcp, cma, nccl)


class RawClient:
    """A baseline client: one connection, opened now and kept for every pull; blocking (one
    ``recv_into(MSG_WAITALL)``) or not (``recv_into`` until EAGAIN, then ``epoll``)."""

    def __init__(self, port: int, blocking: bool = True) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setblocking(blocking)  # an 8-byte request always fits the idle socket's buffer
        self._epoll = None if blocking else select.epoll()
        if self._epoll is not None:
            self._epoll.register(self._sock.fileno(), select.EPOLLIN)

    def pull(self, dst: np.ndarray) -> tuple[float, int]:
        view = memoryview(dst)
        start = time.perf_counter()
        self._sock.sendall(struct.pack("<Q", view.nbytes))
        got, flags = 0, socket.MSG_WAITALL if self._epoll is None else 0
        while got < view.nbytes:  # blocking: one call, unless a signal interrupts it
            try:
                n = self._sock.recv_into(view[got:], 0, flags)
            except BlockingIOError:
                self._epoll.poll(30.0)
                continue
            if n == 0:
                raise ConnectionError("raw server closed early")
            got += n
        return time.perf_counter() - start, got

    def pull_blocks(self, src_ids: list[int], dst: KVBuffer, dst_ids: list[int]) -> tuple[float, int]:
        """``plain/<pattern>``: source blocks ``src_ids`` into ``dst_ids`` of ``dst`` (blocking: the gather and
        scatter of the same views as tcp's; the views are made inside the timing, as a transport makes them)."""
        start = time.perf_counter()
        ids = np.asarray(src_ids, np.uint32)
        self._sock.sendall(struct.pack("<Q", BLOCKS_REQUEST | len(ids)) + ids.tobytes())
        views = dst.segments(dst_ids)
        recv_views(self._sock, views)
        return time.perf_counter() - start, len(dst_ids) * SMALL.bytes_per_block

    def close(self) -> None:
        self._sock.close()
        if self._epoll is not None:
            self._epoll.close()


# --- measuring ------------------------------------------------------------------------------------


def prompt_blocks(tokens: int, total_blocks: int) -> dict[str, tuple[list[int], list[int]]]:
    """Per pattern (``PATTERNS``), the prompt's (source blocks, destination blocks): sources sorted (mostly
    allocation order on the prefill side) and spread over the pool, or 0..n-1 for ``merged``."""
    num_blocks = -(-tokens // SMALL.block_size)
    rng = np.random.default_rng(tokens)
    src_ids = sorted(int(b) for b in rng.permutation(total_blocks)[:num_blocks])
    scattered = [int(b) for b in rng.permutation(total_blocks)[:num_blocks]]
    first = list(range(num_blocks))
    return {"contiguous": (src_ids, first), "scattered": (src_ids, scattered), "merged": (first, first)}


def _checked_pull(system: System, src_ids: list[int], dst_ids: list[int]) -> tuple[float, int]:
    """The warm-up pull: the destination is poisoned first, then compared byte for byte."""
    system.clear(src_ids, dst_ids)
    elapsed, num_bytes = system.pull(src_ids, dst_ids)
    if num_bytes != len(src_ids) * SMALL.bytes_per_block:
        raise AssertionError(f"moved {num_bytes} bytes, expected {len(src_ids) * SMALL.bytes_per_block}")
    if not np.array_equal(system.landed(src_ids, dst_ids), system.expected(src_ids)):
        raise AssertionError("the bytes that landed differ from the source blocks")
    return elapsed, num_bytes


def _timed_pull(system: System, src_ids: list[int], dst_ids: list[int]) -> tuple[float, int]:
    return system.pull(src_ids, dst_ids)


def measure(tokens: int, runs: int, systems: list[System], total_blocks: int, skipped: dict[str, str]) -> dict:
    """``runs`` timed transfers per system after one checked warm-up; systems alternate, rotating."""
    patterns = prompt_blocks(tokens, total_blocks)
    seconds: dict[str, list[float]] = {s.name: [] for s in systems}
    moved: dict[str, int] = {}
    warm_s = 0.0
    for run in range(runs + 1):  # run 0 warms up and checks the bytes
        for system in systems[run % len(systems):] + systems[: run % len(systems)]:
            if system.name not in seconds:
                continue
            pull = _checked_pull if run == 0 else _timed_pull
            try:
                elapsed, moved[system.name] = pull(system, *patterns[system.pattern])
            except Exception as exc:  # noqa: BLE001 - one system failing must not end the others' runs
                if system.name in RAW_VARIANTS:
                    raise
                skipped[system.name] = f"{tokens} tokens, run {run}: {_reason(exc)}"
                del seconds[system.name]
                continue
            if run:
                seconds[system.name].append(elapsed)
            else:
                warm_s += elapsed
        eta = f" (~{warm_s * runs:.0f} s to go)" if run == 0 else ""
        print(f"\r  {tokens} tokens: run {run}/{runs} done{eta}", end="", flush=True)
    print(flush=True)
    num_blocks = len(patterns["merged"][0])
    num_bytes = num_blocks * SMALL.bytes_per_block
    return {"tokens": tokens, "blocks": num_blocks, "num_bytes": num_bytes,
            "systems": summarize(seconds, moved, num_bytes)}


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    return float(np.percentile(values, q))


def summarize(seconds: dict[str, list[float]], moved: dict[str, int], num_bytes: int) -> dict[str, dict]:
    """Per system: median GB/s, p50/p99 latency, ratio vs ``raw``, which is added first: a copy of the
    faster of ``RAW_VARIANTS`` (``best_of`` names it); a pattern's system also vs ``plain/<pattern>`` when that
    ran (``ratio_vs_plain``, ``plain_gbps``)."""
    out = {}
    for name, values in seconds.items():
        out[name] = {"gbps": num_bytes / statistics.median(values) / 1e9,
                     "p50_ms": percentile(values, 50) * 1e3, "p99_ms": percentile(values, 99) * 1e3,
                     "bytes_moved": moved[name], "seconds": values}
    best = max((name for name in RAW_VARIANTS if name in out), key=lambda name: out[name]["gbps"])
    out = {BASELINE: {**out[best], "best_of": best}, **out}
    for name, stats in out.items():
        stats["ratio_vs_raw"] = stats["gbps"] / out[BASELINE]["gbps"]
        system, _, pattern = name.rpartition("/")
        if pattern in PATTERNS and system != PLAIN and (plain := out.get(f"{PLAIN}/{pattern}")) is not None:
            stats["plain_gbps"], stats["ratio_vs_plain"] = plain["gbps"], stats["gbps"] / plain["gbps"]
    return out


# --- report -----------------------------------------------------------------------------------------


def describe(started: list[str], args: argparse.Namespace) -> dict[str, str]:
    """What each started system is, for the JSON."""
    out = {BASELINE: "the faster of raw/blocking and raw/epoll, per prompt size",
           "raw/blocking": "sendall / one recv_into(MSG_WAITALL) of one contiguous buffer, one kept-alive connection",
           "raw/epoll": "sendall / non-blocking recv_into + epoll of one contiguous buffer, one kept-alive connection",
           f"{PLAIN}/<pattern>": "sendmsg / recvmsg_into(MSG_WAITALL) of the pattern's source and destination block "
                                 "views (tcp's gather and scatter), blocking, one kept-alive connection",
           REFERENCE: "np.copyto of the same bytes inside the pulling process (a reference, not a transfer)"
           if args.device == "cpu" else "torch copy_ of the same bytes between two CUDA tensors (the device's copy)"}
    for name in started:
        if name == peer_system("nixl"):
            out[name] = (f"{kv_peers.peer_package('nixl')} {kv_peers.peer_version('nixl')}, UCX backend, READ, "
                         f"UCX_TLS={args.nixl_ucx_tls or 'default (same host: cma)'}, progress thread "
                         f"{'on' if args.nixl_progress_thread else 'off (polled)'}")
        elif name == peer_system("mooncake"):
            out[name] = (f"mooncake-transfer-engine-non-cuda {kv_peers.peer_version('mooncake')}, tcp, "
                         "P2PHANDSHAKE, READ")
        elif name != BASELINE:
            out[name] = f"Baton {name} transport: make_server / connect(uri).pull, request to last byte (kept-alive)"
    return out


def print_table(results: list[dict], skipped: dict[str, str], isolated: bool = False) -> None:
    """Isolated: raw and plain are pooled over the phases, and each system's "vs raw" ("vs plain") is against the
    raw (plain) of its own phase, shown in the last column."""
    print(f"\n{'tokens':>7} {'MiB':>6}  {'system':<22} {'GB/s':>6} {'p50 ms':>8} {'p99 ms':>8} {'vs raw':>7} "
          f"{'vs plain':>8}" + (f" {'phase raw GB/s':>14}" if isolated else ""))
    for r in results:
        for name, s in r["systems"].items():
            phase_raw = f" {s['raw_gbps']:>14.2f}" if isolated and "raw_gbps" in s else ""
            vs_plain = f"{s['ratio_vs_plain']:>8.0%}" if "ratio_vs_plain" in s else f"{'':>8}"
            print(f"{r['tokens']:>7} {r['num_bytes'] / 2**20:>6.1f}  {name:<22} {s['gbps']:>6.2f} "
                  f"{s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {s['ratio_vs_raw']:>7.0%} {vs_plain}{phase_raw}")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")


def plot(doc: dict, path: Path) -> Path | None:
    """Grouped bars: median GB/s per system per prompt size (one colour per system, scattered hatched ``//``,
    merged ``..``);
    whiskers down to the GB/s at p99 latency. The path written, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None

    results = doc["results"]
    # "raw" is a copy of the faster of its variants, which are drawn
    names = list(dict.fromkeys(name for r in results for name in r["systems"] if name != BASELINE))
    colours = {base: f"C{i}" for i, base in enumerate(dict.fromkeys(n.split("/")[0] for n in names))}
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(min(16.0, max(7.0, 0.25 * len(names) * len(results))), 6.0))
    for i, name in enumerate(names):
        rows = [(j, r) for j, r in enumerate(results) if name in r["systems"]]
        gbps = [r["systems"][name]["gbps"] for _, r in rows]
        at_p99 = [r["num_bytes"] / r["systems"][name]["p99_ms"] / 1e6 for _, r in rows]
        xs = [j + (i - (len(names) - 1) / 2) * width for j, _ in rows]
        ax.bar(xs, gbps, width, label=name, color=colours[name.split("/")[0]], edgecolor="white",
               hatch={"scattered": "//", "merged": ".."}.get(name.rpartition("/")[2]),
               yerr=[[max(0.0, g - p) for g, p in zip(gbps, at_p99)], [0] * len(rows)], capsize=2)
    ax.set_xticks(range(len(results)), [f"{r['tokens']:,} tokens\n{r['num_bytes'] / 2**20:.0f} MiB" for r in results])
    ax.set_ylabel("GB/s (median; whisker: at p99 latency)")
    load = doc["loadavg_1m"]["start"]
    isolated = "\nisolated: one phase per system; raw pooled over the phases" if doc.get("isolated") else ""
    ax.set_title(f"KV pull between two processes on 127.0.0.1 (small preset, 128 KiB/block; "
                 f"{doc['cpus']} CPUs, load {load:.1f}){isolated}", fontsize=10)
    ax.legend(fontsize=7, ncol=min(6, len(names)), loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_results(doc: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    png = plot(doc, out.with_suffix(".png"))
    print(f"\nwrote {out}" + (f" and {png.name}" if png else ""))


# --- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--runs", type=int, default=7, help="timed transfers per system and size (after 1 warm-up)")
    parser.add_argument("--transports", nargs="*", default=default_transports(),
                        help=f"Baton transport kinds (default: {' '.join(default_transports())})")
    parser.add_argument("--peers", nargs="*", default=list(kv_peers.PEER_NAMES), choices=kv_peers.PEER_NAMES,
                        help="peer systems (default: all; none with a bare --peers)")
    parser.add_argument("--nixl-ucx-tls", default=None,
                        help="UCX_TLS for NIXL's UCX, e.g. tcp (default: UCX picks; cma on one host)")
    parser.add_argument("--nixl-progress-thread", action="store_true",
                        help="run the NIXL peer with its progress thread (NIXL's default; it spins a core per agent). "
                             "Default: without, polled, as Baton's nixl transport runs it")
    parser.add_argument("--uvloop", action="store_true", help="run Baton's asyncio ends on uvloop")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where both ends' KV lives: host memory, or CUDA tensors (nixl/ucx/nccl in place, tcp/cma "
                             "through pinned staging, the device's own copy as the memcpy row; no peers). Default: cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON path; the PNG goes beside it")
    parser.add_argument("--isolate", action="store_true",
                        help="one phase per system, with only raw and that system running (use it to compare "
                             "with peers: NIXL's progress thread slows everything that shares the run)")
    args = parser.parse_args(argv)
    if args.runs < 1 or min(args.tokens) < 1:
        parser.error("--runs and --tokens must be >= 1")
    if args.device == "cuda":
        if (why := kv_device.require_cuda()) is not None:
            parser.error(why)
        args.peers = []  # the peers read host memory only here
    return args


def run(args: argparse.Namespace, servers: Servers, total_blocks: int) -> list[dict]:
    """Every prompt size, every started system; a system that fails is dropped for the sizes after."""
    loop, closers, results = asyncio.new_event_loop(), [], []
    try:
        if BASELINE not in servers.endpoints:
            raise RuntimeError(f"the raw baseline did not start: {servers.skipped.get(BASELINE)}")
        systems, closers = make_systems(servers, args, KVBuffer.allocate(SMALL, total_blocks), loop)
        for name, reason in servers.skipped.items():
            print(f"  skipping {name}: {reason}", flush=True)
        for i, tokens in enumerate(args.tokens, 1):
            print(f"[{i}/{len(args.tokens)}] {tokens}-token prompts "
                  f"({-(-tokens // SMALL.block_size) * SMALL.bytes_per_block / 2**20:.1f} MiB): "
                  f"{args.runs} runs x {len(systems)} systems", flush=True)
            results.append(measure(tokens, args.runs, systems, total_blocks, servers.skipped))
            systems = [s for s in systems if s.name not in servers.skipped]
    finally:
        for close in closers:
            close()
        loop.close()
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name, value in ENV_DEFAULTS.items():  # read by the peers' libraries, here and in the servers
        os.environ.setdefault(name, value)
    max_descriptors = SMALL.num_layers * -(-max(args.tokens) // SMALL.block_size)
    if int(os.environ[MOONCAKE_QUEUE]) < max_descriptors:
        os.environ[MOONCAKE_QUEUE] = str(max_descriptors)
    _install_loop(args.uvloop)
    unknown = [kind for kind in args.transports if kind not in TRANSPORT_KINDS]
    args.transports = [kind for kind in args.transports if kind in TRANSPORT_KINDS]
    total_blocks = 2 * -(-max(args.tokens) // SMALL.block_size)
    load_start = os.getloadavg()
    skipped = {kind: "not registered in kv_transfer.transport.TRANSPORT_KINDS" for kind in unknown}
    phases = None
    if args.isolate:
        from bench import kv_phases  # it imports this module

        results, isolated_skipped, started, phases = kv_phases.run_isolated(args, total_blocks)
        skipped = {**isolated_skipped, **skipped}
    else:
        servers = start_servers(args, total_blocks)
        servers.skipped.update(skipped)
        try:
            results = run(args, servers, total_blocks)
        finally:
            stop_servers(servers)
        skipped, started = servers.skipped, list(servers.endpoints)
    print_table(results, skipped, args.isolate)
    doc = {"layout": json.loads(SMALL.to_json()), "runs": args.runs, "uvloop": args.uvloop, "isolated": args.isolate,
           "device": args.device,
           "python": platform.python_version(), "cpus": os.cpu_count(),
           "loadavg_1m": {"start": load_start[0], "end": os.getloadavg()[0]},
           "systems": describe(started, args), "skipped": skipped, "results": results}
    if phases is not None:
        doc["phases"] = phases  # per phase: its raw figures and thread counts
    write_results(doc, args.out)


if __name__ == "__main__":
    main()
