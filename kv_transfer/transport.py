"""The KV data plane's contract: a pull-model transport (DESIGN.md "KV data plane").

A transport is a ``KVServer`` (the prefill side: serves reads of leased blocks out of its ``KVBuffer``)
and a ``KVClient`` (the decode side: ``pull`` reads ``(lease_id, src_block_ids)`` into its own
``dst_block_ids``; every client derives from ``KVClient``, which checks a pull's arguments and reports its
``TransferStats``), named by a URI scheme: ``tcp://host:port``, ``local://name``. What every transport sends
is ``kv_transfer/wire.py``'s; the checks both sides of a read make are ``kv_transfer/protocol.py``'s. Every
implementation passes ``tests/unit/test_kv_transport.py`` and keeps these promises:

- the KV layouts are compared first; a mismatch raises ``LayoutMismatch`` before any KV byte moves;
- the lease and every requested block are checked before any KV byte moves (``LeaseNotFound``,
  ``KVTransferError``), so a refused pull leaves the destination untouched;
- a pull succeeds only if the lease was still live after the last byte was read (so no block was
  freed and reused mid-read); a pull that fails mid-stream leaves its destination blocks undefined;
- every wait on the peer is bounded by ``TransportConfig`` timeouts: errors, never hangs.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

from kv_transfer.errors import KVTransferError, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.progress import ProgressLookup
from kv_transfer.tensor_buffer import IN_PLACE_KINDS, AnyKVBuffer, TensorKVBuffer

# kind (the URI scheme) -> (module, server class, client class). A transport's two classes live in one module
# (its helpers beside it); adding one is one line here plus passing tests/unit/test_kv_transport.py.
_IMPLEMENTATIONS: dict[str, tuple[str, str, str]] = {
    "tcp": ("kv_transfer.tcp", "TcpServer", "TcpClient"),
    "local": ("kv_transfer.local", "LocalServer", "LocalClient"),
    "ucx": ("kv_transfer.ucx", "UcxServer", "UcxClient"),
    "nccl": ("kv_transfer.nccl", "NcclServer", "NcclClient"),
    "cma": ("kv_transfer.cma", "CmaServer", "CmaClient"),
    "nixl": ("kv_transfer.nixl", "NixlServer", "NixlClient"),
}
TRANSPORT_KINDS = tuple(_IMPLEMENTATIONS)
# What a worker serves and a decode worker prefers, in order, for ``--kv-transport auto``: on a host
# buffer, CMA first (process_vm_readv: same-host peers only; a cma:// server on another host is refused
# before any byte moves), then TCP (measured fastest here for one-shot pulls over a network), then UCX (shared
# memory / RDMA when the fabric has it), then NCCL (gloo on CPU: real, slower); on a CUDA cache, the GPU-native
# paths first: NIXL (one-sided READs of registered VRAM), NCCL, UCX. NIXL is not offered for a host cache by
# default (over TCP it moved 0.5-0.9 GB/s here, below our tcp); name it to use it.
# ``local`` is in-process only (tests, benchmarks), never served by a worker.
AUTO_PREFERENCE = {"cpu": ("cma", "tcp", "ucx", "nccl"), "cuda": ("nixl", "nccl", "ucx", "tcp")}

# The kinds whose server streams a lease's KV layer by layer while the prompt computes (a ``progress``
# lookup, kv_transfer/progress.py); the others serve a lease only once every layer is written.
STREAMING_KINDS = frozenset({"tcp", "cma", "nccl"})

# lease id -> the block ids it pins; raises LeaseNotFound (or returns None) when not live.
Resolver = Callable[[str], Sequence[int] | None]
# (lease id, the block ids a reader asked for, as the lease's handle names them) -> where those blocks are in
# the served buffer; raises LeaseNotFound, or KVTransferError for a block the lease does not hold. A server
# through host staging translates with each lease's staging map (kv_transfer/staging.py); without one a
# server reads the ids as they come.
Locator = Callable[[str, Sequence[int]], list[int]]


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportConfig:
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 10.0  # the longest any one wait for the peer may last
    socket_buffer_bytes: int | None = None  # SO_SNDBUF/SO_RCVBUF; None keeps the kernel's autotuning
    max_blocks_per_read: int = 1 << 20
    # xxh3-64 per block: the serving side hashes the bytes it sends, the pulling side verifies what landed
    # and raises ChecksumMismatch naming the bad blocks (kv_transfer/checksum.py). Off by default: it costs
    # a pass over the bytes on each side (~10+ GB/s), and links already checksum their frames.
    checksum: bool = False
    # The deployment's data-plane secret (kv_transfer/auth.py): a server with one serves only reads that
    # carry a valid HMAC of it; a client with one signs its reads. None: reads are not authenticated.
    secret: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferStats:
    num_blocks: int
    num_bytes: int
    seconds: float  # request (or connect, without a kept-alive connection) to last byte, as the decode side sees it
    # from the same start until layer 0 of every block had landed (a streamed read lands it while the later
    # layers still compute); None where the transport cannot tell (local://, ucx://)
    first_layer_s: float | None = None
    started_unix_s: float = 0.0  # the start, by the wall clock (to compare with other processes' instants)

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class KVServer(Protocol):
    uri: str | None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start serving; returns the URI decoders pull from."""
        ...

    async def stop(self) -> None:
        """Stop serving and end open connections (idempotent)."""
        ...


class LayerClock:
    """When a pull's first layer had landed: a client calls ``first_layer()`` once layer 0 of every block is
    in the destination (again on a retried attempt: the last one counts)."""

    __slots__ = ("first_layer_at",)

    def __init__(self) -> None:
        self.first_layer_at: float | None = None  # time.perf_counter()

    def first_layer(self) -> None:
        self.first_layer_at = time.perf_counter()


@dataclass(frozen=True, slots=True, kw_only=True)
class Pull:
    """One pull's arguments, checked (``check_pull_args``), block ids as ints."""

    uri: str
    layout: KVLayout
    lease_id: str
    src_ids: list[int]
    dst_buffer: AnyKVBuffer
    dst_ids: list[int]
    landed: LayerClock = field(default_factory=LayerClock)

    @property
    def num_bytes(self) -> int:
        return len(self.src_ids) * self.layout.bytes_per_block


class KVClient:
    """The decode side of a transport: every transport's client derives from it. ``pull`` checks its
    arguments before connecting, times the pull and reports it; a transport implements ``_pull``, which
    moves the bytes and raises on any failure. ``pulls_into_tensors``: it pulls into a ``TensorKVBuffer``
    (a device cache, in place) as well as a ``KVBuffer`` (``IN_PLACE_KINDS``)."""

    pulls_into_tensors = False

    def __init__(self, config: TransportConfig | None = None) -> None:
        self.config = config or TransportConfig()

    async def pull(self, uri: str, layout: KVLayout, lease_id: str, src_block_ids: Sequence[int],
                   dst_buffer: AnyKVBuffer, dst_block_ids: Sequence[int]) -> TransferStats:
        """Read leased blocks ``src_block_ids`` of the server at ``uri`` into ``dst_block_ids`` of ``dst_buffer``."""
        start, started_unix_s = time.perf_counter(), time.time()
        if isinstance(dst_buffer, TensorKVBuffer) and not self.pulls_into_tensors:
            raise KVTransferError(f"{uri_kind(uri)}:// pulls into host memory only: pull a device cache through "
                                  "host staging")
        check_pull_args(layout, src_block_ids, dst_buffer, dst_block_ids)
        request = Pull(uri=uri, layout=layout, lease_id=lease_id, src_ids=[int(b) for b in src_block_ids],
                       dst_buffer=dst_buffer, dst_ids=[int(b) for b in dst_block_ids])
        await self._pull(request)
        first_at = request.landed.first_layer_at
        return TransferStats(num_blocks=len(request.src_ids), num_bytes=request.num_bytes,
                             seconds=time.perf_counter() - start,
                             first_layer_s=None if first_at is None else first_at - start,
                             started_unix_s=started_unix_s)

    async def _pull(self, request: Pull) -> None:
        raise NotImplementedError


def check_pull_args(
    layout: KVLayout, src_block_ids: Sequence[int], dst_buffer: AnyKVBuffer, dst_block_ids: Sequence[int]
) -> None:
    """The decode side's checks, done before connecting."""
    layout.check_compatible(dst_buffer.layout)
    if len(src_block_ids) != len(dst_block_ids):
        raise KVTransferError(f"pull: {len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks")
    if not dst_buffer.writable:
        raise KVTransferError("pull: the destination buffer is read-only")
    dst_buffer.check_block_ids(dst_block_ids)
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise KVTransferError("pull: destination block ids repeat")


def check_read(buffer: AnyKVBuffer, resolve: Resolver, lease_id: str, block_ids: Sequence[int]) -> None:
    """The serving side's checks: the lease is live, covers every requested block, and they exist."""
    leased = resolve(lease_id)
    if leased is None:
        raise LeaseNotFound("unknown or expired transfer lease")
    if not _leased_run(leased, block_ids):
        allowed = set(leased)
        outside = [b for b in block_ids if b not in allowed]
        if outside:
            raise KVTransferError(f"blocks {outside[:8]} are not in the lease ({len(outside)} in all)")
    buffer.check_block_ids(block_ids)


def _leased_run(leased: Sequence[int], block_ids: Sequence[int]) -> bool:
    """True when ``block_ids`` are a slice of ``leased`` in order (a whole lease, or what a prefix hit leaves to
    pull): compared in C, where a set of the lease per read cost ~0.2 ms per 1,000 blocks. False: look closer."""
    ids = tuple(block_ids)
    if not ids:
        return True
    leased = leased if isinstance(leased, tuple) else tuple(leased)
    try:
        start = leased.index(ids[0])
    except ValueError:
        return False
    return leased[start:start + len(ids)] == ids


def kind_available(kind: str) -> str | None:
    """None when transport ``kind`` can run in this process, else why not (e.g. a missing package)."""
    if kind not in _IMPLEMENTATIONS:
        return f"unknown transport {kind!r} (known: {', '.join(TRANSPORT_KINDS)})"
    if kind == "ucx":
        from kv_transfer.ucx_endpoint import INSTALL_HINT, ucxx_available

        return None if ucxx_available() else INSTALL_HINT
    if kind == "nccl":
        import torch.distributed as dist

        return None if dist.is_available() else "this torch build has no torch.distributed"
    if kind == "cma":
        from kv_transfer.cma_memory import unavailable_reason

        return unavailable_reason()
    if kind == "nixl":  # found, not imported: importing NIXL loads the libraries it bundles (kv_transfer/nixl.py)
        from kv_transfer.nixl import INSTALL_HINT, installed

        return None if installed() else INSTALL_HINT
    return None


def parse_kinds(spec: str, device: str = "cpu") -> tuple[str, ...]:
    """``--kv-transport``: "auto" (every transport that runs here, in ``AUTO_PREFERENCE`` order) or a
    comma-separated list in the caller's order of preference; raises ValueError naming what cannot run."""
    if spec.strip() == "auto":
        kinds = tuple(k for k in AUTO_PREFERENCE["cuda" if device.startswith("cuda") else "cpu"]
                      if kind_available(k) is None)
        # nixl and ucx each load a UCX library of their own; two in one process crashed it here: nixl wins
        return tuple(k for k in kinds if k != "ucx") if "nixl" in kinds else kinds
    kinds = tuple(dict.fromkeys(k.strip() for k in spec.split(",") if k.strip()))
    if not kinds:
        raise ValueError("--kv-transport: name at least one transport, or auto")
    for kind in kinds:
        if kind == "local":
            raise ValueError("--kv-transport: local is in-process only (tests); use tcp, cma, ucx, nccl, nixl or auto")
        if (why := kind_available(kind)) is not None:
            raise ValueError(f"--kv-transport {kind}: {why}")
    return kinds


def choose_uri(offered: str, preferred: Sequence[str]) -> str:
    """The URI to pull from: ``offered`` lists the serving worker's URIs (space-separated, as a
    ``KVHandle.data_plane_uri`` or a registry ``kv_uri`` carries them); the first kind of ``preferred``
    (the pulling worker's order) that it offers wins. What only a handshake shows (a cma:// server in another
    PID namespace) is ``kv_transfer/pairs.py``'s: it tries ``uris_in_order`` one after another."""
    return uris_in_order(offered, preferred)[0]


def uris_in_order(offered: str, preferred: Sequence[str]) -> list[str]:
    """The URIs of ``offered`` (one per kind) that ``preferred`` names, in its order, less those the URI alone
    shows cannot work from here; raises KVTransferError when none is left."""
    by_kind: dict[str, str] = {}
    for uri in offered.split():
        if _reachable(uri):
            by_kind.setdefault(urlsplit(uri).scheme, uri)
    uris = [by_kind[kind] for kind in preferred if kind in by_kind]
    if not uris:
        raise KVTransferError(f"no KV transport in common: the peer serves {sorted(by_kind) or 'nothing'}, "
                              f"this worker pulls with {list(preferred)}")
    return uris


def _reachable(uri: str) -> bool:
    """False for a same-host-only URI (``cma://...?boot=<id>``) of another host: skipped, not failed on."""
    parts = urlsplit(uri)
    if parts.scheme != "cma":
        return True
    boot = parse_qs(parts.query).get("boot")
    if not boot:
        return True
    from kv_transfer.cma_memory import boot_id

    return boot[0] == boot_id().hex()


def uri_kind(uri: str) -> str:
    kind = urlsplit(uri).scheme
    if kind not in TRANSPORT_KINDS:
        raise KVTransferError(f"unsupported KV data-plane URI {uri!r} (schemes: {', '.join(TRANSPORT_KINDS)})")
    return kind


def parse_uri(uri: str, scheme: str) -> tuple[str, int]:
    """(host, port) of ``scheme://host:port``; KVTransferError for any other URI."""
    parts = urlsplit(uri)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise KVTransferError(f"bad KV data-plane URI {uri!r}: {exc}") from exc
    if parts.scheme != scheme or not host or port is None:
        raise KVTransferError(f"bad KV data-plane URI {uri!r} (want {scheme}://host:port)")
    return host, port


def _implementation(kind: str, which: int):
    try:
        module, *classes = _IMPLEMENTATIONS[kind]
    except KeyError:
        raise KVTransferError(f"unknown transport {kind!r} (known: {', '.join(TRANSPORT_KINDS)})") from None
    return getattr(importlib.import_module(module), classes[which])


def make_server(kind: str, *, buffer: AnyKVBuffer, resolve: Resolver, config: TransportConfig | None = None,
                progress: ProgressLookup | None = None, locate: Locator | None = None) -> KVServer:
    """A server of transport ``kind`` over ``buffer``; ``resolve`` validates lease ids (see LeaseTable.resolver).
    ``progress`` (lease id -> its LayerProgress while the prompt computes) is for the ``STREAMING_KINDS``;
    any other kind refuses such a lease until its progress is ready, so it never sends unwritten KV.
    ``locate``: where a read's blocks are in ``buffer`` (host staging; see ``Locator``). A ``TensorKVBuffer``
    (a device cache served in place) only for the ``IN_PLACE_KINDS``."""
    if isinstance(buffer, TensorKVBuffer) and kind not in IN_PLACE_KINDS:
        raise ValueError(f"{kind}:// serves host memory only: serve a device cache through host staging")
    if progress is not None and kind not in STREAMING_KINDS:
        resolve, progress = _when_computed(resolve, progress), None
    extra = {"progress": progress} if progress is not None else {}
    if locate is not None:
        extra["locate"] = locate
    return _implementation(kind, 0)(buffer=buffer, resolve=resolve, config=config or TransportConfig(), **extra)


def served_kinds(kv_uri: str) -> set[str]:
    """The Baton transports a worker serves (``kv_uri`` as registered: space-separated URIs, one per served kind);
    a URI of another scheme (an engine's own connector, e.g. ``vllm-nixl://``) names none."""
    return {kind for uri in kv_uri.split() if (kind := urlsplit(uri).scheme) in TRANSPORT_KINDS}


def streams_layers(prefill_kv_uri: str, decode_kv_uri: str) -> bool:
    """The prefill worker serves a ``STREAMING_KINDS`` transport that the decode worker pulls over too."""
    return bool(served_kinds(prefill_kv_uri) & STREAMING_KINDS & served_kinds(decode_kv_uri))


def _when_computed(resolve: Resolver, progress: ProgressLookup) -> Resolver:
    def resolve_computed(lease_id: str) -> Sequence[int] | None:
        lease_progress = progress(lease_id)
        if lease_progress is not None and not lease_progress.is_ready:
            raise LeaseNotFound("the lease's KV is still being computed (this transport does not stream layers)")
        return resolve(lease_id)

    return resolve_computed


def connect(uri: str, config: TransportConfig | None = None) -> KVClient:
    """The client that pulls from ``uri``; keep it: tcp and cma clients keep connections alive between
    pulls (``kv_transfer/conn_pool.py``), nccl its channels. ``close()`` it when done, if it has one."""
    return _implementation(uri_kind(uri), 1)(config or TransportConfig())


async def pull(uri: str, layout: KVLayout, lease_id: str, src_block_ids: Sequence[int], dst_buffer: AnyKVBuffer,
               dst_block_ids: Sequence[int], *, config: TransportConfig | None = None) -> TransferStats:
    """``connect(uri).pull(...)`` with a client of its own, closed afterwards (one-off pulls: no reuse)."""
    client = connect(uri, config)
    try:
        return await client.pull(uri, layout, lease_id, src_block_ids, dst_buffer, dst_block_ids)
    finally:
        if callable(close := getattr(client, "close", None)):
            close()
