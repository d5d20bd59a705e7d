"""Token coalescing: a decode worker's stream read as fast as it comes, handed to the relay in batches.

The relay (``router.relay``) turns each ``Worker/Decode`` response into one client response, and the client's
front (gRPC ``context.write``, the OpenAI front's SSE write) asks for the next one only once its last write is
done. Read straight from the call, a client slower than the stream (a slow reader, a full socket, or a router
too busy to keep up) costs one message per token all the same, each one detokenized, serialized and written on
its own. ``coalesced`` reads the call in a task of its own instead: whatever arrived while the relay's last
response was being written comes out as one batch, which the relay sends as one client message (the tokens in
order, their text in one piece): fewer writes exactly when the router or the client is behind. A client that
keeps up still gets one message per decode response. vLLM's output collector merges deltas a slow consumer
has not taken the same way (``RequestOutputCollector.put``).

The queue is bounded: past ``max_pending`` unread responses the reader stops reading, and gRPC flow control
holds the worker back as it did without coalescing. The worker's stream never ends early because of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from engine.text_stream import TextStream
from proto import baton_pb2 as pb

DEFAULT_MAX_PENDING = 256  # unread decode responses per request (each ~100 B): a batch is at most this many


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Decode responses that arrived while the relay was busy, in order (one, when it keeps up)."""

    responses: list[pb.DecodeResponse]

    @property
    def token_ids(self) -> list[int]:
        if len(self.responses) == 1:
            return list(self.responses[0].token_ids)
        return [t for response in self.responses for t in response.token_ids]

    @property
    def logprobs(self) -> list[pb.Logprobs]:
        return [lp for response in self.responses for lp in response.logprobs]

    @property
    def finish_reason(self) -> int:
        """The worker's finish reason (the stream's last response carries it), or 0 while it runs."""
        return self.responses[-1].finish_reason


class _Reader:
    """Drains ``call`` into ``pending`` from a task of its own; an error ends the reading and waits there."""

    def __init__(self, call: Any, max_pending: int) -> None:
        self.pending: list[pb.DecodeResponse] = []
        self.error: BaseException | None = None
        self.done = False
        self.ready, self.room = asyncio.Event(), asyncio.Event()
        self._call, self._max_pending = call, max_pending
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for response in self._call:
                self.pending.append(response)
                self.ready.set()
                if len(self.pending) >= self._max_pending:  # bounded: stop reading until the relay takes them
                    self.room.clear()
                    await self.room.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the relay, after the responses before it
            self.error = exc
        finally:
            self.done = True
            self.ready.set()

    def take(self) -> list[pb.DecodeResponse]:
        batch, self.pending = self.pending, []
        self.ready.clear()
        self.room.set()
        return batch


async def coalesced(call: Any, max_pending: int = DEFAULT_MAX_PENDING) -> AsyncIterator[DecodeBatch]:
    """``call``'s responses in batches: each batch is everything that arrived since the last one was taken.
    The call's error (``grpc.aio.AioRpcError``, ...) is raised after the responses that came before it."""
    reader = _Reader(call, max_pending)
    try:
        while True:
            if not reader.pending and not reader.done:
                await reader.ready.wait()
            if reader.pending:
                yield DecodeBatch(reader.take())
            elif reader.error is not None:
                raise reader.error
            elif reader.done:
                return
    finally:
        reader.task.cancel()


def take_text(text: TextStream, token_ids: Sequence[int], *, has_stops: bool) -> tuple[int, str, bool]:
    """Feed a batch's tokens to ``text``: (how many count as output, their text, whether a stop string matched).

    With stop strings, the tokens go in one at a time and the output ends at the token that completed the stop,
    as it would have one message per token; without, the batch is detokenized in one step."""
    if not has_stops or len(token_ids) == 1:
        piece = text.add(token_ids)
        return len(token_ids), piece.text, piece.stopped
    pieces = []
    for taken, token in enumerate(token_ids, start=1):
        piece = text.add([token])
        pieces.append(piece.text)
        if piece.stopped:
            return taken, "".join(pieces), True
    return len(token_ids), "".join(pieces), False
