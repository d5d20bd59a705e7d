"""Start real Baton processes on free localhost ports for integration tests; stop them by PID."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kv_transfer.ports import free_port  # noqa: F401 - the port chooser (outside the ephemeral range), imported from here
from kv_transfer.hashing import hash_blocks, root_hash
from kv_transfer.registry import Registry, connect
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]




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

    def wait_indexed(self, holder: str, tokens: Sequence[int], *, salt: str = "", mirrors: int = 0,
                     timeout_s: float = 30.0) -> None:
        """Until the KV index in Redis names ``holder`` for every full block of ``tokens`` (hashed as a router hashes
        a request of tenant ``salt``: the holder's registered fingerprint and block size; workers publish their
        blocks every 0.25 s), then until ``mirrors`` routers' index mirrors hold it too (``wait_mirrors_read``)."""
        asyncio.run(self._wait_indexed(holder, tokens, salt, time.monotonic() + timeout_s))
        if mirrors:
            wait_mirrors_read(self.redis_url, mirrors, timeout_s)

    async def _wait_indexed(self, holder: str, tokens: Sequence[int], salt: str, deadline_s: float) -> None:
        from router.routing.directory import scheme_of

        redis = connect(self.redis_url)
        try:
            registry = Registry(redis, self.namespace)
            listed = {info.worker_id: info for info, _ in await registry.list_workers()}
            assert holder in listed, f"{holder} is not registered (listed: {sorted(listed)})"
            scheme = scheme_of(listed[holder])
            assert scheme is not None, listed[holder]
            hashes = hash_blocks(tokens, scheme.block_size, root_hash(scheme.fingerprint, scheme.block_size, salt))
            assert hashes, f"{len(tokens)} tokens fill no block"
            while (held := (await registry.index.lookup_tiers(hashes)).gpu.get(holder, 0)) < len(hashes):
                assert time.monotonic() < deadline_s, f"{holder} indexed for {held} of {len(hashes)} blocks"
                await asyncio.sleep(0.05)
        finally:
            await redis.aclose()

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.kill(signal.SIGTERM)
        self.procs.clear()


# Shorter than one KV block (every cluster here runs block size 4) and under every test router's disaggregation
# threshold: decoded where it is routed, with no prefill worker, and nothing of it cached or indexed.
PROBE_PROMPT = [17, 29]


def set_draining_seen(channel: grpc.Channel, redis_url: str, namespace: str, *, decode_ids: Collection[str],
                      draining: Collection[str], timeout_s: float = 30.0) -> None:
    """Make the registry's draining set exactly ``draining`` and return once the router behind ``channel`` routes
    by a listing that has it so.

    The router re-lists the registry when a request finds its listing older than ``worker_list_ttl_s`` (0.5 s), and
    shows its listing nowhere but in its decisions (the Admin ``ListWorkers`` reads Redis afresh). So every decode
    worker (``decode_ids``) is drained first, until a probe request is refused with "no decode workers (N
    draining)": the router's listing is newer than that write. Then the set becomes ``draining`` in one write, and
    once a probe is served, the listing that routed it is newer than that write too."""
    everyone = {*decode_ids, *draining}
    asyncio.run(_write_draining(redis_url, namespace, everyone, exactly=False))
    _probe_until(channel, refused=True, timeout_s=timeout_s)
    if set(decode_ids) <= set(draining):
        return  # every decode worker drained: the refusal was the listing to wait for
    asyncio.run(_write_draining(redis_url, namespace, draining, exactly=True))
    _probe_until(channel, refused=False, timeout_s=timeout_s)


async def _write_draining(redis_url: str, namespace: str, worker_ids: Collection[str], *, exactly: bool) -> None:
    """Add ``worker_ids`` to the draining set, or (``exactly``) make it that set, in one transaction."""
    redis = connect(redis_url)
    try:
        key = Registry(redis, namespace).keys.draining
        async with redis.pipeline(transaction=True) as pipe:
            if exactly:
                pipe.delete(key)
            if worker_ids:
                pipe.sadd(key, *worker_ids)
            await pipe.execute()
    finally:
        await redis.aclose()


def _probe_until(channel: grpc.Channel, *, refused: bool, timeout_s: float) -> None:
    """Until a probe is refused for want of an undrained decode worker (``refused``), or served (not)."""
    stub = pb_grpc.GenerationStub(channel)
    params = pb.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROBE_PROMPT), sampling=params)
    deadline, last = time.monotonic() + timeout_s, ""
    while True:
        try:
            list(stub.Generate(request, timeout=10))
            last = "served"
        except grpc.RpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
        drained = last.startswith("UNAVAILABLE: ") and "no decode workers (" in last and "draining)" in last
        if drained if refused else last == "served":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router's listing did not show the drain in {timeout_s} s; last probe: {last}")
        time.sleep(0.05)


def wait_mirrors_read(redis_url: str, mirrors: int, timeout_s: float = 30.0) -> None:
    """Until ``mirrors`` clients of Redis wait in a blocking XREAD: the routers' index mirrors (nothing else reads
    streams here), each of which reads again only once it applied what it read, with one XREAD at a time. A blocked
    XREAD has nothing left to read, so once every mirror's is, each holds every index event written before this
    call. ``mirrors``: the routers with ``--index-mirror`` (the default) on that Redis."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while (waiting := sum(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in client.client_list())) \
                < mirrors:
            assert time.monotonic() < deadline, f"{waiting} of {mirrors} index mirrors caught up in {timeout_s} s"
            time.sleep(0.01)
    finally:
        client.close()
