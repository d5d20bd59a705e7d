"""The ``ucx://`` transport's plumbing over ucxx (``kv_transfer/ucx.py``): importing ucxx with Baton's UCX
settings, ``wire`` frames as tagged messages on an endpoint, waits bounded by timeouts, aborting and closing
endpoints, and the idle endpoints a client keeps between pulls (per event loop and URI).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import weakref
from collections.abc import Awaitable, Sequence
from typing import Any

from kv_transfer.errors import KVTransferError
from kv_transfer.wire import HEADER, Frame, decode_header

INSTALL_HINT = "ucx transport needs the ucxx package: pip install ucxx-cu12==0.52.0"
# Set before ucxx is imported, unless the user set them: with UCX's defaults over loopback TCP ucxx moves
# ~0.65 GB/s; with both segment sizes ~3-4 GB/s (either alone ~1.35 GB/s). Blocking progress drives UCX
# from the event loop (its epoll fd) instead of a progress thread competing for the GIL. REUSEADDR is
# SO_REUSEADDR on the listener, as tcp:// sets it: without it a port whose connections the server closed
# stays "busy" for the kernel's TIME_WAIT (60 s), so a restarted worker could not listen on its port.
ENV_DEFAULTS = {
    "UCX_TCP_TX_SEG_SIZE": "256K",
    "UCX_TCP_RX_SEG_SIZE": "256K",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_TCP_CM_REUSEADDR": "y",
}
# Both ends must agree; error handling makes a vanished peer an error instead of a hang or an abort.
ENDPOINT_ERROR_HANDLING = True

TAG_REQUEST, TAG_REPLY, TAG_DONE, TAG_KV = 1, 3, 5, 16  # a frame uses tags t and t + 1; KV message i: 16 + i
SEQ_SHIFT = 32  # the n-th pull on an endpoint offsets its tags by n << SEQ_SHIFT
POOL_IDLE_S = 30.0  # an idle pooled endpoint older than this is closed, not reused (< ucx.SERVER_IDLE_S)
POOL_MAX_PER_URI = 8


def import_ucxx() -> Any:
    """The ``ucxx`` module, imported with Baton's UCX environment defaults (those the user did not set)."""
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        import ucxx
    except (ImportError, OSError) as exc:
        raise KVTransferError(INSTALL_HINT) from exc
    return ucxx


def ucxx_available() -> bool:
    try:
        import_ucxx()
    except KVTransferError:
        return False
    return True


# --- messages -------------------------------------------------------------------------------------


def _wrap(exc: BaseException, what: str) -> KVTransferError:
    if isinstance(exc, KVTransferError):
        return exc
    if isinstance(exc, asyncio.TimeoutError):
        return KVTransferError(f"{what}: timed out")
    return KVTransferError(f"{what}: {type(exc).__name__}: {exc}")


class PeerSilent(KVTransferError):
    """A wait on the peer timed out (as opposed to the connection failing)."""


async def bounded(aw: Awaitable, timeout_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except asyncio.TimeoutError:
        raise PeerSilent(f"{what}: peer silent for {timeout_s:g} s") from None
    except (KVTransferError, asyncio.CancelledError):
        raise
    except Exception as exc:  # ucxx's UCXError family, closed endpoints, ...
        raise _wrap(exc, what) from exc


async def await_all(
    aws: Sequence[Awaitable], timeout_s: float, what: str, sizes: Sequence[int] | None = None, budget: int = 0
) -> list[Any]:
    """Await every one; fail on the first error, or if none completes for ``timeout_s`` (a stalled stream).
    With ``sizes``, start them in order, only as many at a time as fit in ``budget`` bytes (at least one)."""
    results: list[Any] = [None] * len(aws)
    running: dict[asyncio.Future, int] = {}
    started, in_flight = 0, 0
    try:
        while started < len(aws) or running:
            while started < len(aws) and (
                sizes is None or not running or in_flight + sizes[started] <= budget
            ):
                running[asyncio.ensure_future(aws[started])] = started
                in_flight += 0 if sizes is None else sizes[started]
                started += 1
            done, _ = await asyncio.wait(running, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                pending = len(aws) - started + len(running)
                raise PeerSilent(f"{what}: peer silent for {timeout_s:g} s ({pending} messages pending)")
            for task in done:
                index = running.pop(task)
                in_flight -= 0 if sizes is None else sizes[index]
                if (exc := task.exception()) is not None:
                    raise _wrap(exc, what) from exc
                results[index] = task.result()
        return results
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for aw in aws[started:]:  # never started: no request was posted for it
            if asyncio.iscoroutine(aw):
                aw.close()


async def send_frame(ep: Any, tag: int, frame: bytes) -> None:
    await ep.send(frame[: HEADER.size], tag=tag)
    if len(frame) > HEADER.size:
        await ep.send(frame[HEADER.size :], tag=tag + 1)


async def recv_frame(ep: Any, tag: int, what: str) -> Frame:
    header = bytearray(HEADER.size)
    await ep.recv(header, tag=tag)
    kind, code, length = decode_header(bytes(header), what)
    payload = bytearray(length)
    if length:
        await ep.recv(payload, tag=tag + 1)
    return Frame(kind, code, bytes(payload))


def tag(seq: int, base: int) -> int:
    """Tag ``base`` of an endpoint's ``seq``-th pull."""
    return (seq << SEQ_SHIFT) + base


def abort(ep: Any) -> None:
    """Close ``ep`` now, without waiting for the peer; cancels (and completes) its outstanding requests."""
    if ep is None:
        return
    with contextlib.suppress(Exception):
        ep.abort()


async def close(ep: Any) -> None:
    """Close after a pull; a peer that reset the connection must not make this hang (abort is local)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ep.close(), 1.0)
    abort(ep)


# --- idle endpoints kept between pulls (``UcxClient(reuse_endpoints=True)``) ------------------------

# event loop -> URI -> [(endpoint, next request seq, idle since)]; ucxx endpoints are driven by one loop.
_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, list[tuple[Any, int, float]]]] = (
    weakref.WeakKeyDictionary()
)


def checkout(uri: str) -> tuple[Any, int] | None:
    for loop in [loop for loop in _pools if loop.is_closed()]:  # pools of finished loops: close them
        for entries in _pools.pop(loop).values():
            for ep, _, _ in entries:
                abort(ep)
    entries = _pools.setdefault(asyncio.get_running_loop(), {}).get(uri, [])
    now = time.monotonic()
    while entries:
        ep, seq, since = entries.pop()
        if not ep.closed and now - since < POOL_IDLE_S:
            return ep, seq
        abort(ep)
    return None


def checkin(uri: str, ep: Any, seq: int) -> None:
    entries = _pools.setdefault(asyncio.get_running_loop(), {}).setdefault(uri, [])
    if len(entries) >= POOL_MAX_PER_URI or ep.closed:
        abort(ep)
        return
    entries.append((ep, seq, time.monotonic()))


def close_idle_endpoints() -> None:
    """Close every pooled endpoint (of every event loop)."""
    for pools in list(_pools.values()):
        for entries in pools.values():
            for ep, _, _ in entries:
                abort(ep)
            entries.clear()
