"""A private Baton platform for a benchmark: redis-server, P prefill and D decode workers and the router, each
process pinned to its core(s) (``taskset``, else ``os.sched_setaffinity`` in the child before exec), on free
localhost ports.

    plan = core_plan(Layout("disaggregated", prefill=1, decode=1), available=[0, 1])
    with Platform.start(plan, model_dir, log_dir, worker_args=[...], router_args=[...]) as platform:
        ... platform.grpc_address, platform.http_address ...

Every process is a child of this one and is stopped by PID on exit (router first, redis last): SIGTERM, a
bounded wait, then SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.up import Child, stop_all
from kv_transfer.ports import free_port
from kv_transfer.redis_index import RedisKeys

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    name: str
    prefill: int
    decode: int

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True, slots=True, kw_only=True)
class CorePlan:
    """Which core each worker runs on (prefill workers first, then decode) and where router + redis run."""

    layout: Layout
    worker_cores: tuple[tuple[str, str, int], ...]  # (role, worker id, core)
    router_core: int

    def describe(self) -> str:
        workers = ", ".join(f"{wid}->core {core}" for _, wid, core in self.worker_cores)
        return f"{self.layout.name}: {workers}; router+redis->core {self.router_core}"


def core_plan(layout: Layout, available: list[int], router_core: int | None = None) -> CorePlan:
    """One core per worker, in order; router and redis share one core: ``router_core``, else the first core
    no worker uses, else the last worker's (a decode worker's, in either layout). Raises ValueError when the
    layout has more workers than ``available`` cores."""
    if layout.num_workers > len(available):
        raise ValueError(f"{layout.name} needs {layout.num_workers} cores (one per worker); "
                         f"this process may use {len(available)}: {available}")
    roles = [("prefill", f"p{i}") for i in range(layout.prefill)] + [("decode", f"d{i}") for i in range(layout.decode)]
    workers = tuple((role, wid, available[i]) for i, (role, wid) in enumerate(roles))
    if router_core is None:
        spare = available[layout.num_workers:]
        router_core = spare[0] if spare else workers[-1][2]
    return CorePlan(layout=layout, worker_cores=workers, router_core=router_core)




def pinned(cmd: list[str], cores: set[int]) -> tuple[list[str], object]:
    """``cmd`` made to run on ``cores`` from its first instruction: under ``taskset`` when there is one, else
    with ``os.sched_setaffinity`` between fork and exec (a ``preexec_fn``); the second item is that hook."""
    taskset = shutil.which("taskset")
    if taskset:
        return [taskset, "--cpu-list", ",".join(map(str, sorted(cores))), *cmd], None
    return cmd, lambda: os.sched_setaffinity(0, cores)


@dataclass
class Platform:
    log_dir: Path
    children: list[Child] = field(default_factory=list)
    grpc_address: str = ""
    http_address: str = ""
    redis_url: str = ""
    model_dir: Path | None = None

    @classmethod
    def start(cls, plan: CorePlan, model_dir: Path, log_dir: Path, *, worker_args: list[str],
              router_args: list[str], ready_timeout_s: float = 180.0) -> Platform:
        """Start everything and wait until every worker registered and the router answers; stops what it
        started if any step fails."""
        log_dir.mkdir(parents=True, exist_ok=True)
        platform = cls(log_dir)
        try:
            platform._start(plan, model_dir, worker_args, router_args, ready_timeout_s)
        except BaseException:
            platform.stop()
            raise
        return platform

    def __enter__(self) -> Platform:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child (router first, redis last), wait at most ``grace_s``, SIGKILL the rest."""
        stop_all(self.children, grace_s=grace_s)
        self.children.clear()

    def _start(self, plan: CorePlan, model_dir: Path, worker_args: list[str], router_args: list[str],
               ready_timeout_s: float) -> None:
        deadline = time.monotonic() + ready_timeout_s
        self.model_dir = model_dir
        self.redis_url = self._start_redis(plan.router_core)
        redis = _wait_for_redis(self.redis_url, deadline)
        common = ["--redis-url", self.redis_url, "--model", str(model_dir)]
        for role, worker_id, core in plan.worker_cores:
            self._spawn(worker_id, {core}, [role, *common, "--worker-id", worker_id, "--num-threads", "1",
                                            "--metrics-port", "0", *worker_args])
        try:
            self._wait_for_workers(redis, {wid for _, wid, _ in plan.worker_cores}, deadline)
        finally:
            redis.close()
        grpc_port, http_port = free_port(), free_port()
        self._spawn("router", {plan.router_core}, ["router", *common, "--port", str(grpc_port), "--metrics-port", "0",
                                                   "--http-port", str(http_port), *router_args])
        self.grpc_address, self.http_address = f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"
        self._wait_for_router(deadline)

    def add_router(self, name: str, router_args: list[str], *, core: int) -> None:
        """Another router on the same workers (give it ``--port``); returns once it answers on that port."""
        common = ["--redis-url", self.redis_url, "--model", str(self.model_dir), "--metrics-port", "0", "--http-port", "0"]
        self._spawn(name, {core}, ["router", *common, *router_args])
        port = router_args[router_args.index("--port") + 1]
        deadline = time.monotonic() + 60
        while True:
            self._check_alive()
            try:
                with socket.create_connection(("127.0.0.1", int(port)), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router {name} did not start in time (logs: {self.log_dir})") from None
                time.sleep(0.3)

    def _start_redis(self, core: int) -> str:
        binary = os.environ.get("BATON_REDIS_SERVER") or shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("no redis-server binary (apt-get install redis-server, or $BATON_REDIS_SERVER)")
        port = free_port()
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.log_dir)]
        self._popen("redis", {core}, cmd)
        return f"redis://127.0.0.1:{port}"

    def _spawn(self, name: str, cores: set[int], args: list[str]) -> None:
        self._popen(name, cores, [sys.executable, "-m", "deploy.cli", *args])

    def _popen(self, name: str, cores: set[int], cmd: list[str]) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        cmd, preexec_fn = pinned(cmd, cores)
        with (self.log_dir / f"{name}.log").open("wb") as log:
            popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                     preexec_fn=preexec_fn)
        self.children.append(Child(name, popen))

    def _check_alive(self) -> None:
        for child in self.children:
            if child.popen.poll() is not None:
                tail = (self.log_dir / f"{child.name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{child.name} exited with {child.popen.returncode}:\n{tail}")

    def _wait_for_workers(self, redis, worker_ids: set[str], deadline: float) -> None:
        keys = RedisKeys()
        while not worker_ids <= {m.decode() for m in redis.smembers(keys.workers)}:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(worker_ids)} did not register in time (logs: {self.log_dir})")
            time.sleep(0.3)

    def _wait_for_router(self, deadline: float) -> None:
        import grpc

        while True:
            self._check_alive()
            try:
                with grpc.insecure_channel(self.grpc_address) as channel:
                    grpc.channel_ready_future(channel).result(timeout=1.0)
                with socket.create_connection(("127.0.0.1", int(self.http_address.rsplit(":", 1)[1])), timeout=1):
                    return
            except (grpc.FutureTimeoutError, OSError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the router did not start in time (logs: {self.log_dir})") from None
                time.sleep(0.3)


def _wait_for_redis(url: str, deadline: float):
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2.0)
    while True:
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
