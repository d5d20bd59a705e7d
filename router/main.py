"""``baton router``: the public Generate API over the registered prefill and decode workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from engine.errors import BatonError, ModelLoadError
from engine.model_source import resolve_model
from kv_transfer.registry import check_credentials, connect, redact_url, with_ca
from proto import event_loop, tls
from router.config import DEFAULT_MAX_MIGRATIONS, DEFAULT_PORT, RouterConfig
from router.routing.cost_model import CostConfig
from router.admin.planner import PlannerConfig
from router.routing.mirror_sync import DEFAULT_MIRROR_MAX_ENTRIES
from router.routing.policy import POLICIES, PolicyConfig
from router.routing.preselect import PreselectConfig
from router.processes import start_siblings, stop_siblings
from router.routing.shared_books import SharedBooksConfig
from router.server import start_router

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9450  # deploy/spec.py METRICS_PORT; 9400 is dcgm-exporter's, on every GPU node
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible HTTP front (vLLM's port); 0 turns it off


def add_routing_options(group) -> None:
    """The routing and serving options, defined once: ``baton router`` and ``baton up`` (which passes them on)
    take them from here."""
    group.add_argument("--disagg-threshold-tokens", type=int, default=PolicyConfig().disagg_threshold_tokens,
                       help="uncached prompt tokens at or below this prefill on the decode worker "
                       "(default: %(default)s)")
    group.add_argument("--max-queued-prefill-tokens", type=int, default=None,
                       help="prefill workers queueing more tokens count as saturated (default: no limit)")
    group.add_argument("--policy", choices=POLICIES, default=PolicyConfig().policy,
                       help="routing policy: the cost model, or a baseline for benchmarks (default: %(default)s)")
    group.add_argument("--planner-max-workers", type=int, default=PlannerConfig().max_workers,
                       help="the most workers per pool `baton admin plan` may ask for (default: %(default)s)")
    group.add_argument("--planner-down-cooldown-s", type=float, default=PlannerConfig().down_cooldown_s,
                       help="after any pool change, wait this long before the planner shrinks a pool "
                       "(default: %(default)s)")
    group.add_argument("--kv-layerwise", action="store_true",
                       help="remote prefills stream the KV to the decode worker layer by layer while the prefill "
                       "worker computes it (tcp data plane), instead of after the prefill")
    group.add_argument("--index-mirror", action=argparse.BooleanOptionalAction, default=True,
                       help="mirror the KV block index in memory from its per-worker event streams "
                       "({ns}:events:{id}): routing reads no Redis per request, and every router replaying "
                       "the streams agrees (default: on; --no-index-mirror asks Redis per request)")
    group.add_argument("--index-mirror-max-entries", type=int, default=DEFAULT_MIRROR_MAX_ENTRIES,
                       help="past this many (block, worker) entries the mirror is dropped and lookups go to Redis "
                       "(~150 B each in memory; default: %(default)s)")
    group.add_argument("--preselect-above", type=int, default=PreselectConfig().above,
                       help="with more served workers than this, price only the prefix holders, the least loaded "
                       "and a few sampled per role, not everyone (default: %(default)s)")
    group.add_argument("--shared-books", action=argparse.BooleanOptionalAction, default=True,
                       help="publish this router's in-flight books (streams, prompts to compute, prefixes being "
                       "computed) in Redis and price the other routers' beside them, so several routers in front "
                       "of the same workers do not pile a burst onto one (default: on; one router alone reads "
                       "nothing and writes only while it has requests in flight)")
    group.add_argument("--shared-books-period-s", type=float, default=SharedBooksConfig().period_s,
                       help="publish and read the routers' books this often (default: %(default)s)")
    group.add_argument("--router-id", default=None,
                       help="this router's id in the shared books (default: host, pid and a random suffix)")
    group.add_argument("--router-temperature", type=float, default=0.0,
                       help="softmax temperature in seconds over the cost policy's per-worker costs; "
                       "0 picks the cheapest (default: %(default)s)")
    group.add_argument("--itl-target-ms", type=float, default=CostConfig().itl_target_s * 1e3,
                       help="the cost policy prefills remotely rather than push a decode worker's step time "
                       "past this (default: %(default)s)")
    group.add_argument("--ttft-target-ms", type=float, default=CostConfig().ttft_target_s * 1e3,
                       help="...unless the remote prefill's predicted TTFT is past this and it costs more "
                       "(default: %(default)s)")
    group.add_argument("--expected-output-tokens", type=int, default=CostConfig().expected_output_tokens,
                       help="decode steps the cost policy prices a request for: its max_tokens - 1, at most "
                       "this, and this when it sets none (default: %(default)s)")
    group.add_argument("--interference-weight", type=float, default=CostConfig().interference_weight,
                       help="cost per second a local prefill stalls each of the decode worker's running "
                       "sequences; 1 weighs their delay like the request's own (default: %(default)s)")
    group.add_argument("--no-prefix-import", dest="prefix_import", action="store_false",
                       help="never have a decode worker pull a cached prefix from another worker (Worker/"
                       "LeasePrefix) instead of recomputing it; the cost policy imports when the pull is cheaper")
    group.add_argument("--max-inflight-requests", type=int, default=None,
                       help="admission limit: requests past this many in flight on this router get "
                       "RESOURCE_EXHAUSTED (HTTP 429) with a retry hint, instead of queueing (default: no limit)")
    group.add_argument("--max-migrations", type=int, default=DEFAULT_MAX_MIGRATIONS,
                       help="a request whose decode worker fails after tokens were streamed moves to another decode "
                       "worker (prompt + those tokens, the same seed: the stream goes on exactly) at most this many "
                       "times; 0: the client gets UNAVAILABLE (default: %(default)s)")
    group.add_argument("--request-timeout-s", type=float, default=600.0,
                       help="deadline of requests whose client sets none shorter (default: %(default)s)")
    group.add_argument("--admin-token", default=os.environ.get("BATON_ADMIN_TOKEN") or None,
                       help="require `authorization: Bearer TOKEN` on baton.v1.Admin calls "
                       "(default: $BATON_ADMIN_TOKEN; unset: the admin API is open)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton router",
        description="Serve baton.v1.Generation: route each request to a decode worker, prefilling on a "
        "prefill worker when the uncached prompt is long. Workers are discovered through Redis.",
    )
    parser.add_argument("--redis-url", default=os.environ.get("BATON_REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="Redis holding the worker registry and KV index: redis://[:PASSWORD@]HOST:PORT/DB, "
                        "or rediss://... for TLS (a password is safer in $BATON_REDIS_URL than on the command "
                        "line; default: $BATON_REDIS_URL or %(default)s)")
    parser.add_argument("--model", default=None,
                        help="what the workers serve: a Hugging Face checkpoint folder (tokenizer + config.json), a "
                        ".gguf file (tokenizer and chat template from its metadata), or a name: tiny, small, smollm2 "
                        "(default: tiny, which `baton model tiny` builds)")
    parser.add_argument("--model-name", default=None,
                        help="name clients may send as `model` (default: the name given to --model, the folder's "
                        "name or the file's stem)")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="gRPC port (default: %(default)s; 0: any free port)")
    parser.add_argument("--processes", type=int, default=1,
                        help="router processes serving --port (and --http-port) together through SO_REUSEPORT, each "
                        "on its own core; the kernel hands each client connection to one of them; process i serves "
                        "/metrics on --metrics-port + i (default: %(default)s)")
    parser.add_argument("--reuse-port", action="store_true",
                        help="share --port and --http-port with other router processes (SO_REUSEPORT; --processes "
                        "sets it). Without it a port another process listens on is an error at start")
    parser.add_argument("--ns", "--namespace", dest="ns", default="baton", help="Redis key namespace (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    add_routing_options(parser.add_argument_group("routing and serving (`baton up` passes these to its router)"))
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                        help="serve Prometheus /metrics on this port, over HTTPS with --tls-cert (default: "
                        "%(default)s; 0: no endpoint; the OpenAI front's port serves /metrics too, as vLLM's does)")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) on this port, over HTTPS with --tls-cert (default: %(default)s; 0: off)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    parser.add_argument("--otel-console", action="store_true",
                        help="print OpenTelemetry trace spans on stderr (also $BATON_OTEL_CONSOLE=1; OTLP export: "
                        "the standard OTEL_* variables, see proto/tracing.py)")
    tls.add_arguments(parser)
    event_loop.add_argument(parser)
    return parser


def tls_from_args(args: argparse.Namespace) -> tls.TlsConfig | None:
    """The router serves with it and calls the workers with it; a server needs a certificate."""
    config = tls.from_args(args)
    if config is not None:
        config.require_server_identity()
    return config


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ModelLoadError when --model names nothing that exists."""
    source = resolve_model(args.model, build=False)  # torch-free: a preset is only its cache folder here
    return RouterConfig(
        model_path=source.path, model_name=args.model_name or source.name,
        redis_url=with_ca(args.redis_url, os.environ.get("BATON_REDIS_CA")),
        ns=args.ns, host=args.host, port=args.port, reuse_port=args.reuse_port or args.processes > 1,
        max_model_len=args.max_model_len,
        request_timeout_s=args.request_timeout_s, index_mirror=args.index_mirror,
        index_mirror_max_entries=args.index_mirror_max_entries, kv_layerwise=args.kv_layerwise,
        preselect=PreselectConfig(above=args.preselect_above),
        shared_books=SharedBooksConfig(period_s=args.shared_books_period_s, router_id=args.router_id)
        if args.shared_books else None,
        max_inflight_requests=args.max_inflight_requests, max_migrations=args.max_migrations,
        planner=PlannerConfig(max_workers=args.planner_max_workers, down_cooldown_s=args.planner_down_cooldown_s),
        policy=PolicyConfig(disagg_threshold_tokens=args.disagg_threshold_tokens,
                            max_queued_prefill_tokens=args.max_queued_prefill_tokens, policy=args.policy,
                            cost=CostConfig(temperature_s=args.router_temperature,
                                            itl_target_s=args.itl_target_ms / 1e3,
                                            ttft_target_s=args.ttft_target_ms / 1e3,
                                            expected_output_tokens=args.expected_output_tokens,
                                            interference_weight=args.interference_weight,
                                            kv_layerwise=args.kv_layerwise,
                                            prefix_import=args.prefix_import)),
    )


async def serve(
    config: RouterConfig, *, admin_token: str | None = None, metrics_port: int | None = None,
    http_port: int | None = None, tls_config: tls.TlsConfig | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully. A Redis refusing the credentials stops it at once."""
    redis = connect(config.redis_url)
    try:
        await check_credentials(redis, config.redis_url)
    finally:
        await redis.aclose()
    router = await start_router(config, admin_token=admin_token, metrics_port=metrics_port, http_port=http_port,
                                tls=tls_config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http = f", OpenAI HTTP on port {router.http_server.port}" if router.http_server else ""
    print(f"baton router listening on {config.host}:{router.port} ({tls.describe(tls_config)}){http} "
          f"(redis {redact_url(config.redis_url)}, {event_loop.loop_name()})", flush=True)
    await stop.wait()
    log.info("stopping router (grace %.1f s)", config.shutdown_grace_s)
    await router.stop(config.shutdown_grace_s)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.processes < 1 or (args.processes > 1 and args.port == 0):
        parser.error("--processes must be at least 1, and more than 1 needs a fixed --port (they share it)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        tls_config = tls_from_args(args)
    except (ValueError, ModelLoadError) as exc:  # TlsConfigError too
        parser.error(str(exc))
    if not config.model_path.is_file() and not (config.model_path / "tokenizer.json").is_file():
        parser.error(f"--model {config.model_path}: no tokenizer.json there (build one with `baton model tiny`)")
    from proto.tracing import TracingConfig, setup_tracing

    try:
        setup_tracing(TracingConfig.from_env(os.environ, console=args.otel_console), "baton-router",
                      protocol=os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
    except ValueError as exc:
        parser.error(str(exc))
    siblings = start_siblings(argv, args.processes, args.metrics_port) if args.processes > 1 else []
    try:
        http_port = args.http_port or None  # 0: off
        event_loop.run(serve(config, admin_token=args.admin_token, metrics_port=args.metrics_port, http_port=http_port,
                             tls_config=tls_config), use_uvloop=event_loop.wanted(args.uvloop, os.environ))
    except (BatonError, OSError, RuntimeError, ValueError) as exc:  # bad model folder, port taken, Redis refused, ...
        print(f"baton router: error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_siblings(siblings, config.shutdown_grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
