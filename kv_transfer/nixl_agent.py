"""NVIDIA NIXL as ``nixl://`` uses it (``kv_transfer/nixl.py``): finding the package, one agent (UCX backend, no
progress thread) and the memory registered with it. Nothing here imports NIXL until an agent is made: importing it
loads the libraries it bundles (its own UCX, gRPC, protobuf, absl) into the process."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kv_transfer.errors import KVTransferError
from kv_transfer.tensor_buffer import AnyKVBuffer, TensorKVBuffer

MEM_KINDS = ("DRAM", "VRAM")
# the packages NIXL ships as, newest CUDA first; each exposes ``nixl_agent`` and ``nixl_agent_config``
NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
INSTALL_HINT = "nixl:// needs NVIDIA NIXL: pip install nixl-cu12 (or nixl-cu13), after the pinned torch"


@functools.cache
def nixl_module() -> Any:
    """The NIXL Python API; raises ImportError with the install hint where there is none."""
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise ImportError(INSTALL_HINT)


def installed() -> bool:
    """Whether a NIXL package is installed, found without importing it. Importing NIXL loads the libraries it
    bundles (its own UCX, gRPC, protobuf, absl) into the process: in a process that later loads grpc_tools'
    protoc that crashed it here, so test processes ask this instead (a worker serving nixl imports it)."""
    return any(importlib.util.find_spec(name) is not None for name in NIXL_MODULES)


def unavailable_reason() -> str | None:
    """None when NIXL imports here, else why not."""
    try:
        nixl_module()
    except ImportError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken install (a missing shared library) must not crash a worker
        return f"NIXL is installed but does not import: {exc!r}"
    return None


@contextlib.contextmanager
def _ucx_env() -> Iterator[None]:
    """NIXL's bundled UCX reads its environment when an agent is made. Without RDMA devices its ib module is
    not loaded (NIXL 1.5.1 crashes at exit tearing it down on a host without any); the process's own
    environment is restored afterwards, so another UCX in the process (ucxx) is not affected."""
    ib = Path("/sys/class/infiniband")
    wanted = {} if ib.is_dir() and any(ib.iterdir()) else {"UCX_MODULES": os.environ.get("UCX_MODULES", "^ib")}
    # No memory-event hooks, a precaution: another UCX in the process (ucxx's) hooks mmap/munmap as well.
    # NIXL registers the KV buffers once and Baton keeps them mapped while registered, so no registration
    # cache needs invalidating. (The crashes seen beside ucxx came from NIXL's bundled libraries being loaded
    # at all: tests/unit/test_kv_nixl.py.)
    wanted["UCX_MEM_EVENTS"] = os.environ.get("BATON_NIXL_UCX_MEM_EVENTS", "no")
    with environment(wanted):
        yield


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in the environment for the block (a UCX context reads it when made), restored after."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Memory:
    """Where a KV buffer's bytes live, as NIXL registers them: base address, length, memory kind, device id.
    A ``KVBuffer`` is host memory (DRAM, device 0); a ``TensorKVBuffer`` on CUDA is VRAM on its device."""

    __slots__ = ("address", "nbytes", "kind", "device_id", "owner")

    def __init__(self, address: int, nbytes: int, kind: str = "DRAM", device_id: int = 0, owner: Any = None) -> None:
        if kind not in MEM_KINDS:
            raise ValueError(f"memory kind must be one of {MEM_KINDS}, got {kind!r}")
        self.address, self.nbytes, self.kind, self.device_id = address, nbytes, kind, device_id
        self.owner = owner  # what keeps the memory alive while it is registered

    @classmethod
    def of(cls, buffer: AnyKVBuffer) -> Memory:
        if isinstance(buffer, TensorKVBuffer):
            return cls(buffer.base_ptr, buffer.nbytes, "VRAM" if buffer.is_cuda else "DRAM", buffer.device_id, buffer)
        return cls(buffer.base_ptr, buffer.array.nbytes, "DRAM", 0, buffer)


class Agent:
    """One NIXL agent (UCX backend) and the memory registered with it; ``close()`` deregisters it all."""

    def __init__(self, name: str) -> None:
        nixl = nixl_module()
        with _ucx_env():
            # No progress thread: NIXL 1.5's runs without a pause (a whole core per agent, idle or not). The
            # agent progresses when polled instead: the client polls its READ, the server its notifications
            # (kv_transfer/nixl.py's docstring), and nothing needs progress between reads.
            self.nixl = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self.nixl.backends:
            raise KVTransferError("NIXL has no UCX backend here (its plugin did not load)")
        self.name = name
        self._registered: dict[tuple[int, int], tuple[Memory, Any]] = {}

    def register(self, memory: Memory) -> None:
        key = (memory.address, memory.nbytes)
        if key not in self._registered:
            descs = self.nixl.register_memory([(memory.address, memory.nbytes, memory.device_id, "")], memory.kind)
            self._registered[key] = (memory, descs)

    def deregister(self, memory: Memory) -> None:
        entry = self._registered.pop((memory.address, memory.nbytes), None)
        if entry is not None:
            self.nixl.deregister_memory(entry[1])

    def metadata(self) -> bytes:
        return self.nixl.get_agent_metadata()

    def close(self) -> None:
        for memory, _ in list(self._registered.values()):
            with contextlib.suppress(Exception):
                self.deregister(memory)
