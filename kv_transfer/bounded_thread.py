"""One thread of its own for a blocking native client (the store's), every call awaited at most a deadline.

A call that overruns its deadline raises ``CallTimeout`` to its awaiter at once; the thread itself cannot be
interrupted, so it stays busy until the native call returns by itself. While it does, the thread refuses new
calls at once (``ThreadStuck``) instead of queueing them behind it: nothing waits longer than one deadline, and
the client comes back by itself when the stuck call ends. A call whose awaiter gave up before it started is
skipped. Memory a call reads or writes must stay reserved until the call has really ended, which may be after
its awaiter gave up: ``call(..., ended=...)`` runs ``ended()`` on the event loop then (ran, failed or skipped).
The thread is a daemon: a call stuck at exit never holds the process (``concurrent.futures`` joins its threads
at exit).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kv_transfer.errors import KVTransferError

T = TypeVar("T")


class CallTimeout(KVTransferError):
    """A call did not end within its deadline (it may still be running on the thread)."""


class ThreadStuck(KVTransferError):
    """An earlier call overran its deadline and is still running: this one was refused without waiting."""


class BoundedThread:
    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._running_since: float | None = None  # monotonic start of the call on the thread, None when idle
        self._overran = False  # the running call outlived its deadline
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def stuck_s(self) -> float:
        """How long a call that overran its deadline has been running (0: none)."""
        since = self._running_since
        return time.monotonic() - since if self._overran and since is not None else 0.0

    async def call(self, fn: Callable[[], T], timeout_s: float, *, ended: Callable[[], None] | None = None) -> T:
        """``fn()`` on the thread; its result, or ``CallTimeout`` after ``timeout_s`` (queueing included).
        ``ended()`` runs on this event loop once ``fn`` has returned or raised, or was skipped, or refused."""
        if self.stuck_s:
            if ended is not None:
                ended()
            raise ThreadStuck(f"an earlier call has been running for {self.stuck_s:.1f} s past its deadline")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        abandoned = threading.Event()

        def job() -> None:
            result, error = None, None
            try:
                if abandoned.is_set():
                    raise CallTimeout("skipped: its awaiter gave up before it started")
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiter
                error = exc
            self._running_since, self._overran = None, False  # idle before ``ended`` runs: it may look
            try:
                loop.call_soon_threadsafe(_settle, future, result, error, ended)
            except RuntimeError:  # the loop closed meanwhile: nobody is left to tell
                pass

        self._jobs.put(job)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            abandoned.set()
            future.add_done_callback(_retrieve)  # nobody awaits its outcome now: an unretrieved exception would
            # be logged from the future's finalizer, at any allocation (in 3.11, inside ast.parse: a SystemError)
            if self._running_since is not None:
                self._overran = True
            raise CallTimeout(f"no answer within {timeout_s:.1f} s") from None

    def close(self) -> None:
        """Stop the thread after the calls queued so far (a stuck one is left behind: the thread is a daemon)."""
        self._jobs.put(None)

    def join(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the thread to end; whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._running_since = time.monotonic()
            try:
                job()
            finally:
                self._running_since, self._overran = None, False


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None,
            ended: Callable[[], None] | None) -> None:
    if ended is not None:
        ended()
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
