"""``baton up``: the whole platform on this machine — a private redis-server (unless --redis-url),
the router, N prefill and M decode workers, and with ``--kv-store`` (no URI) a Mooncake Store on loopback for the
store tier (``deploy/kv_store.py``). Prints the endpoints; Ctrl-C stops every process."""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.kv_store import StoreStartError, start_store, store_env
from deploy.passthrough import add_passthrough, argv_of
from deploy.pools import PoolManager
from engine.errors import ModelLoadError
from engine.model_source import MODEL_HELP, resolve_model
from kv_transfer.ports import free_port
from kv_transfer.redis_index import RedisKeys
from kv_transfer.registry import redact_url, with_ca
from proto import tls

LOCAL_STORE = "local"  # `baton up --kv-store` with no URI: start one
_REDIS_HINT = ("no redis-server binary found: install Debian's `redis-server` (apt-get install redis-server), "
               "run `make install` as root, or pass --redis-url of a running Redis")


@dataclass
class Child:
    name: str
    popen: subprocess.Popen


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baton up", description=__doc__)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting a private one")
    p.add_argument("--port", type=int, default=50051, help="router gRPC port")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None, metavar="N",
                       help=f"{role} workers only: split the model across N rank processes (overrides "
                       "--tensor-parallel-size for them; prefill and decode may differ)")
    p.add_argument("--metrics-port", type=int, default=9450,
                   help="router's Prometheus /metrics port; workers take the next ones (default: %(default)s)")
    p.add_argument("--log-dir", default=None, help="where process logs go (default: a temp folder)")
    p.add_argument("--namespace", default="baton", help="Redis key namespace")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP front (0: off)")
    p.add_argument("--kv-store-memory", default="1 GB",
                   help="with --kv-store and no URI: the memory the store's standalone client holds, as Mooncake "
                   "spells it (default: %(default)s)")
    tls.add_arguments(p)  # passed to the router and every worker: all gRPC hops use the same CA
    from worker.main import add_worker_options
    from router.main import add_routing_options

    p.set_defaults(worker_options=add_passthrough(p, "every worker's engine and KV options (as `baton prefill`)",
                                                  add_worker_options),
                   router_options=add_passthrough(p, "the router's options (as `baton router`)", add_routing_options))
    store = next(a for a in p._actions if a.dest == "kv_store")  # noqa: SLF001 - the worker's own option
    store.nargs, store.const = "?", LOCAL_STORE
    store.help += f"; given without a URI, `baton up` starts a Mooncake Store on loopback ({LOCAL_STORE})"
    args = p.parse_args(argv)
    try:
        config = tls.from_args(args)
        if config is not None:
            config.require_server_identity()
    except tls.TlsConfigError as exc:
        p.error(str(exc))
    return args


def _max_model_len(args: argparse.Namespace) -> list[str]:
    return ["--max-model-len", str(args.max_model_len)] if "max_model_len" in vars(args) else []


def _tls_flags(args: argparse.Namespace) -> list[str]:
    """The TLS flags given to `baton up`, passed on to the router and the workers as they are."""
    given = (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca),
             ("--tls-server-name", args.tls_server_name))
    return [item for flag, value in given if value for item in (flag, value)]


def main(argv: list[str]) -> int:
    args = _parse(argv)
    try:
        source = resolve_model(args.model)  # builds a missing preset first
    except ModelLoadError as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        return 2
    model = str(source.path)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="baton-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    store: list[Child] = []  # the store's processes: stopped after the workers, never stop the platform
    pools = None
    try:
        redis_url = args.redis_url or start_redis(log_dir, children)
        if getattr(args, "kv_store", None) == LOCAL_STORE:
            args.kv_store = start_store(log_dir, lambda name, argv, log: _start(name, argv, log, store),
                                        memory=args.kv_store_memory)
        common = ["--redis-url", redis_url, "--model", model, "--namespace", args.namespace, *_tls_flags(args)]
        worker_flags = argv_of(args, args.worker_options)
        router_flags = argv_of(args, args.router_options) + _max_model_len(args)  # the router's limit follows
        redis = _wait_for_redis(with_ca(redis_url, os.environ.get("BATON_REDIS_CA")))
        pools = _pool_manager(args, [*common, *worker_flags], log_dir, redis)
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            pools.redis.set(pools.keys.pool_desired(role), count)  # `baton admin scale` changes these
            for _ in range(count):
                pools.start(role)
        router = ["router", *common, "--model-name", source.name, "--port", str(args.port),
                  "--metrics-port", str(args.metrics_port), "--http-port", str(args.http_port), *router_flags]
        spawn("router", router, log_dir, children)
        _announce(args, redis_url, log_dir)
        return _wait(children, pools)
    except FileNotFoundError:
        print(f"baton up: {_REDIS_HINT}", file=sys.stderr)
        return 2
    except StoreStartError as exc:
        print(f"baton up: the KV store did not start: {exc}", file=sys.stderr)
        return 2
    finally:
        workers = pools.children() if pools is not None else []
        redis = [c for c in children if c.name == "redis"]
        stop_all(workers + [c for c in children if c.name != "redis"])  # the router and the workers first,
        stop_all(redis + store)  # then what they use: the store (a worker closing its client still reaches it)


def start_redis(log_dir: Path, children: list[Child]) -> str:
    binary = os.environ.get("BATON_REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server")
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(log_dir)]
    with (log_dir / "redis.log").open("wb") as log:
        children.append(Child("redis", subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
    return f"redis://127.0.0.1:{port}"


def _start(name: str, argv: list[str], log_path: Path, children: list[Child]) -> subprocess.Popen:
    """A store process (not one of ours: its own binary, the store's environment)."""
    with log_path.open("wb") as log:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=store_env())
    children.append(Child(name, popen))
    return popen


def spawn(name: str, args: list[str], log_dir: Path, children: list[Child]) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with (log_dir / f"{name}.log").open("wb") as log:
        popen = subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                 env=env)
    children.append(Child(name, popen))


def _announce(args: argparse.Namespace, redis_url: str, log_dir: Path) -> None:
    print(f"Baton is starting: {args.prefill} prefill + {args.decode} decode workers", flush=True)
    print(f"  router   grpc://127.0.0.1:{args.port}   (baton.v1.Generation, baton.v1.Admin; "
          f"{tls.describe(tls.from_args(args))})")
    scheme = "https" if tls.from_args(args) is not None else "http"  # the HTTP front and /metrics follow gRPC's TLS
    if args.http_port:
        print(f"  openai   {scheme}://127.0.0.1:{args.http_port}/v1   (completions, chat/completions, models)")
    print(f"  metrics  {scheme}://127.0.0.1:{args.metrics_port}/metrics (router), "
          f"{args.metrics_port + 1}-{args.metrics_port + args.prefill + args.decode} (workers)")
    print(f"  redis    {redact_url(redis_url)}")
    if getattr(args, "kv_store", None):
        print(f"  kv store {args.kv_store}")
    print(f"  logs     {log_dir}")
    baton = shutil.which("baton") or str(Path(sys.executable).parent / "baton")
    client_tls = " ".join(_tls_flags(args))  # for mTLS give a client certificate of the same CA instead
    print(f"\ntry:  {baton} generate \"def main():\" --router 127.0.0.1:{args.port} {client_tls}".rstrip()
          + "\n(Ctrl-C stops everything)", flush=True)


def role_flags(args: argparse.Namespace, role: str) -> list[str]:
    """The flags only ``role``'s workers get (after the common ones: the last one given wins)."""
    size = getattr(args, f"{role}_tensor_parallel_size")
    return [] if size is None else ["--tensor-parallel-size", str(size)]


def _vllm_cpus(args: argparse.Namespace, index: int) -> list[str]:
    """``--engine vllm`` without ``--vllm-cpus``: each worker's vLLM threads on a core of their own, round robin
    (vLLM's default binds every worker to every core, and they then compete for all of them)."""
    if getattr(args, "engine", "baton") != "vllm" or getattr(args, "vllm_cpus", None):
        return []
    return ["--vllm-cpus", str(index % (os.cpu_count() or 1))]


def _pool_manager(args, common: list[str], log_dir: Path, redis) -> PoolManager:
    ports, cores = itertools.count(args.metrics_port + 1), itertools.count()

    def start_worker(role: str, worker_id: str) -> Child:
        workers: list[Child] = []
        # --on-drain stay: the pool manager stops the workers it drains; one an operator drains stays, idle
        spawn(worker_id, [role, *common, "--worker-id", worker_id, "--num-threads", str(args.num_threads),
                          "--on-drain", "stay", *role_flags(args, role), *_vllm_cpus(args, next(cores)),
                          "--metrics-port", str(next(ports))], log_dir, workers)
        return workers[0]

    return PoolManager(redis=redis, keys=RedisKeys(args.namespace), start_worker=start_worker,
                       report=lambda message: print(f"baton up: {message}", file=sys.stderr, flush=True))


def _wait_for_redis(url: str, timeout_s: float = 10.0):
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2.0)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return client
        except redis.AuthenticationError as exc:  # never print the URL itself: it may hold the password
            raise SystemExit(f"baton up: Redis at {redact_url(url)} refused the credentials: {exc}") from None
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _wait(children: list[Child], pools: PoolManager) -> int:
    stop = {"signal": False}

    def on_signal(signum, frame) -> None:
        stop["signal"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    next_tick = 0.0
    while not stop["signal"]:
        for child in children:  # redis and the router: without them nothing serves (workers are supervised)
            if child.popen.poll() is not None:
                print(f"baton up: {child.name} exited with {child.popen.returncode}; stopping", file=sys.stderr)
                return 1
        if time.monotonic() >= next_tick:
            _tick(pools)
            next_tick = time.monotonic() + 1.0
        time.sleep(0.2)
    print("\nstopping ...", flush=True)
    return 0


def _tick(pools: PoolManager) -> None:
    try:
        pools.tick()
    except Exception as exc:  # noqa: BLE001 - Redis away for a moment: keep serving, retry next tick
        print(f"baton up: pool check failed ({exc!r}); retrying", file=sys.stderr)


def stop_all(children: list[Child], grace_s: float = 10.0) -> None:
    for child in reversed(children):
        if child.popen.poll() is None:
            child.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in reversed(children):
        try:
            child.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.popen.kill()
            child.popen.wait(5)
