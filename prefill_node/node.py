"""A prefill worker: the worker shell that computes prompts and pins their blocks under transfer leases.

Its prefills hold their blocks when they finish (``hold_blocks``); ``on_held`` hands them to the request's
lease, which a decode worker pulls. Layer-wise (``PrefillStream``), the lease is pinned earlier, when the
step computing the prompt's last chunk starts, and its layers are read as they are written
(``prefill_node/layerwise.py``).
"""

from __future__ import annotations

from engine.core.kv_cache_manager import window_start
from engine.core.outputs import RequestDelta
from kv_transfer.progress import LayerProgress
from prefill_node.layerwise import LayerwiseHooks
from prefill_node.servicer import PrefillServicer
from worker.node import WorkerNode


class PrefillNode(WorkerNode):
    def servicer(self) -> PrefillServicer:
        return PrefillServicer(self)

    def step_hooks(self) -> LayerwiseHooks:
        window = self.engine.scheduler_config.sliding_window  # the blocks before its window are not leased
        self.layerwise = LayerwiseHooks(self.loop, self.layout.num_layers, self._on_admitted, self._ready_probe,
                                        first_block=lambda n: window_start(n, window, self.layout.block_size))
        return self.layerwise

    def on_held(self, delta: RequestDelta) -> None:
        """Engine thread: a prefill finished and handed its blocks over; they become the request's lease."""
        self.loop.call_soon_threadsafe(self.leases.hand_over, delta.request_id, delta.held_block_ids,
                                       delta.held_first_block)

    def _on_admitted(self, request_id: str, block_ids: tuple[int, ...], progress: LayerProgress,
                     first_block: int) -> None:
        """Event loop, layer-wise: the step computing ``request_id``'s last prompt chunk started; pin its
        blocks (from ``first_block`` on, what it will hand over) now so a pull can stream each layer as it is
        written."""
        self.leases.pin_admitted(request_id, block_ids, progress, first_block)

    def _ready_probe(self, layer: int):
        """On CUDA, layer ``layer``'s event of the running step (its kernels finish after the hook)."""
        events = self.engine.runner.layer_events
        return events[layer].query if layer < len(events) else None
