"""Fault scenarios on a real platform: redis-server, a router, one prefill and two decode workers in their own
processes. Used by ``tests/integration/test_faults.py`` (each scenario once) and ``bench/faults.py`` (each
scenario N times, with a table of counts).

    platform = FaultPlatform.start(model_dir, log_dir)
    result = SCENARIOS["decode_killed_mid_stream"](platform, Reference(model_dir))
    result.problems == [] and result.hung == 0 and result.leaked_blocks == 0

The prefill worker ``p0`` advertises a ``KVProxy`` (tests/integration/kv_proxy.py) as its KV data plane, so
a scenario can stall or corrupt pulls; decode workers verify per-block checksums (``--kv-checksum``) and
give up on a silent peer after 2 s (``--kv-io-timeout-s``). Every client call has a deadline; a call still
running past it (plus a grace) counts as hung. Each scenario ends by restoring the platform (restarting what
it killed), waiting for every pool to be full and every lease closed (``leaked_blocks``/``open_leases``
count what is left after ``SETTLE_S``), and sending one fresh request that must complete token-exact.
"""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.client_batch import Outcome, generate
from tests.integration.cluster import Cluster, Proc, free_port, set_draining_seen
from tests.integration.kv_proxy import KVProxy
from tests.redis_server import RedisServer, require_redis_server

DEADLINE_S = 30.0
SETTLE_S = 20.0  # pools must be full this long after a scenario (leases expire after LEASE_TTL_S)
LEASE_TTL_S, HEARTBEAT_TTL_S, KV_IO_TIMEOUT_S = 5.0, 3.0, 2.0
WORKERS = ("p0", "d0", "d1")
# The router reuses a registry listing for worker_list_ttl_s (0.5 s): a worker listed (or gone, or drained) in Redis
# is seen by the router this long after.
ROUTER_LISTING_S = 1.0


def prompt(i: int, length: int = 40, salt: int = 0) -> list[int]:
    """A deterministic prompt; 40 tokens (over the router's 8-token threshold) prefill remotely."""
    rng = random.Random(f"{salt}-{i}")
    return [rng.randrange(10, 3010) for _ in range(length)]


class Reference:
    """Output of the single-process engine (greedy, or seeded sampling): what every completed request must equal,
    token for token."""

    def __init__(self, model_dir: Path) -> None:
        from engine.config import EngineConfig
        from engine.engine import Engine

        self._engine = Engine(EngineConfig(model=str(model_dir), num_blocks=512, block_size=4))
        self._cache: dict[tuple, list[int]] = {}

    def tokens(self, prompt_ids: list[int], max_tokens: int, sampling: dict | None = None) -> list[int]:
        """``sampling``: beyond greedy (temperature, top_p, seed, ...); a sampled one needs its seed."""
        sampling = sampling or {}
        key = (tuple(prompt_ids), max_tokens, tuple(sorted(sampling.items())))
        if key not in self._cache:
            from engine.sampling_params import SamplingParams

            assert "seed" in sampling or not sampling.get("temperature"), "a sampled reference needs a seed"
            params = SamplingParams(**{"temperature": 0, **sampling}, max_tokens=max_tokens, ignore_eos=True)
            self._engine.add_request("ref", list(prompt_ids), params)
            out: list[int] = []
            while self._engine.has_unfinished():
                for delta in self._engine.step():
                    out.extend(delta.new_token_ids)
            self._cache[key] = out
        return self._cache[key]


@dataclass
class FaultPlatform:
    redis: RedisServer
    cluster: Cluster
    proxy: KVProxy
    kv_port: int
    workers: dict[str, Proc] = field(default_factory=dict)
    router: Proc | None = None
    epoch: int = 0  # scenarios run so far: each one's prompts differ from earlier ones' (nothing cached)
    router_args: tuple[str, ...] = ()  # e.g. ("--kv-layerwise",)

    @classmethod
    def start(cls, model_dir: Path, log_dir: Path, router_args: tuple[str, ...] = ()) -> FaultPlatform:
        require_redis_server()
        redis = RedisServer.start()
        kv_port = free_port()
        platform = cls(redis, Cluster(redis.url, model_dir, log_dir), KVProxy(kv_port), kv_port,
                       router_args=router_args)
        try:
            for name in WORKERS:
                platform.start_worker(name)
            platform.start_router(wait=False)  # starts while the workers load
            platform.wait_registered(WORKERS)
            platform.wait_router()
        except BaseException:
            platform.stop()
            raise
        return platform

    def prompt(self, i: int, length: int = 40) -> list[int]:
        return prompt(i, length, salt=self.epoch)

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.address

    def start_worker(self, name: str, *extra: str) -> Proc:
        """``extra``: more flags for this start only (e.g. ``--fault-step-delay-s``)."""
        common = ("--heartbeat-ttl-s", str(HEARTBEAT_TTL_S), *extra)
        if name.startswith("p"):
            args = ("--lease-ttl-s", str(LEASE_TTL_S), "--kv-port", str(self.kv_port),
                    "--kv-advertise-uri", self.proxy.uri, *common)
            proc = self.cluster.start_worker("prefill", *args, worker_id=name)
        else:
            # --on-drain stay: a decode worker drained by a scenario (set_draining) never exits however long the
            # scenario takes (the default exits once drained and idle for 5 s)
            args = ("--kv-checksum", "--kv-io-timeout-s", str(KV_IO_TIMEOUT_S), "--on-drain", "stay", *common)
            proc = self.cluster.start_worker("decode", *args, worker_id=name)
        self.workers[name] = proc
        self.cluster.workers = list(self.workers.values())  # what test_e2e.assert_pools_full reads
        return proc

    def start_router(self, port: int | None = None, *, wait: bool = True) -> Proc:
        extra = ("--port", str(port)) if port else ()
        self.metrics_port = free_port()
        self.router = self.cluster.start_router("--disagg-threshold-tokens", "8", "--policy", "least_loaded",
                                                "--metrics-port", str(self.metrics_port), *self.router_args, *extra)
        if port:
            self.router.address = f"127.0.0.1:{port}"  # the later --port wins over the one start_router picked
        if wait:
            self.wait_router()
        return self.router

    def wait_router(self, timeout_s: float = 60.0) -> None:
        with grpc.insecure_channel(self.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)

    def router_counter(self, name: str) -> float:
        """A counter of the router's /metrics, summed over its labels."""
        import urllib.request

        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(f"{name}{{"))

    def set_draining(self, name: str, draining: bool) -> None:
        """Drain (or undrain) worker ``name`` in the registry; returns once the router routes by a listing that
        says so (``cluster.set_draining_seen``: probe requests, decoded locally by the decode workers left)."""
        import asyncio

        from kv_transfer.registry import Registry, connect

        async def listed() -> set[str]:
            redis = connect(self.redis.url)
            try:
                return await Registry(redis, self.cluster.namespace).list_draining()
            finally:
                await redis.aclose()

        now = asyncio.run(listed())
        wanted = now | {name} if draining else now - {name}
        with grpc.insecure_channel(self.address) as channel:
            set_draining_seen(channel, self.redis.url, self.cluster.namespace, draining=wanted,
                              decode_ids=[n for n in self.workers if n.startswith("d")])

    def restart_worker(self, name: str, *extra: str) -> None:
        """SIGKILL worker ``name`` and start it again (with ``extra`` flags: see ``start_worker``)."""
        self.workers[name].kill(signal.SIGKILL)
        self.start_worker(name, *extra)
        self.wait_registered((name,))

    def registered(self) -> dict[str, str]:
        """worker id -> gRPC address, as the registry lists them now ({} when Redis does not answer)."""
        import asyncio

        from kv_transfer.registry import Registry, connect

        async def listing() -> dict[str, str]:
            redis = connect(self.redis.url)
            try:
                workers = await Registry(redis, self.cluster.namespace).list_workers()
                return {info.worker_id: info.grpc_address for info, _ in workers}
            except Exception:  # noqa: BLE001 - Redis down or restarting
                return {}
            finally:
                await redis.aclose()

        return asyncio.run(listing())

    def wait_registered(self, names, timeout_s: float = 90.0, *, present: bool = True) -> None:
        """Until each worker of ``names`` is listed at its current address (or, ``present=False``, not listed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name in names:
                if self.workers[name].popen.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{self.workers[name].log()}")
            listed = self.registered()
            if all((listed.get(n) == self.workers[n].address) == present for n in names):
                return
            time.sleep(0.2)
        raise TimeoutError(f"workers {names} not {'listed' if present else 'gone'} after {timeout_s} s")

    def leaks(self, timeout_s: float = SETTLE_S) -> tuple[int, int]:
        """(blocks not free, open leases) over the live workers, once both are 0 or when ``timeout_s`` ends."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self._stats()
            blocks = sum(s.num_total_blocks - s.num_free_blocks for s in stats if s is not None)
            leases = sum(s.num_open_leases for s in stats if s is not None)
            if ((blocks, leases) == (0, 0) and None not in stats) or time.monotonic() > deadline:
                return blocks, leases
            time.sleep(0.2)

    def _stats(self) -> list[pb.StatsResponse | None]:
        out = []
        for proc in self.workers.values():
            if proc.popen.poll() is not None:
                continue
            with grpc.insecure_channel(proc.address) as channel:
                try:
                    out.append(pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=2))
                except grpc.RpcError:
                    out.append(None)
        return out

    def stop(self) -> None:
        for proc in self.workers.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)  # a scenario that failed mid-way may leave one stopped
        self.cluster.stop_all()
        self.proxy.stop()
        self.redis.stop()


@dataclass
class ScenarioResult:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    leaked_blocks: int = 0
    open_leases: int = 0

    @property
    def codes(self) -> Counter[str]:
        return Counter(o.code for o in self.outcomes)

    @property
    def hung(self) -> int:
        return self.codes["HUNG"]


class Checker:
    """Collects a scenario's outcomes and what went wrong with them."""

    def __init__(self, name: str, reference: Reference) -> None:
        self.result, self._reference = ScenarioResult(name), reference

    def add(self, outcomes: list[Outcome], allowed: set[str]) -> list[Outcome]:
        for o in outcomes:
            self.result.outcomes.append(o)
            if o.code not in allowed:
                self.problem(f"status {o.code} ({o.details[:120]}), expected one of {sorted(allowed)}")
            elif o.code == "OK" and o.tokens != self._reference.tokens(o.prompt, o.max_tokens, o.sampling):
                self.problem(f"tokens differ from the offline engine ({len(o.prompt)}-token prompt, {o.sampling})")
        return outcomes

    def problem(self, text: str) -> None:
        self.result.problems.append(text)

    def finish(self, platform: FaultPlatform) -> ScenarioResult:
        """Pools full and leases closed, then one fresh request that must complete token-exact."""
        self.result.leaked_blocks, self.result.open_leases = platform.leaks()
        if self.result.leaked_blocks or self.result.open_leases:
            self.problem(f"{self.result.leaked_blocks} blocks and {self.result.open_leases} leases still held")
        fresh = generate(platform.address, platform.prompt(999), 6, DEADLINE_S)
        self.add([fresh], {"OK"})
        platform.epoch += 1
        return self.result


Scenario = Callable[[FaultPlatform, Reference], ScenarioResult]
