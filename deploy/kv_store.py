"""A Mooncake Store on this machine, on loopback (``baton up --kv-store``; the store tier's tests): a
``mooncake_master``, an HTTP metadata server, and one standalone ``mooncake_client`` holding the memory, so what
workers write outlives them. Returns the ``mooncake://`` URI workers take (``--kv-store``).

Every listener that can be told is bound to 127.0.0.1: the master's RPC and metrics ports, the standalone client's
service port, and the metadata server, which is Mooncake's Python one (the master's built-in one,
``--enable_http_metadata_server``, binds all interfaces whatever ``--http_metadata_server_host`` says). Every
Mooncake transfer engine advertises 127.0.0.1 (``MC_TCP_BIND_ADDRESS``), so every byte moves over loopback; their
own two listeners (handshake and data) still bind all interfaces: Mooncake 0.3.13 hard-codes that
(docs/operations.md "Running with a store").
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 30.0
_HINT = ("the store tier needs Mooncake: pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1' (make install "
         "does) and Debian's libibverbs1 (apt-get install -y libibverbs1)")


class StoreStartError(RuntimeError):
    """The store's processes could not be started (not installed, or one exited)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def mooncake_dir() -> Path:
    """Where the mooncake package's binaries are, found without importing it (that loads its native library)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise StoreStartError(f"the mooncake package is not installed: {_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def store_commands(memory: str, ports: dict[str, int]) -> dict[str, list[str]]:
    """The three processes' command lines, in start order (``ports``: rpc, metrics, metadata, client)."""
    bin_dir, master = mooncake_dir(), f"{LOOPBACK}:{ports['rpc']}"
    metadata = f"http://{LOOPBACK}:{ports['metadata']}/metadata"
    return {
        "store-metadata": [sys.executable, "-m", "mooncake.http_metadata_server", "--host", LOOPBACK,
                           "--port", str(ports["metadata"]), "--log-level", "WARNING"],
        "store-master": [str(bin_dir / "mooncake_master"), f"--rpc_address={LOOPBACK}", f"--rpc_port={ports['rpc']}",
                         f"--metrics_host={LOOPBACK}", f"--metrics_port={ports['metrics']}",
                         "--enable_metric_reporting=false"],
        "store-client": [str(bin_dir / "mooncake_client"), f"--host={LOOPBACK}", f"--port={ports['client']}",
                         f"--global_segment_size={memory}", f"--master_server_address={master}",
                         f"--metadata_server={metadata}", "--protocol=tcp"],
    }


def start_store(log_dir: Path, spawn: Callable[[str, list[str], Path], subprocess.Popen], *,
                memory: str = "1 GB") -> str:
    """Start the three processes (``spawn(name, argv, log_path)`` starts one and keeps it for stopping) and wait
    until each listens; the ``mooncake://`` URI. StoreStartError when one cannot start."""
    ports = {name: free_port() for name in ("rpc", "metrics", "metadata", "client")}
    waits = {"store-metadata": ports["metadata"], "store-master": ports["rpc"], "store-client": ports["client"]}
    for name, argv in store_commands(memory, ports).items():
        popen = spawn(name, argv, log_dir / f"{name}.log")
        _wait_listening(name, popen, waits[name], log_dir / f"{name}.log")
    return f"mooncake://{LOOPBACK}:{ports['rpc']}?metadata={LOOPBACK}:{ports['metadata']}"


def store_env() -> dict[str, str]:
    """The environment the store's processes run with: their transfer engine advertises loopback, logs quietly."""
    return dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK, GLOG_minloglevel=os.environ.get("GLOG_minloglevel", "1"))


def _wait_listening(name: str, popen: subprocess.Popen, port: int, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            hint = f"; {_HINT}" if "libibverbs" in tail else ""
            raise StoreStartError(f"{name} exited with {popen.returncode}{hint}:\n{tail}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.1)
    raise StoreStartError(f"{name} did not listen on {LOOPBACK}:{port} within {START_TIMEOUT_S:.0f} s")
