"""The worker CLI both roles share (``baton prefill`` / ``baton decode``, through ``prefill_node.main`` and
``decode_node.main``): flags, checks before loading, and one worker process until SIGINT, SIGTERM or a drain."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config import DEFAULT_GRAPH_SIZES, EngineConfig
from engine.core.speculation import SpeculativeConfig
from engine.errors import InvalidRequest
from engine.model_source import MODEL_HELP
from kv_transfer.auth import load_secret
from kv_transfer.kv_store import parse_store_uri
from kv_transfer.transport import parse_kinds
from kv_transfer.registry import RedisCredentialsError, check_credentials, connect, redact_url, with_ca
from proto import event_loop, tls
from worker.config import WorkerConfig
from worker.vllm_engine import cli as vllm_cli

if TYPE_CHECKING:
    from worker.node import WorkerNode

NodeFactory = Callable[[WorkerConfig], "WorkerNode"]  # the role's node class (imported lazily: torch)


def add_worker_options(group) -> None:
    """The engine and data-plane options, defined once: each worker's CLI and ``baton up`` (which passes them on)
    take them from here."""
    vllm_cli.add_options(group)
    group.add_argument("--kv-transport", default="tcp",
                       help="KV data plane: auto (every transport that runs here) or a comma-separated list in order of "
                       "preference, of tcp, cma, ucx, nccl, nixl (default: %(default)s). All are served; a pull uses the "
                       "pulling worker's first transport the serving worker offers")
    group.add_argument("--kv-secret-file", default=None,
                       help="file holding the deployment's KV data-plane secret (default: $BATON_KV_SECRET); with one, "
                       "KV reads must carry its HMAC and this worker's pulls sign theirs")
    group.add_argument("--kv-checksum", action="store_true",
                       help="decode role: ask for and verify per-block xxh3 checksums of pulled KV; a mismatch "
                       "recomputes the prompt locally")
    group.add_argument("--kv-io-timeout-s", type=float, default=10.0,
                       help="decode role: the longest a KV pull waits on its peer at any one point (default: %(default)s)")
    group.add_argument("--kv-staging", default="auto", choices=["auto", "always"],
                       help="serve and pull the KV through pinned host staging blocks: auto when the cache is on a "
                       "GPU (a transport that cannot read device memory); always for any cache (default: %(default)s)")
    group.add_argument("--kv-staging-blocks", type=int, default=None,
                       help="host staging blocks (default: half the cache, and room for the longest prompt)")
    group.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: sized from memory)")
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                       help="a request preempted for KV blocks: recompute (its full blocks stay in the prefix cache) "
                       "or swap (all its blocks to the host tier, --kv-host-blocks, and back when it resumes)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                       help="auto: the model's dtype; int8 or fp8: 8-bit KV values with a float32 scale per token and "
                       "head (about half a 16-bit cache's bytes: more sequences fit, every KV transfer moves less)")
    group.add_argument("--weights", default="auto", choices=["auto", "int4"],
                       help="auto: the model's dtype; int4: linear weights in 4 bits (groups of 32, CPU only, "
                       "bfloat16 products: faster decode, results differ slightly; docs/benchmarks.md)")
    group.add_argument("--kv-host-blocks", type=int, default=0,
                       help="a host-memory tier below the KV cache, in blocks (pinned on a GPU): cached blocks the "
                       "cache evicts are copied down, and a prefix found there is copied back up instead of "
                       "recomputed (default: %(default)s, none)")
    group.add_argument("--kv-store", default=None, metavar="URI",
                       help="a shared KV store tier below the host tier: mooncake://MASTER_HOST:RPC_PORT?metadata="
                       "HOST:PORT (a mooncake_master and its HTTP metadata server; `baton up --kv-store` starts them). "
                       "Blocks leaving this worker are written there, and a prompt's prefix found there is fetched "
                       "(verified) instead of recomputed (default: none)")
    group.add_argument("--kv-store-write", default="evict", choices=["auto", "evict", "through"],
                       help="what goes to the store: evict (blocks leaving this worker's tiers), through (also every "
                       "block as it is computed; a block is written once either way); auto: through on prefill "
                       "workers, evict on decode workers (default: %(default)s: write-through cost the prefill "
                       "worker's prompts more than it saved, docs/benchmarks.md)")
    group.add_argument("--kv-store-buffer-blocks", type=int, default=64,
                       help="host slots for the store tier, as many again for reads (default: %(default)s)")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-waiting", type=int, default=None,
                       help="admission control: refuse new requests (RESOURCE_EXHAUSTED) past this many queued")
    group.add_argument("--dtype", default="auto",
                       help="auto (bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16")
    group.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda or cuda:N")
    group.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"],
                       help="auto: flashinfer on CUDA where its kernels fit the model, else torch")
    group.add_argument("--cuda-graph-sizes", default=",".join(map(str, DEFAULT_GRAPH_SIZES)),
                       help="decode batch sizes captured as CUDA graphs, comma-separated (capped by --max-num-seqs; "
                       "default: %(default)s)")
    group.add_argument("--speculative-config", default=None,
                       help='speculative decoding, as JSON in vLLM\'s shape: {"method": "ngram", '
                       '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} (n-gram prompt '
                       'lookup) or {"model": DRAFT, "num_speculative_tokens": 3} (a smaller checkpoint with the same '
                       "vocabulary); decode role. Outputs are the same token for token with it on or off")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="split the model's attention heads and MLP across this many rank processes (children of "
                       "this worker, in lockstep; the heads and MLP size must divide evenly); the KV layout names "
                       "the degree, so workers of different degrees still hand KV to each other (default: %(default)s)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs: every step runs eagerly (graphs are CUDA only in any case)")
    group.add_argument("--calibrate-tokens", type=int, default=256,
                       help="at start, time a prefill of this many tokens and one decode step, so the router prices "
                       "this worker from its first heartbeat (default: %(default)s; 0: learn from traffic only)")
    group.add_argument("--lease-ttl-s", type=float, default=30.0, help="how long unpulled KV stays pinned")
    group.add_argument("--heartbeat-ttl-s", type=float, default=6.0,
                       help="the registration and load report expire this long after the last heartbeat (default: "
                       "%(default)s)")
    group.add_argument("--heartbeat-interval-s", type=float, default=None,
                       help="heartbeat (and load report) period; below --heartbeat-ttl-s (default: a third of the TTL, "
                       "at most 2 s)")
    group.add_argument("--drain-settle-s", type=float, default=5.0,
                       help="while draining, exit only after this long with nothing in flight (default: %(default)s)")


def _graph_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--cuda-graph-sizes takes comma-separated positive batch sizes, got {text!r}")
    return sizes


def _num_threads(args: argparse.Namespace) -> int | None:
    """``--num-threads``; with tensor parallelism and none given, each rank (this process too) takes its share of
    the cores, so N ranks do not run N times as many threads as there are cores."""
    if args.num_threads or args.tensor_parallel_size <= 1:
        return args.num_threads
    return max(1, (os.cpu_count() or 1) // args.tensor_parallel_size)


def heartbeat_interval_s(args: argparse.Namespace) -> float:
    """``--heartbeat-interval-s``, or a third of the TTL (at most 2 s): a registration outlives two missed beats."""
    if args.heartbeat_ttl_s <= 0:
        raise ValueError(f"--heartbeat-ttl-s must be positive, got {args.heartbeat_ttl_s}")
    if args.heartbeat_interval_s is None:
        return min(2.0, args.heartbeat_ttl_s / 3)
    if not 0 < args.heartbeat_interval_s < args.heartbeat_ttl_s:
        raise ValueError(f"--heartbeat-interval-s must be positive and below --heartbeat-ttl-s "
                         f"({args.heartbeat_ttl_s}), got {args.heartbeat_interval_s}")
    return args.heartbeat_interval_s


def _speculative(text: str | None) -> SpeculativeConfig | None:
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON ({exc}): {text!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    try:
        return SpeculativeConfig.from_dict(raw)
    except (InvalidRequest, TypeError) as exc:
        raise ValueError(f"--speculative-config: {str(exc).removeprefix('speculative_config: ')}") from None


def parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"baton {role}", description=f"Run a Baton {role} worker.")
    redis_url = os.environ.get("BATON_REDIS_URL") or None
    p.add_argument("--redis-url", required=redis_url is None, default=redis_url,
                   help="Redis of the KV index and registry: redis://[:PASSWORD@]HOST:PORT/DB or rediss://... "
                   "for TLS (default: $BATON_REDIS_URL, where a password is safer than on the command line)")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--namespace", default="baton", help="Redis key namespace")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve gRPC and the KV data plane on, and to register for peers; 0.0.0.0: every "
                   "interface, registering the address that routes to Redis (default: %(default)s, this host only)")
    p.add_argument("--advertise-host", default=None,
                   help="the address to register for routers and peers when it is not --host (e.g. behind NAT)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--kv-port", type=int, default=0, help="KV data-plane port (0: any free port)")
    p.add_argument("--kv-advertise-uri", default=None,
                   help="the KV data-plane URI to register for peers, e.g. tcp://HOST:PORT of a proxy or NAT "
                   "address (default: the one served)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (CPU)")
    add_worker_options(p.add_argument_group("engine and KV (`baton up` passes these to every worker)"))
    p.add_argument("--metrics-port", type=int, default=9451,
                   help="serve Prometheus /metrics on --host at this port, over HTTPS with --tls-cert "
                   "(default: %(default)s; 0: no endpoint)")
    p.add_argument("--on-drain", default="exit", choices=["exit", "stay"],
                   help="once drained (baton admin drain) and idle: exit 0 (default) or stay up, idle")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--fault-step-delay-s", type=float, default=0.0,
                   help="fault injection for tests and drills: every engine step first sleeps this long, as on an "
                   "overloaded device (default: 0, none)")
    p.add_argument("--fault-layer-delay-s", type=float, default=0.0,
                   help="fault injection: each decoder layer of every step takes this much longer before it "
                   "writes its KV, as a big model's layers do; layer-wise streaming shows (default: 0, none)")
    p.add_argument("--fault-nixl-lose-notifications", action="store_true",
                   help="fault injection: this worker's nixl:// server drops every READ notification, so no nixl read "
                   "of it completes (the reader times out and recomputes); its agent still progresses")
    p.add_argument("--otel-console", action="store_true",
                   help="print OpenTelemetry trace spans on stderr (also $BATON_OTEL_CONSOLE=1; OTLP export: "
                   "the standard OTEL_* variables, see proto/tracing.py)")
    tls.add_arguments(p)
    event_loop.add_argument(p)
    return p


def worker_config(role: str, args: argparse.Namespace) -> WorkerConfig:
    """Raises ValueError (TlsConfigError) on bad TLS flags."""
    tls_config = tls.from_args(args)
    if tls_config is not None:
        tls_config.require_server_identity()
    if args.kv_host_blocks < 0:
        raise ValueError(f"--kv-host-blocks must be at least 0, got {args.kv_host_blocks}")
    if args.kv_staging_blocks is not None and args.kv_staging_blocks < 1:
        raise ValueError(f"--kv-staging-blocks must be at least 1, got {args.kv_staging_blocks}")
    if args.kv_store_buffer_blocks < 1:
        raise ValueError(f"--kv-store-buffer-blocks must be at least 1, got {args.kv_store_buffer_blocks}")
    store = parse_store_uri(args.kv_store) if args.kv_store else None
    if store is not None and importlib.util.find_spec("mooncake") is None:
        raise ValueError("--kv-store needs Mooncake: pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1' "
                         "(the store extra; make install does it) and Debian's libibverbs1")
    if args.kv_transport.strip() != "auto":
        parse_kinds(args.kv_transport)  # names a transport that cannot run here: refused before loading
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_num_waiting=args.max_num_waiting, num_threads=_num_threads(args),
        attention_backend=args.attention_backend, cuda_graph_sizes=_graph_sizes(args.cuda_graph_sizes),
        enforce_eager=args.enforce_eager, kv_host_blocks=args.kv_host_blocks, kv_cache_dtype=args.kv_cache_dtype,
        weights=args.weights,
        speculative_config=_speculative(args.speculative_config), preemption_mode=args.preemption_mode,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_store_buffer_blocks=args.kv_store_buffer_blocks if store else 0,
        kv_store_write=store_write_policy(args.kv_store_write, role),
    )
    if args.tensor_parallel_size > 1 and args.kv_staging == "always":
        raise ValueError("--kv-staging always is not combined with --tensor-parallel-size: a tensor-parallel "
                         "worker serves each rank's cache in place from shared host memory")
    return WorkerConfig(
        role=role, engine=engine, redis_url=with_ca(args.redis_url, os.environ.get("BATON_REDIS_CA")),
        namespace=args.namespace, host=args.host, advertise_host=args.advertise_host,
        grpc_port=args.port, kv_transport=args.kv_transport, kv_port=args.kv_port, worker_id=args.worker_id,
        kv_advertise_uri=args.kv_advertise_uri, kv_checksum=args.kv_checksum, kv_io_timeout_s=args.kv_io_timeout_s,
        kv_secret=load_secret(args.kv_secret_file),
        calibrate_tokens=args.calibrate_tokens, lease_ttl_s=args.lease_ttl_s, heartbeat_ttl_s=args.heartbeat_ttl_s,
        heartbeat_interval_s=heartbeat_interval_s(args), metrics_port=args.metrics_port,
        on_drain=args.on_drain, drain_settle_s=args.drain_settle_s, tls=tls_config,
        kv_staging=args.kv_staging, kv_staging_blocks=args.kv_staging_blocks,
        fault_step_delay_s=args.fault_step_delay_s, fault_layer_delay_s=args.fault_layer_delay_s,
        fault_nixl_lose_notifications=args.fault_nixl_lose_notifications, kv_store=store,
    )


def store_write_policy(choice: str, role: str) -> str:
    """``--kv-store-write auto``: write-through on a prefill worker (what it computes is what others will ask
    for), eviction on a decode worker (its blocks are written as they leave it)."""
    if choice != "auto":
        return choice
    return "through" if role == "prefill" else "evict"


async def serve(role: str, config: WorkerConfig, make_node: NodeFactory) -> int:
    redis = connect(config.redis_url)
    try:
        await check_credentials(redis, config.redis_url)  # a refused password stops the worker before loading
    finally:
        await redis.aclose()
    node = make_node(config)
    await node.start()
    print(f"{role} worker {node.worker_id} ready: grpc={node.grpc_address} kv={node.kv_uri} "
          f"loop={event_loop.loop_name()}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.create_task(event.wait()) for event in (stop, node.drained, node.failed)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    await node.stop()  # deregisters: the router stops routing here
    if node.drained.is_set():
        print(f"{role} worker {node.worker_id} drained: exiting", flush=True)
    if node.failed.is_set():
        print(f"{role} worker {node.worker_id}: its engine failed (the log says why): exiting", flush=True)
        return 1
    return 0


def run(role: str, argv: list[str], make_node: NodeFactory) -> int:
    cli = parser(role)
    args = cli.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")
    from proto.tracing import TracingConfig, setup_tracing

    try:
        setup_tracing(TracingConfig.from_env(os.environ, console=args.otel_console), f"baton-{role}",
                      protocol=os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
    except ValueError as exc:
        cli.error(str(exc))
    try:
        config = worker_config(role, args)
        if args.engine == "vllm":
            make_node = _vllm_node(role, argv, args)
    except ValueError as exc:  # TLS flags, engine settings
        cli.error(str(exc))
    logging.getLogger(__name__).info("redis %s, gRPC %s", redact_url(config.redis_url), tls.describe(config.tls))
    try:
        return event_loop.run(serve(role, config, make_node), use_uvloop=event_loop.wanted(args.uvloop, os.environ))
    except RedisCredentialsError as exc:
        print(f"baton {role}: error: {exc}", file=sys.stderr)
        return 1


def _vllm_node(role: str, argv: list[str], args: argparse.Namespace) -> NodeFactory:
    """``--engine vllm``: the vLLM node, run here when vLLM imports here, else this command again from vLLM's
    environment (``worker.vllm_engine.cli``; this process is replaced)."""
    python = vllm_cli.vllm_python()
    if python is not None:
        sys.stdout.flush()
        os.execv(python, [python, "-m", "deploy.cli", role, *argv])
    from worker.vllm_engine.node import VLLMNode, model_folder  # vLLM: only once the flags are good

    options = vllm_cli.vllm_options(args, str(model_folder(args.model)))
    return lambda config: VLLMNode(config, options)
