"""The platform a configuration is replayed against: one ``baton up`` per configuration, and its flags."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kv_transfer.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("none", "host", "host+store", "oracle")


def config_flags(config: str, *, num_blocks: int, host_blocks: int, store_memory: str, oracle_blocks: int,
                 store_buffer_blocks: int) -> list[str]:
    if config == "none":
        return ["--num-blocks", str(num_blocks)]
    if config == "host":
        return ["--num-blocks", str(num_blocks), "--kv-host-blocks", str(host_blocks)]
    if config == "host+store":
        return ["--num-blocks", str(num_blocks), "--kv-host-blocks", str(host_blocks), "--kv-store",
                "--kv-store-memory", store_memory, "--kv-store-buffer-blocks", str(store_buffer_blocks)]
    if config == "oracle":
        return ["--num-blocks", str(oracle_blocks)]
    raise ValueError(f"unknown configuration {config!r}; choose from {CONFIGS}")




@dataclass
class Up:
    """One ``baton up`` in a process group of its own; ``stop`` ends the whole group."""

    popen: subprocess.Popen
    log_dir: Path
    grpc_port: int
    http_port: int
    metrics_port: int
    worker_ids: list[str]
    store: bool
    stdout: Path = field(default_factory=Path)

    @classmethod
    def start(cls, model: str, flags: list[str], log_dir: Path, *, prefill: int, decode: int,
              ready_timeout_s: float = 240.0) -> Up:
        log_dir.mkdir(parents=True, exist_ok=True)
        ports = [free_port() for _ in range(2)]
        metrics = _free_port_run(1 + prefill + decode)
        cmd = [sys.executable, "-m", "deploy.cli", "up", "--model", model, "--prefill", str(prefill),
               "--decode", str(decode), "--port", str(ports[0]), "--http-port", str(ports[1]),
               "--metrics-port", str(metrics), "--log-dir", str(log_dir), *flags]
        stdout = log_dir / "up.out"
        with stdout.open("wb") as out:
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        up = cls(popen, log_dir, ports[0], ports[1], metrics,
                 [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)],
                 "--kv-store" in flags, stdout)
        try:
            up._wait_ready(time.monotonic() + ready_timeout_s)
        except BaseException:
            up.stop()
            raise
        return up

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def worker_metrics_ports(self) -> dict[str, int]:
        return {wid: self.metrics_port + 1 + i for i, wid in enumerate(self.worker_ids)}

    def _wait_ready(self, deadline: float) -> None:
        """Every worker registered (its log says so) and, with a store, connected to it; the router answers."""
        import grpc

        def logs_say(what: str) -> bool:
            return all(what in _read(self.log_dir / f"{wid}.log") for wid in self.worker_ids)

        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"baton up exited with {self.popen.returncode}:\n{_read(self.stdout)[-2000:]}")
            ready = (logs_say("registered worker_id=")
                     and (not self.store or logs_say("store tier: connected")))
            if ready:
                try:
                    with grpc.insecure_channel(self.grpc_address) as channel:
                        grpc.channel_ready_future(channel).result(timeout=1.0)
                    return
                except grpc.FutureTimeoutError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the platform was not ready in time (logs: {self.log_dir})")
            time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to ``baton up`` (it stops its router, workers, Redis and store), then, past ``grace_s``,
        SIGKILL to its process group (every process it started, and nothing else)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # leftovers of this group only (start_new_session)
        except ProcessLookupError:
            pass
        self.popen.wait(10)


def _free_port_run(n: int, tries: int = 50) -> int:
    """A first port P with P..P+n-1 all free (``baton up`` gives workers the metrics ports after the router's)."""
    for _ in range(tries):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
