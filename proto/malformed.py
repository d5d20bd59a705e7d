"""Malformed request bytes get INVALID_ARGUMENT, not grpc's UNKNOWN.

grpc decodes a request before any servicer or error-mapping code runs, and a ``DecodeError`` there
surfaces as ``UNKNOWN``. This interceptor swaps each method's deserializer for one that turns corrupt
bytes into a marker, and wraps the behaviour so the marker ends the call with INVALID_ARGUMENT.
"""

from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError

_MALFORMED = object()
_BEHAVIOURS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        name = next(b for b in _BEHAVIOURS if getattr(handler, b) is not None)
        return handler._replace(
            request_deserializer=_safe(handler.request_deserializer),
            **{name: _guard(getattr(handler, name), handler.response_streaming)},
        )


def _safe(deserialize):
    def run(data: bytes):
        try:
            return deserialize(data)
        except (DecodeError, ValueError):
            return _MALFORMED

    return run


def _guard(behaviour, streaming: bool):
    message = "malformed request: the bytes are not a valid protobuf message of this method's type"
    if streaming:
        async def stream(request, context):
            if request is _MALFORMED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            async for response in stream_responses(behaviour(request, context)):
                yield response

        return stream

    async def unary(request, context):
        if request is _MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        return await behaviour(request, context)

    return unary


async def stream_responses(result):
    """The responses of a streaming behaviour's result: an async iterator, or a coroutine resolving to one (when
    another interceptor wrapped it), or None. For interceptors that wrap streaming calls."""
    if inspect.isawaitable(result):
        result = await result
    if result is not None:
        async for response in result:
            yield response
