"""Layer-wise KV progress: how many of a prompt's layers are computed, for streaming reads.

The prefill engine writes a prompt's KV one decoder layer at a time (``engine.runner.LayerHook``). A
``LayerProgress`` per lease counts the layers that are complete; the engine thread advances it
(``complete``), and a transport server on the event loop awaits it (``wait``), so it can send layer l's
blocks while layer l+1 computes (wire order is layer-major: see ``kv_transfer/layout.py``).

Layers complete in order. On CUDA a layer's kernels may still be running when the hook fires: pass the
layer's ``ready`` probe (a recorded ``torch.cuda.Event``'s ``query``); ``wait`` polls it before it returns.
Every wait is bounded: a layer that does not complete in time, or a progress that ``fail``s, raises
``KVTransferError``. Thread-safe; no torch, no I/O.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from kv_transfer.errors import KVTransferError

ReadyProbe = Callable[[], bool]  # True once the layer's device work is done (CUDA event ``query``)
ProgressLookup = Callable[[str], "LayerProgress | None"]  # lease id -> its progress, None: fully computed

READY_POLL_S = 0.0002  # between polls of a ``ready`` probe (device work lags the hook by microseconds)


class LayerProgress:
    """``num_complete`` of ``num_layers`` layers are computed; awaitable from any event loop."""

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._num_complete = 0
        self._probes: list[ReadyProbe | None] = []
        self._error: str | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def num_complete(self) -> int:
        return self._num_complete

    @property
    def is_complete(self) -> bool:
        return self._num_complete == self.num_layers

    @property
    def is_ready(self) -> bool:
        """Every layer is complete and its device work done: a read has nothing left to wait for."""
        with self._lock:
            if self._error is not None or self._num_complete < self.num_layers:
                return False
            probe = _last_probe(self._probes)
        return probe is None or probe()

    def complete(self, layer_index: int, ready: ReadyProbe | None = None) -> None:
        """Layer ``layer_index`` is computed (call from any thread; layers in order, each once)."""
        with self._lock:
            if layer_index != self._num_complete:
                raise ValueError(f"layer {layer_index} completed out of order ({self._num_complete} done)")
            self._probes.append(ready)
            self._num_complete += 1
            waiters, self._waiters = self._waiters, []
        _wake_all(waiters)

    def complete_all(self) -> None:
        """Mark every remaining layer computed (e.g. the prompt was prefilled without a hook)."""
        with self._lock:
            self._probes.extend([None] * (self.num_layers - self._num_complete))
            self._num_complete = self.num_layers
            waiters, self._waiters = self._waiters, []
        _wake_all(waiters)

    def fail(self, reason: str) -> None:
        """The layers will never complete (request aborted, step failed): every wait raises now."""
        with self._lock:
            self._error = reason
            waiters, self._waiters = self._waiters, []
        _wake_all(waiters)

    async def wait(self, num_layers: int, timeout_s: float) -> None:
        """Return once the first ``num_layers`` layers are complete (and ready); KVTransferError if that
        takes longer than ``timeout_s`` or the progress failed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (probe := self._probe_when_complete(loop, num_layers)) is not True:
            left_s = deadline - loop.time()
            if left_s <= 0:
                layer = min(self._num_complete, num_layers - 1)
                raise KVTransferError(f"KV layer {layer} not computed within {timeout_s:g} s")
            if isinstance(probe, asyncio.Future):
                await asyncio.wait((probe,), timeout=left_s)
            elif probe():  # complete; on CUDA, wait for the layer's kernels too (they finish in order)
                return
            else:
                await asyncio.sleep(min(READY_POLL_S, left_s))

    def _probe_when_complete(self, loop: asyncio.AbstractEventLoop, num_layers: int):
        """True when ready, the ready probe of layer ``num_layers - 1`` when complete, else a future."""
        with self._lock:
            if self._error is not None:
                raise KVTransferError(f"KV layers will not be computed: {self._error}")
            if self._num_complete >= num_layers:
                probe = _last_probe(self._probes[:num_layers])
                return True if probe is None else probe
            fut = loop.create_future()
            self._waiters.append((loop, fut))
            return fut


def _last_probe(probes: list[ReadyProbe | None]) -> ReadyProbe | None:
    """The last layer's probe that is set: device work finishes in stream order, so it covers the rest."""
    return next((p for p in reversed(probes) if p is not None), None)


def _wake_all(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
    for loop, fut in waiters:
        try:
            loop.call_soon_threadsafe(_set_done, fut)
        except RuntimeError:  # that loop is closed: nobody waits any more
            pass


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
