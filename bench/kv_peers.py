"""Peer KV transfer systems for ``bench/kv_transfer.py``: NVIDIA NIXL and the Mooncake Transfer Engine.

Benchmark-only extras (``pip install -e '.[bench]'``), never runtime dependencies. Both move the same
bytes as Baton, in the same block layout: the serving process registers its whole paged KV buffer
(``[num_layers, num_blocks, segment_bytes]``, layout.py) and publishes its address; the pulling process
registers its own buffer and, per transfer, builds READ descriptors for the prompt's blocks — one per
layer per run of blocks consecutive on both sides, as a real deployment would for a scattered
destination — then reads them and waits for completion. Connections and metadata exchange happen once,
at setup (a real deployment exchanges them at startup); each timed transfer is descriptors to last byte.

- ``nixl``: ``nixl-cu13`` or ``nixl-cu12`` (imports as ``nixl_cu13`` / ``nixl_cu12``), UCX backend, READ. On
  one host UCX picks its same-host transport (cma, cross-memory attach) by default; ``ucx_tls`` (e.g.
  ``"tcp"``) restricts it.
  Without its progress thread by default, as Baton's nixl transport runs it (NIXL 1.5's thread never
  pauses: a core per agent); the server then polls its agent (``poll``), the client polls its READ.
  ``nixl_progress_thread=1`` runs NIXL's defaults instead.
- ``mooncake``: ``mooncake-transfer-engine-non-cuda``, TCP protocol, P2PHANDSHAKE metadata (no etcd);
  needs Debian's ``libibverbs1`` to import.

A peer whose package is missing or fails to import raises ``PeerUnavailable``; the bench reports it as
skipped with the reason.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, paired_runs
from kv_transfer.nixl_agent import environment  # imports no NIXL

# per peer, its packages and the modules they import as, in order of preference (NIXL: CUDA 13's first, as
# kv_transfer.nixl_agent.NIXL_MODULES; the lent GPU machine has nixl-cu13, this one nixl-cu12)
PEER_PACKAGES = {"nixl": ("nixl-cu13", "nixl-cu12", "nixl"), "mooncake": ("mooncake-transfer-engine-non-cuda",)}
PEER_NAMES = tuple(PEER_PACKAGES)
_MODULES = {"nixl": ("nixl_cu13", "nixl_cu12", "nixl"), "mooncake": ("mooncake.engine",)}
_BROKEN_HINTS = {"nixl": "installed but does not import", "mooncake": "it needs apt-get install -y libibverbs1"}
TRANSFER_TIMEOUT_S = 30.0  # a NIXL READ still in progress after this fails (Mooncake's own default is 30 s)

# What the serving process hands the pulling one: where to reach it, its agent metadata (NIXL), and the
# address and size in blocks of its registered KV buffer.
Endpoint = dict[str, Any]


class PeerUnavailable(Exception):
    """The peer's package is not installed or does not import here."""


class PeerServer(Protocol):
    endpoint: Endpoint

    def close(self) -> None: ...


class PeerClient(Protocol):
    def read(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> int:
        """READ the server's blocks into ours; returns the bytes moved."""
        ...

    def poll(self) -> None:
        """Let the peer make progress (called about every millisecond while the server is up)."""
        ...

    def close(self) -> None: ...


def peer_package(name: str) -> str:
    """The peer's installed package (its first in ``PEER_PACKAGES`` when none is)."""
    return next((p for p in PEER_PACKAGES[name] if _version(p) is not None), PEER_PACKAGES[name][0])


def peer_version(name: str) -> str | None:
    return _version(peer_package(name))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import(name: str) -> Any:
    """The peer's module: the first of ``_MODULES[name]`` that imports (NIXL's must have ``nixl_agent``)."""
    errors = []
    for module_name in _MODULES[name]:
        try:
            module = importlib.import_module(module_name)
        except (ImportError, OSError) as exc:  # OSError: a shared library missing (libibverbs for Mooncake)
            errors.append(f"{module_name}: {type(exc).__name__}: {exc}")
            continue
        if name != "nixl" or hasattr(module, "nixl_agent"):
            return module
        errors.append(f"{module_name}: no nixl_agent")
    package = peer_package(name)
    hint = f"pip install {package}" if peer_version(name) is None else _BROKEN_HINTS[name]
    raise PeerUnavailable(f"{package} not usable ({'; '.join(errors)}; {hint})")


def check_available(name: str) -> None:
    """Raise PeerUnavailable unless peer ``name`` imports."""
    _import(name)


def serve(name: str, buffer: KVBuffer, options: dict[str, str]) -> PeerServer:
    """Register ``buffer`` with peer ``name`` and start serving reads of it."""
    return {"nixl": NixlServer, "mooncake": MooncakeServer}[name](buffer, options)


def connect(name: str, endpoint: Endpoint, dst: KVBuffer, options: dict[str, str]) -> PeerClient:
    """Register ``dst`` with peer ``name`` and connect to the server at ``endpoint``."""
    return {"nixl": NixlClient, "mooncake": MooncakeClient}[name](endpoint, dst, options)


def buffer_address(buffer: KVBuffer) -> int:
    return int(buffer.array.ctypes.data)


def read_descriptors(
    src_base: int, src_num_blocks: int, dst: KVBuffer, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src addresses, dst addresses, lengths)``: one descriptor per layer per run of blocks consecutive
    on both sides (the server's buffer has ``dst``'s layout and ``src_num_blocks`` blocks)."""
    seg = dst.segment_bytes
    runs = np.array(paired_runs(src_block_ids, dst_block_ids), dtype=np.int64)  # [R, 3] src, dst, count
    layers = np.arange(dst.layout.num_layers, dtype=np.int64)[:, None]  # [L, 1]
    src = src_base + (layers * src_num_blocks + runs[:, 0]) * seg  # [L, R]
    dst_addr = buffer_address(dst) + (layers * dst.num_blocks + runs[:, 1]) * seg  # [L, R]
    lengths = np.broadcast_to(runs[:, 2] * seg, src.shape)  # [L, R]
    return src.ravel(), dst_addr.ravel(), np.ascontiguousarray(lengths).ravel()


def _nixl_ucx_env(options: dict[str, str]) -> dict[str, str]:
    """NIXL's bundled UCX: ``UCX_TLS`` from ``--nixl-ucx-tls``; without RDMA devices its ib module is not
    loaded (NIXL 1.5.1 segfaults at exit tearing it down on a host without any)."""
    env = {"UCX_TLS": options["nixl_ucx_tls"]} if options.get("nixl_ucx_tls") else {}
    ib = Path("/sys/class/infiniband")
    if not (ib.is_dir() and any(ib.iterdir())):
        env["UCX_MODULES"] = "^ib"
    return env


# --- NIXL -----------------------------------------------------------------------------------------


def _nixl_agent(name: str, buffer: KVBuffer, options: dict[str, str]) -> tuple[Any, Any]:
    nixl = _import("nixl")
    thread = options.get("nixl_progress_thread") == "1"
    with environment(_nixl_ucx_env(options)):
        agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=thread, backends=["UCX"]))
    registered = agent.register_memory([(buffer_address(buffer), buffer.array.nbytes, 0, "")], "DRAM")  # 4-tuples
    return agent, registered


class NixlServer:
    """A NIXL agent with the whole KV buffer registered; its metadata is the endpoint."""

    def __init__(self, buffer: KVBuffer, options: dict[str, str]) -> None:
        name = f"baton-bench-server-{os.getpid()}"
        self._buffer = buffer  # registered memory must outlive the agent's use of it
        self._agent, self._registered = _nixl_agent(name, buffer, options)
        self.endpoint: Endpoint = {
            "address": name, "metadata": self._agent.get_agent_metadata(),
            "base_addr": buffer_address(buffer), "num_blocks": buffer.num_blocks,
        }

    def poll(self) -> None:
        self._agent.get_new_notifs()  # progresses the agent (needed without its thread, e.g. over UCX tcp)

    def close(self) -> None:
        self._agent.deregister_memory(self._registered)
        self._agent = None


class NixlClient:
    """READs leased blocks from a NixlServer: descriptors built per transfer, then post and poll."""

    def __init__(self, endpoint: Endpoint, dst: KVBuffer, options: dict[str, str]) -> None:
        self._agent, self._registered = _nixl_agent(f"baton-bench-client-{os.getpid()}", dst, options)
        self._remote = self._agent.add_remote_agent(endpoint["metadata"])
        self._endpoint, self._dst = endpoint, dst
        self._timeout_s = TRANSFER_TIMEOUT_S

    def read(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> int:
        ep = self._endpoint
        src, dst, lengths = read_descriptors(ep["base_addr"], ep["num_blocks"], self._dst, src_block_ids, dst_block_ids)
        zeros = np.zeros_like(lengths)
        local = self._agent.get_xfer_descs(np.stack([dst, lengths, zeros], axis=1), "DRAM")  # [D, 3] 3-tuples
        remote = self._agent.get_xfer_descs(np.stack([src, lengths, zeros], axis=1), "DRAM")
        handle = self._agent.initialize_xfer("READ", local, remote, self._remote)
        try:
            state, deadline = self._agent.transfer(handle), time.monotonic() + self._timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(f"NIXL READ ended in state {state!r} (timeout {self._timeout_s} s)")
        finally:
            self._agent.release_xfer_handle(handle)
        return int(lengths.sum())

    def close(self) -> None:
        self._agent.remove_remote_agent(self._remote)
        self._agent.deregister_memory(self._registered)
        self._agent = None


# --- Mooncake Transfer Engine ---------------------------------------------------------------------


def _mooncake_engine(buffer: KVBuffer) -> Any:
    engine = _import("mooncake").TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise KVTransferError("Mooncake TransferEngine.initialize failed")
    if engine.register_memory(buffer_address(buffer), buffer.array.nbytes) != 0:
        raise KVTransferError("Mooncake register_memory failed")
    return engine


class MooncakeServer:
    """A Transfer Engine (TCP, P2P handshake) with the whole KV buffer registered."""

    def __init__(self, buffer: KVBuffer, options: dict[str, str]) -> None:
        self._buffer = buffer  # registered memory must outlive the engine's use of it
        self._engine = _mooncake_engine(buffer)
        self._base = buffer_address(buffer)
        self.endpoint: Endpoint = {
            "address": f"127.0.0.1:{self._engine.get_rpc_port()}", "metadata": b"",
            "base_addr": self._base, "num_blocks": buffer.num_blocks,
        }

    def poll(self) -> None:
        pass  # the Transfer Engine has threads of its own

    def close(self) -> None:
        self._engine.unregister_memory(self._base)
        self._engine = None


class MooncakeClient:
    """``batch_transfer_sync_read`` of per-transfer descriptors from a MooncakeServer."""

    def __init__(self, endpoint: Endpoint, dst: KVBuffer, options: dict[str, str]) -> None:
        self._engine = _mooncake_engine(dst)
        self._endpoint, self._dst = endpoint, dst

    def read(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> int:
        ep = self._endpoint
        src, dst, lengths = read_descriptors(ep["base_addr"], ep["num_blocks"], self._dst, src_block_ids, dst_block_ids)
        status = self._engine.batch_transfer_sync_read(ep["address"], dst.tolist(), src.tolist(), lengths.tolist())
        if status < 0:
            raise KVTransferError(f"Mooncake batch_transfer_sync_read failed ({status})")
        return int(lengths.sum())

    def close(self) -> None:
        self._engine.unregister_memory(buffer_address(self._dst))
        self._engine = None
