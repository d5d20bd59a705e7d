"""Layer-wise KV streaming on the prefill worker (``PrefillStream``; router ``--kv-layerwise``).

A watched request gets a ``LayerProgress``. When a step schedules the request's last prompt chunk (the
step that samples its first token, after which a prefill request ends and hands its blocks over), the
engine thread calls ``on_admitted(request_id, block_ids, progress, first_block)`` on the event loop (where the
node pins the blocks under a transfer lease at once: those the request will hand over, from the prompt block
``first_block`` on, past what fell out of a sliding window) and then completes the progress layer by layer as the
model writes each layer's KV. A transfer server that streams (``kv_transfer.transport.STREAMING_KINDS``)
sends layer l while layer l+1 computes; the other servers refuse the lease until every layer is done.

Why the last chunk only: a prompt prefilled in several chunks has layer l of all its blocks only once
the last chunk's layer l is written. Why the blocks may be pinned before the step ends: the request
finishes within that same step, and every lease release reaches the engine through its inbox, which
is drained only between steps, i.e. after the blocks were handed over (``AsyncEngine._run``).

All hooks run on the engine thread; ``watch`` and ``forget`` on the event loop (a lock guards the map).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from engine.core.outputs import SchedulerOutput
from kv_transfer.progress import LayerProgress, ReadyProbe

# (request id, block ids, progress, the prompt block they start at), on the loop
Admitted = Callable[[str, tuple[int, ...], LayerProgress, int], None]


class LayerwiseHooks:
    """The engine-step hooks that advance the progress of watched requests."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_layers: int, on_admitted: Admitted,
                 ready_probe: Callable[[int], ReadyProbe | None] = lambda layer: None,
                 first_block: Callable[[int], int] = lambda num_tokens: 0) -> None:
        self._loop, self.num_layers, self._on_admitted = loop, num_layers, on_admitted
        self._ready_probe = ready_probe  # layer -> its CUDA event's ``query`` (None on CPU)
        # prompt tokens -> the first block its prefill hands over (a sliding window's: ``Scheduler._finish``)
        self._first_block = first_block
        self._lock = threading.Lock()
        self._watched: dict[str, LayerProgress] = {}
        self._active: list[LayerProgress] = []  # the progresses the running step advances

    def watch(self, request_id: str) -> LayerProgress:
        """Stream ``request_id``'s KV layer by layer (call before the request is added)."""
        progress = LayerProgress(self.num_layers)
        with self._lock:
            self._watched[request_id] = progress
        return progress

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._watched.pop(request_id, None)

    @property
    def watching(self) -> bool:
        """Any request watched: the engine passes the hooks to its next step (else it runs without)."""
        return bool(self._watched)

    # ---- engine thread -----------------------------------------------------------------------
    def on_scheduled(self, output: SchedulerOutput) -> None:
        with self._lock:
            admitted = [(seq.request.request_id, seq.block_ids, progress, self._first_block(seq.end))
                        for seq in output.seqs
                        if seq.samples and (progress := self._watched.pop(seq.request.request_id, None))]
        self._active = [progress for _, _, progress, _ in admitted]
        for request_id, block_ids, progress, first in admitted:
            self._loop.call_soon_threadsafe(self._on_admitted, request_id, tuple(block_ids[first:]), progress, first)

    def on_layer(self, layer: int) -> None:
        for progress in self._active:
            progress.complete(layer, self._ready_probe(layer))

    def step_ended(self, error: BaseException | None = None) -> None:
        """After the step: a failed step fails its progresses (their streamed reads end at once)."""
        active, self._active = self._active, []
        for progress in active:
            if error is not None:
                progress.fail(f"the prefill step failed: {error!r}")
            elif not progress.is_complete:  # a model without the per-layer hook: all at once
                progress.complete_all()
