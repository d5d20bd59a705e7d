"""The router's gRPC shell: ``baton.v1.Generation`` and ``baton.v1.Admin``, health checking, reflection.

Servicer methods only convert and delegate: ``Frontend`` validates and tokenizes, ``Relay`` runs the
request across the workers. ``ErrorInterceptor`` is the one place typed errors become gRPC statuses.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import BatonError
from engine.gguf_file import GGUFFile
from engine.tokenizer import Tokenizer
from kv_transfer.registry import Registry, connect
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from proto import tracing
from proto.tls import TlsConfig, add_port, describe
from proto.malformed import MalformedRequestInterceptor
from proto.metrics_http import MetricsServer, serve_metrics
from router.admin.servicer import ADMIN_SERVICE, AdminServicer
from router.config import ModelCard, RouterConfig, resolve_max_model_len
from router.routing.books_sync import BooksSync
from router.routing.directory import WorkerDirectory, served_scheme
from router.routing.mirror_sync import MirrorSync
from router.errors import WorkerUnavailable, retry_metadata, status_for
from router.frontend import Frontend, ModelLimits
from router.metrics import RouterMetrics
from router.openai.http import HttpServer, OpenAIHandlers, serve_openai
from router.relay import Relay

log = logging.getLogger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps typed errors (router.errors.status_for) to statuses; anything else is a logged INTERNAL.

    With ``metrics``, each error status of a ``Generation`` call counts in ``baton:request_errors_total``.
    """

    def __init__(self, metrics: RouterMetrics | None = None) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        counted = details.method.startswith(f"/{GENERATION_SERVICE}/")
        metrics = self._metrics if counted else None
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _guarded(handler.unary_stream, details.method, metrics), handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            _guarded(handler.unary_unary, details.method, metrics), handler.request_deserializer,
            handler.response_serializer,
        )


def _guarded(behavior: Callable[..., Any], method: str, metrics: RouterMetrics | None = None) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for response in behavior(request, context):
                    yield response
            except Exception as exc:  # noqa: BLE001 - mapped, or logged as a bug
                await _abort(context, exc, method, metrics)
        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - mapped, or logged as a bug
            await _abort(context, exc, method, metrics)
    return unary


async def _abort(
    context: grpc.aio.ServicerContext, exc: Exception, method: str, metrics: RouterMetrics | None = None,
) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code = status_for(exc) if isinstance(exc, BatonError) else grpc.StatusCode.INTERNAL
    if metrics is not None:
        metrics.request_error(code.name)
    if isinstance(exc, BatonError):
        await context.abort(code, str(exc), trailing_metadata=retry_metadata(exc))
    log.exception("unexpected error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self, frontend: Frontend, relay: Relay, directory: WorkerDirectory, card: ModelCard, *,
        request_timeout_s: float,
    ) -> None:
        self._frontend, self._relay, self._directory, self._card = frontend, relay, directory, card
        self._request_timeout_s = request_timeout_s

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        job = self._frontend.prepare(request)
        parent = tracing.extract(context.invocation_metadata()) if self._relay.tracer is not None else None
        responses = self._relay.generate(job, self._deadline_s(context), parent)
        try:
            async for response in responses:
                await context.write(response)
        finally:  # also on cancellation: the relay's cleanup aborts the workers now, not at GC time
            await responses.aclose()

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(token_ids=self._frontend.tokenize(request))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        limits = self._frontend.limits
        response = pb.ModelInfoResponse(
            model=limits.name, architecture=self._card.architecture, max_model_len=limits.max_model_len,
            vocab_size=limits.vocab_size,
        )
        try:
            scheme = served_scheme((await self._directory.snapshot()).workers)
        except WorkerUnavailable:  # Redis unreachable: the model facts above still hold
            scheme = None
        if scheme is not None:
            response.block_size, response.model_fingerprint = scheme.block_size, scheme.fingerprint
        return response

    def _deadline_s(self, context: grpc.aio.ServicerContext) -> float:
        client_s = context.time_remaining()
        timeout_s = min(self._request_timeout_s, math.inf if client_s is None else client_s)
        return asyncio.get_running_loop().time() + timeout_s


@dataclass
class RunningRouter:
    """A started router server; ``stop`` shuts it down gracefully."""

    server: grpc.aio.Server
    port: int
    health: Any
    relay: Relay
    directory: WorkerDirectory
    redis: Any
    metrics_server: MetricsServer | None = None  # None: no /metrics endpoint
    http_server: HttpServer | None = None  # None: no OpenAI-compatible HTTP front
    books_sync: BooksSync | None = None  # None: this router does not share its books

    @property
    def metrics(self) -> RouterMetrics:
        return self.relay.metrics

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.http_server is not None:
            await self.http_server.stop()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await self.relay.control.drain(timeout_s=grace_s)
        if self.books_sync is not None:
            await self.books_sync.stop()
        if self.directory.mirror is not None:
            await self.directory.mirror.stop()
        await self.directory.close()
        await self.redis.aclose()


async def start_router(
    config: RouterConfig, *, tokenizer: Tokenizer | None = None, admin_token: str | None = None,
    metrics_port: int | None = None, http_port: int | None = None, tls: TlsConfig | None = None,
) -> RunningRouter:
    """Build and start the router (``config.port`` 0 binds a free port; see ``RunningRouter.port``).

    ``admin_token``: when set, ``baton.v1.Admin`` calls must carry ``authorization: Bearer <token>``.
    ``metrics_port``: serve Prometheus ``/metrics`` there on ``config.host`` (None or 0: not at all).
    ``http_port``: serve the OpenAI-compatible HTTP front there on ``config.host`` (None: not at all; 0: any
    free port, see ``RunningRouter.http_server.port``).
    ``tls``: serve gRPC, the HTTP front and ``/metrics`` over TLS (mTLS when it has a CA) and call the workers
    over TLS with the same certificate (None: plaintext everywhere).
    """
    gguf = GGUFFile(config.model_path) if config.model_path.is_file() else None  # its metadata, read once
    card = ModelCard.from_path(config.model_path, gguf)
    if tokenizer is None:
        tokenizer = Tokenizer.from_model(gguf or config.model_path)
    limits = ModelLimits(name=config.served_model_name, vocab_size=card.vocab_size,
                         max_model_len=resolve_max_model_len(config, card))
    redis = connect(config.redis_url)
    registry = Registry(redis, config.ns)
    mirror = MirrorSync(registry.index, max_entries=config.index_mirror_max_entries) if config.index_mirror else None
    if mirror is not None:
        mirror.start()  # lookups go to Redis until its first snapshot is in
    directory = WorkerDirectory(registry, ttl_s=config.worker_list_ttl_s,
                                channel_idle_s=config.request_timeout_s + 60.0, mirror=mirror, tls=tls)
    metrics = RouterMetrics()
    relay = Relay(directory, tokenizer, config.policy, decode_retries=config.decode_retries,
                  max_migrations=config.max_migrations,
                  control_rpc_timeout_s=config.control_rpc_timeout_s, metrics=metrics,
                  max_inflight_requests=config.max_inflight_requests, kv_layerwise=config.kv_layerwise,
                  preselect=config.preselect)
    books_sync = None
    if config.shared_books is not None:
        books_sync = BooksSync(redis, registry.keys, relay, lambda: directory.last_snapshot, config.shared_books)
        books_sync.start()
    frontend = Frontend(tokenizer, limits)
    servicer = GenerationServicer(frontend, relay, directory, card, request_timeout_s=config.request_timeout_s)
    server = grpc.aio.server(interceptors=[MalformedRequestInterceptor(), ErrorInterceptor(metrics)],
                             options=[("grpc.so_reuseport", int(config.reuse_port))])
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    pb_grpc.add_AdminServicer_to_server(AdminServicer(Registry(redis, config.ns), redis, token=admin_token,
                                                    planner_config=config.planner,
                                                    metrics_registry=metrics.registry, tls=tls,
                                                    policy=config.policy.policy), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = (GENERATION_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server)
    port = add_port(server, f"{config.host}:{config.port}", tls)
    await server.start()
    for service in ("", GENERATION_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("router serving %s on %s:%d (%s, max_model_len %d)", limits.name, config.host, port,
             describe(tls), limits.max_model_len)
    metrics_server = serve_metrics(metrics.registry, config.host, metrics_port, tls)
    http_server = await serve_openai(OpenAIHandlers(frontend, relay, request_timeout_s=config.request_timeout_s,
                                                    metrics_registry=metrics.registry),
                                     config.host, http_port, tls, reuse_port=config.reuse_port)
    return RunningRouter(server, port, health_servicer, relay, directory, redis, metrics_server, http_server,
                         books_sync)
