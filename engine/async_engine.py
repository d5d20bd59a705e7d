"""AsyncEngine: the synchronous engine loop in its own thread; asyncio callers talk to it by queues.

Servicers never run a forward pass on the event loop (TGI's fault, STYLE.md). Every change to the
engine's state happens on the engine thread, between steps: requests are added and aborted through
an inbox, and ``call(fn)`` runs any function there (lease release, KV reservation, stats).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from engine.core.outputs import RequestDelta
from engine.engine import Engine
from engine.errors import BatonError

logger = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.05


class StepHooks(Protocol):
    """Per-step hooks (a prefill worker's ``LayerwiseHooks``), all called on the engine thread."""

    @property
    def watching(self) -> bool: ...
    def on_scheduled(self, output: Any) -> None: ...
    def on_layer(self, layer: int) -> None: ...
    def step_ended(self, error: BaseException | None = None) -> None: ...


class EngineDead(BatonError):
    """The engine loop stopped (a bug or a device failure); requests fail with UNAVAILABLE."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: Engine, *, on_held: Callable[[RequestDelta], None] | None = None,
                 step_hooks: StepHooks | None = None, on_dead: Callable[[BaseException], None] | None = None) -> None:
        """``on_held`` runs on the engine thread for every delta that hands blocks over (a prefill
        request with ``hold_blocks``), whether or not anyone still listens, so no block is orphaned.
        ``step_hooks`` (layer-wise KV streaming) go to each step while they are ``watching``. ``on_dead`` runs
        on the engine thread once, if the loop fails (e.g. a tensor-parallel rank died): the shell stops then."""
        self.engine = engine
        self._on_held = on_held
        self._on_dead = on_dead
        self._hooks = step_hooks
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)

    # ---- asyncio side --------------------------------------------------------------------
    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; return its result here."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def job() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # handed to the awaiting caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._submit(job)
        return await future

    async def stream(self, request_id: str, add: Callable[[Engine], Any]) -> AsyncIterator[RequestDelta]:
        """Register ``request_id``'s output stream, run ``add(engine)`` (which queues the request) and
        yield its deltas until it finishes. Leaving early (cancellation, error) aborts the request."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        finished = False
        try:
            await self.call(add)
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._stopping and self._error is None:
                self._submit(lambda: self.engine.abort(request_id))

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    async def abort_found(self, request_id: str) -> bool:
        """Abort ``request_id`` now; whether it was live. Its stream, if one is open, gets the final (ABORT)
        delta and ends, as it would have by itself."""
        return await self.call(lambda _: self._abort(request_id))

    def submit(self, fn: Callable[[Engine], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread, fire and forget (errors are logged)."""
        def job() -> None:
            try:
                fn(self.engine)
            except Exception:  # noqa: BLE001 - nobody awaits this job
                logger.exception("engine job failed")

        self._submit(job)

    # ---- engine thread -------------------------------------------------------------------
    def _submit(self, job: Callable[[], None]) -> None:
        self._inbox.put(job)
        self._wake.set()

    def _abort(self, request_id: str) -> bool:
        delta = self.engine.abort(request_id)
        if delta is not None:
            self._dispatch([delta])
        return delta is not None

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                self.engine.check_healthy()  # a tensor-parallel rank that exited ends the loop, busy or idle
                if self.engine.has_unfinished():
                    self._dispatch(self._step())
                else:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop failed")
            self._error = exc
            self._fail_all(EngineDead(f"engine loop failed: {exc!r}"))
            if self._on_dead is not None:
                try:
                    self._on_dead(exc)
                except Exception:  # noqa: BLE001 - e.g. the shell's event loop already closed
                    logger.exception("on_dead failed")

    def _step(self) -> list[RequestDelta]:
        hooks = self._hooks
        if hooks is None or not hooks.watching:
            return self.engine.step()
        try:
            deltas = self.engine.step(on_scheduled=hooks.on_scheduled, on_layer=hooks.on_layer)
        except BaseException as exc:
            hooks.step_ended(exc)
            raise
        hooks.step_ended()
        return deltas

    def _drain_inbox(self) -> None:
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            job()

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            if delta.held_block_ids:
                if self._on_held is None:
                    self.engine.release_blocks(list(delta.held_block_ids))
                else:
                    self._on_held(delta)
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDead(f"engine loop failed: {self._error!r}")


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
