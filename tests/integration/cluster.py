"""Start real Baton processes on free localhost ports for integration tests; stop them by PID."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kv_transfer.registry import Registry, connect

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interrupt(popen: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Ctrl-C a `baton up` (it stops every process it started); killed if it has not exited in ``timeout_s``."""
    popen.send_signal(signal.SIGINT)
    try:
        popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


def _no_metrics(extra: tuple[str, ...]) -> list[str]:
    """Many processes share this host: no /metrics endpoint (and no HTTP front) unless a test asks."""
    return [] if "--metrics-port" in extra else ["--metrics-port", "0"]


def _no_http(extra: tuple[str, ...]) -> list[str]:
    return [] if "--http-port" in extra else ["--http-port", "0"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""
    own_group: bool = False  # started in a process group of its own (a vLLM worker and its engine's processes)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.own_group:
            from tests.vllm_env import stop_group

            if sig == signal.SIGKILL:
                os.killpg(self.popen.pid, sig)
            stop_group(self.popen)
            return
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


@dataclass
class Cluster:
    redis_url: str
    model_dir: Path
    log_dir: Path
    namespace: str = "baton"
    procs: list[Proc] = field(default_factory=list)

    def start_worker(self, role: str, *extra: str, num_blocks: int = 256, block_size: int = 4,
                     worker_id: str | None = None, own_group: bool = False) -> Proc:
        port = free_port()
        worker_id = worker_id or f"{role}-{port}"
        args = [role, "--redis-url", self.redis_url, "--model", str(self.model_dir), "--port", str(port),
                "--num-blocks", str(num_blocks), "--block-size", str(block_size), "--worker-id", worker_id,
                "--num-threads", "1", "--namespace", self.namespace, *_no_metrics(extra), *extra]
        proc = self._spawn(worker_id, args, own_group=own_group)
        proc.address = f"127.0.0.1:{port}"
        return proc

    def start_router(self, *extra: str) -> Proc:
        port = free_port()
        args = ["router", "--redis-url", self.redis_url, "--model", str(self.model_dir), "--port", str(port),
                "--namespace", self.namespace, *_no_metrics(extra), *_no_http(extra), *extra]
        proc = self._spawn(f"router-{port}", args)
        proc.address = f"127.0.0.1:{port}"
        return proc

    def _spawn(self, name: str, args: list[str], *, own_group: bool = False) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        with log_path.open("wb") as log:
            popen = subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, env=env, start_new_session=own_group)
        proc = Proc(name, popen, log_path, own_group=own_group)
        self.procs.append(proc)
        return proc

    def wait_for_workers(self, worker_ids: set[str], timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited early:\n{proc.log()}")
            if worker_ids <= set(asyncio.run(self._registered())):
                return
            time.sleep(0.3)
        raise TimeoutError(f"workers {worker_ids} did not register in {timeout_s} s")

    async def _registered(self) -> list[str]:
        redis = connect(self.redis_url)
        try:
            return [info.worker_id for info, _ in await Registry(redis, self.namespace).list_workers()]
        finally:
            await redis.aclose()

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.kill(signal.SIGTERM)
        self.procs.clear()
