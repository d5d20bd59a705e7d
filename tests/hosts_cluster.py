"""Baton on several hosts of ``tests/hosts.py``: Redis on one, the router on another, prefill and decode workers
on others, each started with the ordinary CLI (``python -m deploy.cli router|prefill|decode``) and the standard
ports on its host's own address (``--host``: what it binds and advertises). Nothing is special-cased for tests.

The test process stays in the machine's own network namespace; a client host runs ``tests/hosts_forward.py``,
and the test reaches the router, the workers and Redis through unix sockets it forwards (``channel``,
``redis_url``, ``metrics``) — a client on a host of its own, as a real one would be.

    cluster = HostsCluster(net, model_dir, log_dir, client="client")
    cluster.start_redis("redis")
    p0 = cluster.start_worker("prefill", "p0", host="b", extra=("--kv-transport", "auto"))
    ...
    cluster.close()  # stops every process (the Network removes the hosts)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from kv_transfer.registry import Registry, connect
from kv_transfer.workers import WorkerInfo
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.hosts import HostProc, Network
from tests.integration.cluster import set_draining_seen
from tests.redis_server import require_redis_server

REDIS_PORT, ROUTER_PORT, WORKER_PORT, METRICS_PORT = 6379, 50051, 50061, 9451


class HostsCluster:
    def __init__(self, net: Network, model_dir: Path, log_dir: Path, *, client: str) -> None:
        self.net, self.model_dir, self.log_dir = net, model_dir, log_dir
        self.sock_dir = log_dir / "sockets"
        self.sock_dir.mkdir(exist_ok=True)
        self.redis: HostProc | None = None
        self.router: HostProc | None = None
        self.workers: dict[str, HostProc] = {}
        self.metrics_addresses: dict[str, str] = {}  # worker id -> host:port of its /metrics
        self._worker_args: dict[str, tuple[str, list[str]]] = {}  # worker id -> (host, CLI arguments)
        self._forwarded: dict[str, Path] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._forwarder = net[client].spawn("forwarder", [sys.executable, "-m", "tests.hosts_forward"], log_dir,
                                            pipe=True)

    # ---- starting things ------------------------------------------------------------------
    def forward(self, address: str) -> Path:
        """A unix socket of this machine that reaches ``host:port`` from the client host."""
        if address not in self._forwarded:
            path = self.sock_dir / f"{address.replace(':', '-')}.sock"
            popen = self._forwarder.popen
            try:
                popen.stdin.write(f"{path}={address}\n")
                popen.stdin.flush()
                answer = popen.stdout.readline().strip()
            except BrokenPipeError:
                answer = "nothing (it exited)"
            if answer != f"ok {path}":
                raise RuntimeError(f"the forwarder answered {answer!r} for {address}:\n{self._forwarder.log()}")
            self._forwarded[address] = path
        return self._forwarded[address]

    def start_redis(self, host: str) -> HostProc:
        binary = require_redis_server()
        address = self.net[host].address
        self.redis = self.net[host].spawn("redis", [
            binary, "--port", str(REDIS_PORT), "--bind", address, "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--dir", str(self.log_dir)], self.log_dir)
        self.redis.address = f"{address}:{REDIS_PORT}"
        return self.redis

    @property
    def redis_url(self) -> str:
        """Redis as the hosts dial it."""
        return f"redis://{self.redis.address}/0"

    def start_worker(self, role: str, worker_id: str, *, host: str, extra: Sequence[str] = (), num_blocks: int = 256,
                     block_size: int = 4, bind: str | None = None) -> HostProc:
        """``bind``: its ``--host`` (default: the host's address; e.g. 0.0.0.0)."""
        address = self.net[host].address
        port = WORKER_PORT + 10 * sum(1 for w in self.workers.values() if w.address.startswith(f"{address}:"))
        args = [role, "--redis-url", self.redis_url, "--model", str(self.model_dir), "--host", bind or address,
                "--port", str(port), "--kv-port", str(port + 1),
                "--metrics-port", str(port - WORKER_PORT + METRICS_PORT),
                "--num-blocks", str(num_blocks), "--block-size", str(block_size), "--worker-id", worker_id,
                "--num-threads", "1", "--on-drain", "stay", *extra]
        self._worker_args[worker_id] = (host, args)
        proc = self._spawn(host, worker_id, args)
        proc.address = f"{address}:{port}"
        self.workers[worker_id] = proc
        self.metrics_addresses[worker_id] = f"{address}:{port - WORKER_PORT + METRICS_PORT}"
        return proc

    def restart_worker(self, worker_id: str, timeout_s: float = 90.0) -> HostProc:
        """Start worker ``worker_id`` again as it was first started (its host rebooted or the process gone) and
        wait until it serves (its old registration may not have expired yet: the registry cannot tell)."""
        host, args = self._worker_args[worker_id]
        address = self.workers[worker_id].address
        proc = self.workers[worker_id] = self._spawn(host, worker_id, args)
        proc.address = address
        deadline = time.monotonic() + timeout_s
        while " ready: grpc=" not in proc.log():
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{worker_id} did not start again:\n{proc.log()}")
            time.sleep(0.2)
        return proc

    def start_router(self, host: str, *extra: str) -> HostProc:
        address = self.net[host].address
        args = ["router", "--redis-url", self.redis_url, "--model", str(self.model_dir), "--host", address,
                "--port", str(ROUTER_PORT), "--metrics-port", "0", "--http-port", "0", *extra]
        self.router = self._spawn(host, "router", args)
        self.router.address = f"{address}:{ROUTER_PORT}"
        grpc.channel_ready_future(self.channel(self.router.address)).result(timeout=60)
        return self.router

    def _spawn(self, host: str, name: str, args: list[str]) -> HostProc:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        return self.net[host].spawn(name, [sys.executable, "-m", "deploy.cli", *args], self.log_dir, env)

    def wait_for_workers(self, worker_ids: set[str], timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.workers.values():
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited early:\n{proc.log()}")
            if worker_ids <= set(asyncio.run(self._registered())):
                return
            time.sleep(0.3)
        raise TimeoutError(f"workers {worker_ids} did not register in {timeout_s} s")

    async def _registered(self) -> list[str]:
        return [info.worker_id for info in await self.registered()]

    async def registered(self) -> list[WorkerInfo]:
        """The workers registered in Redis, as the router sees them."""
        redis = connect(f"unix://{self.forward(self.redis.address)}?db=0")
        try:
            return [info for info, _ in await Registry(redis, "baton").list_workers()]
        finally:
            await redis.aclose()

    def only(self, *worker_ids: str) -> None:
        """Drain every worker but ``worker_ids`` (the router then has one choice per role); returns once the router
        routes by a listing that says so (``set_draining_seen``: probe requests, decoded locally)."""
        decode = [w for w, (_, args) in self._worker_args.items() if args[0] == "decode"]
        set_draining_seen(self.channel(self.router.address), f"unix://{self.forward(self.redis.address)}?db=0",
                          "baton", decode_ids=decode, draining=[w for w in self.workers if w not in worker_ids])

    # ---- talking to them -------------------------------------------------------------------
    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(f"unix:{self.forward(address)}")
        return self._channels[address]

    def generate(self, prompt: list[int], max_tokens: int,
                 timeout_s: float = 60.0) -> tuple[list[int], pb.GenerateResponse]:
        """Greedy ``prompt`` through the router: (token ids, the last response, with the timings)."""
        responses = list(self.stream(prompt, max_tokens, timeout_s))
        return [t for r in responses for t in r.token_ids], responses[-1]

    def stream(self, prompt: list[int], max_tokens: int, timeout_s: float = 60.0, **sampling):
        """``prompt`` through the router, greedy unless ``sampling`` says otherwise (temperature, seed, ...): the
        call, to iterate response by response."""
        stub = pb_grpc.GenerationStub(self.channel(self.router.address))
        params = pb.SamplingParams(**{"temperature": 0.0, **sampling}, max_tokens=max_tokens, ignore_eos=True)
        return stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params), timeout=timeout_s)

    def stats(self, worker_id: str) -> pb.StatsResponse:
        stub = pb_grpc.WorkerStub(self.channel(self.workers[worker_id].address))
        return stub.Stats(pb.StatsRequest(), timeout=10, wait_for_ready=True)  # a restarted worker: reconnect

    def metrics(self, worker_id: str) -> str:
        """The worker's Prometheus /metrics text."""
        import http.client
        import socket

        class UnixHTTPConnection(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(10)
                self.sock.connect(str(path))

        path = self.forward(self.metrics_addresses[worker_id])
        conn = UnixHTTPConnection("localhost")
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def assert_pools_full(self, timeout_s: float = 10.0) -> None:
        """Every live worker's pool is full, no lease open, nothing running (nothing leaked)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = {w: self.stats(w) for w, proc in self.workers.items() if proc.alive()}
            if all(s.num_free_blocks == s.num_total_blocks and s.num_open_leases == 0 and s.num_running == 0
                   and s.num_free_staging_blocks == s.num_staging_blocks for s in stats.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"pools not back to full: {stats}")
            time.sleep(0.1)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        if self._forwarder.popen.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # it exited already (forward() said why)
                self._forwarder.popen.stdin.close()
