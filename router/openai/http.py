"""The router's OpenAI-compatible HTTP shell (aiohttp): ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``.

Handlers only convert and delegate, like the gRPC servicer: ``openai_request.parse`` turns the JSON body
into a ``pb.GenerateRequest``, ``Frontend.prepare`` validates and tokenizes it into a ``Job``, and
``Relay.generate`` runs it, so both APIs answer alike. ``_error_response`` is the one place typed errors
become HTTP statuses (400 bad input, 429 over capacity, with ``Retry-After`` when the router's admission
limit refused it; 503 no worker, 504 deadline, 500 a bug). A stream reads its first response before it
sends headers, so routing errors still get their status; a failure later in a stream is sent as a last
``data: {"error": ...}`` event.

Every error a completions call answers (status or last stream event) counts once in the router's
``baton:request_errors_total{code}``, labelled like the gRPC front's: the status the same error gets there
(400 -> ``INVALID_ARGUMENT``, 429 -> ``RESOURCE_EXHAUSTED``, 503 -> ``UNAVAILABLE``, 504 ->
``DEADLINE_EXCEEDED``, 500 -> ``INTERNAL``), so one series counts a failure whichever API the client used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine.errors import CapacityExceeded, InvalidRequest
from proto import baton_pb2 as pb
from proto import tracing
from proto.tls import TlsConfig, describe, ssl_server_context
from router.errors import DeadlineExceeded, Overloaded, WorkerUnavailable, status_for
from router.frontend import Frontend, Job
from router.openai.logprobs import LogprobsBuilder
from router.openai.request import Endpoint, InvalidParam, OpenAIRequest, parse, parse_detokenize, parse_tokenize
from router.relay import Relay

log = logging.getLogger(__name__)

# Typed error -> (HTTP status, OpenAI error type).
_HTTP_STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (InvalidRequest, 400, "invalid_request_error"),
    (CapacityExceeded, 429, "capacity_exceeded"),
    (WorkerUnavailable, 503, "service_unavailable"),
    (DeadlineExceeded, 504, "timeout"),
)
_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
_OBJECTS = {Endpoint.COMPLETIONS: ("text_completion", "text_completion", "cmpl"),
            Endpoint.CHAT: ("chat.completion", "chat.completion.chunk", "chatcmpl")}


@dataclass
class _Outcome:
    """What a finished request's responses add up to."""

    pieces: list[str] = field(default_factory=list)  # the text, joined once at the end (not grown per token)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    logprobs: LogprobsBuilder | None = None  # None: the client asked for none


class OpenAIHandlers:
    def __init__(self, frontend: Frontend, relay: Relay, *, request_timeout_s: float,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        self._frontend, self._relay, self._request_timeout_s = frontend, relay, request_timeout_s
        self._created = int(time.time())
        self.metrics_registry = metrics_registry  # served on /metrics too, as vLLM's front serves it

    async def metrics(self, http: web.Request) -> web.Response:
        body = generate_latest(self.metrics_registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._serve(http, Endpoint.COMPLETIONS)

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        return await self._serve(http, Endpoint.CHAT)

    async def models(self, http: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, http: web.Request) -> web.Response:
        if http.match_info["model"] != self._frontend.limits.name:
            return _error_json(404, "invalid_request_error", f"model {http.match_info['model']!r} is not served here",
                               "model", "model_not_found")
        return web.json_response(self._model_card())

    async def tokenize(self, http: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: the ids generation would see for a prompt or a chat (its template applied)."""
        try:
            body = parse_tokenize(await _json_body(http))
            self._frontend.check_model(body.model)
            ids = self._frontend.tokenize(body.request)
        except Exception as exc:  # noqa: BLE001 - mapped, or logged as a bug
            return self._error_response(exc)
        tokenizer = self._frontend.tokenizer
        strs = [tokenizer.decode([i], skip_special_tokens=False) for i in ids] if body.token_strs else None
        return web.json_response({"count": len(ids), "max_model_len": self._frontend.limits.max_model_len,
                                  "tokens": ids, "token_strs": strs})

    async def detokenize(self, http: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: the text of a list of ids."""
        try:
            ids, model = parse_detokenize(await _json_body(http))
            self._frontend.check_model(model)
            return web.json_response({"prompt": self._frontend.detokenize(ids)})
        except Exception as exc:  # noqa: BLE001 - mapped, or logged as a bug
            return self._error_response(exc)

    def _model_card(self) -> dict[str, Any]:
        limits = self._frontend.limits
        return {"id": limits.name, "object": "model", "created": self._created, "owned_by": "baton",
                "max_model_len": limits.max_model_len}

    async def _serve(self, http: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        try:
            request = parse(endpoint, await _json_body(http), f"{_OBJECTS[endpoint][2]}-{uuid.uuid4().hex}")
            job = self._prepare(request)
            parent = tracing.extract(http.headers.items()) if self._relay.tracer is not None else None
            responses = self._relay.generate(job, asyncio.get_running_loop().time() + self._request_timeout_s, parent)
        except Exception as exc:  # noqa: BLE001 - mapped, or logged as a bug
            return self._error_response(exc)
        try:
            if request.stream:
                return await self._stream(http, request, job, responses)
            return await self._complete(request, job, responses)
        except ConnectionError:  # the client hung up mid-stream, a write found it gone before aiohttp cancelled
            return web.Response(status=499, reason="Client Closed Request")  # never sent: aiohttp finds the
            # transport closed and logs nothing (raised, it logged "Error handling request" with a traceback)
        except Exception as exc:  # noqa: BLE001 - mapped, or logged as a bug
            return self._error_response(exc)
        finally:  # also on cancellation: the relay's cleanup aborts the workers now
            await responses.aclose()

    def _prepare(self, request: OpenAIRequest) -> Job:
        job = self._frontend.prepare(request.generate)
        if request.endpoint is Endpoint.CHAT and not request.max_tokens_given:  # OpenAI: the rest of the context
            room = self._frontend.limits.max_model_len - len(job.prompt_token_ids)
            job = dataclasses.replace(job, params=dataclasses.replace(job.params, max_tokens=room))
        return job

    async def _complete(
        self, request: OpenAIRequest, job: Job, responses: AsyncIterator[pb.GenerateResponse],
    ) -> web.Response:
        outcome = self._outcome(request)
        async for response in responses:
            _accumulate(outcome, response)
        logprobs = outcome.logprobs.take() if outcome.logprobs is not None else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": outcome.finish_reason, "logprobs": logprobs}
        if request.endpoint is Endpoint.CHAT:
            choice["message"] = {"role": "assistant", "content": "".join(outcome.pieces)}
        else:
            choice["text"] = "".join(outcome.pieces)
        body = self._envelope(request, job, _OBJECTS[request.endpoint][0])
        return web.json_response({**body, "choices": [choice], "usage": outcome.usage})

    async def _stream(
        self, http: web.Request, request: OpenAIRequest, job: Job, responses: AsyncIterator[pb.GenerateResponse],
    ) -> web.StreamResponse:
        first = await anext(responses)  # routing errors surface here, before any header is sent
        sse = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await sse.prepare(http)
        outcome = self._outcome(request)
        if request.endpoint is Endpoint.CHAT:
            await _send(sse, self._chunk(request, job, {"role": "assistant", "content": ""}, None))
        try:
            await self._stream_from(sse, request, job, first, responses, outcome)
        except ConnectionError:
            raise
        except Exception as exc:  # noqa: BLE001 - headers are out: the error is the stream's last event
            self._count_error(exc)
            await _send(sse, _error_body(exc)[1])
        if request.include_usage and outcome.usage is not None:
            await _send(sse, {**self._envelope(request, job, _OBJECTS[request.endpoint][1]), "choices": [],
                              "usage": outcome.usage})
        await sse.write(b"data: [DONE]\n\n")
        await sse.write_eof()
        return sse

    async def _stream_from(
        self, sse: web.StreamResponse, request: OpenAIRequest, job: Job, first: pb.GenerateResponse,
        responses: AsyncIterator[pb.GenerateResponse], outcome: _Outcome,
    ) -> None:
        response: pb.GenerateResponse | None = first
        while response is not None:
            _accumulate(outcome, response)
            if response.text or outcome.finish_reason is not None:  # held-back tokens' logprobs wait for text
                pending = outcome.logprobs is not None and outcome.logprobs.has_pending
                logprobs = outcome.logprobs.take() if pending else None
                await _send(sse, self._chunk(request, job, response.text, outcome.finish_reason, logprobs))
            response = await anext(responses, None)

    def _outcome(self, request: OpenAIRequest) -> _Outcome:
        if request.logprobs is None:
            return _Outcome()
        return _Outcome(logprobs=LogprobsBuilder(self._frontend.tokenizer, chat=request.endpoint is Endpoint.CHAT))

    def _chunk(
        self, request: OpenAIRequest, job: Job, text: str | dict[str, str], finish: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict:
        if request.endpoint is Endpoint.CHAT:
            delta = text if isinstance(text, dict) else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return {**self._envelope(request, job, _OBJECTS[request.endpoint][1]), "choices": [choice]}

    def _error_response(self, exc: Exception) -> web.Response:
        self._count_error(exc)
        return _error_response(exc)

    def _count_error(self, exc: Exception) -> None:
        self._relay.metrics.request_error(status_for(exc).name)

    def _envelope(self, request: OpenAIRequest, job: Job, kind: str) -> dict[str, Any]:
        return {"id": job.request_id, "object": kind, "created": int(time.time()),
                "model": self._frontend.limits.name}


def _accumulate(outcome: _Outcome, response: pb.GenerateResponse) -> None:
    if response.text:
        outcome.pieces.append(response.text)
    if outcome.logprobs is not None and response.token_ids:
        outcome.logprobs.add(response.token_ids, response.logprobs)
    if response.finish_reason:
        outcome.finish_reason = _FINISH_REASONS.get(response.finish_reason, "stop")
    if response.HasField("usage"):
        usage = response.usage
        outcome.usage = {
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        }


async def _json_body(http: web.Request) -> object:
    try:
        return json.loads(await http.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidParam(None, f"the request body is not valid JSON: {exc}") from exc


async def _send(sse: web.StreamResponse, payload: dict[str, Any]) -> None:
    await sse.write(f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode())


def _error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    for kind, status, error_type in _HTTP_STATUS:
        if isinstance(exc, kind):
            param = exc.param if isinstance(exc, InvalidParam) else None
            return status, _error_payload(error_type, str(exc), param, None)
    log.exception("unexpected error in the OpenAI front", exc_info=exc)
    return 500, _error_payload("internal_error", f"internal error: {exc!r}", None, None)


def _error_payload(error_type: str, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _error_json(status: int, error_type: str, message: str, param: str | None, code: str | None) -> web.Response:
    return web.json_response(_error_payload(error_type, message, param, code), status=status)


def _error_response(exc: Exception) -> web.Response:
    status, body = _error_body(exc)
    return web.json_response(body, status=status, headers=_retry_headers(exc))


def _retry_headers(exc: Exception) -> dict[str, str] | None:
    """``Retry-After`` (whole seconds, at least 1) on a refusal by the router's admission limit."""
    if not isinstance(exc, Overloaded):
        return None
    return {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}


def build_app(handlers: OpenAIHandlers) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model}", handlers.model)
    app.router.add_post("/tokenize", handlers.tokenize)  # where vLLM serves them: no /v1 prefix
    app.router.add_post("/detokenize", handlers.detokenize)
    if handlers.metrics_registry is not None:
        app.router.add_get("/metrics", handlers.metrics)
    return app


@dataclass
class HttpServer:
    """A started HTTP front; ``port`` is the bound one (a request for port 0 gets a free port)."""

    runner: web.AppRunner
    port: int

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_openai(handlers: OpenAIHandlers, host: str, port: int | None,
                       tls: TlsConfig | None = None, *, reuse_port: bool = False) -> HttpServer | None:
    """Start the OpenAI front on ``host:port`` (None: not at all; 0: any free port); HTTPS with ``tls``, and
    with its CA every client must present a certificate that CA signed (mTLS)."""
    if port is None:
        return None
    # handler_cancellation: a client that hangs up cancels its handler, so the relay aborts the workers
    runner = web.AppRunner(build_app(handlers), handler_cancellation=True, access_log=None)
    await runner.setup()
    # reuse_port: several router processes serve one port (`baton router --processes N`); the kernel hands each
    # connection to one of them. Off, a port another process holds is an error.
    site = web.TCPSite(runner, host, port, ssl_context=None if tls is None else ssl_server_context(tls),
                       reuse_port=reuse_port)
    await site.start()
    bound = runner.addresses[0][1]
    log.info("OpenAI-compatible HTTP front on %s://%s:%d (%s)", "http" if tls is None else "https", host, bound,
             describe(tls))
    return HttpServer(runner, bound)
