"""CUDA graphs for decode steps (``--cuda-graph-sizes``; off with ``--enforce-eager``).

A decode step of a small model is mostly launch overhead: a dozen kernels per layer, each a few microseconds
of Python and driver work for a few microseconds of GPU time. A CUDA graph captured once replays the whole
forward pass as one launch. Graphs need fixed shapes, so one is captured per (batch size G, block-table
width NB): a step of B decodes runs in the graph of the smallest captured G >= B and the narrowest NB that
holds its longest context. Rows B..G are padding (token 0 at position 0, its KV written to the runner's pad
block, a context of one token) and their outputs are dropped. Before each replay the step's inputs are
copied into the tensors the graph reads (the ids and positions here, the plan's in ``StaticDecode``); the
logits and the sampler run after it, outside the graph, on the B real rows.

The attention inside a graph is the torch backend's decode in fixed shapes (``StaticDecode``), whichever
backend runs the other steps (flashinfer's graph-mode decode wrappers are not wired in yet). Steps with a
prefill chunk, more sequences than the largest G, a context past ``MAX_CAPTURE_CONTEXT`` or layer hooks
(layer-wise KV streaming) run eagerly.

On CPU (the tests) ``capture=False`` runs the same fixed-shape forward without a graph, so every line but
the capture and the replay runs here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import ForwardBatch, StepBatch
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kv_quant import KVQuant

logger = logging.getLogger(__name__)

MAX_CAPTURE_CONTEXT = 8192  # tokens: longer contexts decode eagerly (a graph's gather is sized for its width)


def graph_sizes(sizes: Sequence[int], max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: those up to ``max_num_seqs``, and ``max_num_seqs`` itself."""
    if not sizes or min(sizes) < 1:
        raise ValueError(f"CUDA graph sizes must be positive batch sizes, got {list(sizes)}")
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {min(max(sizes), max_num_seqs)}))


@dataclass(slots=True)
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [G, hidden] the graph's output, rewritten by each replay


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_layers: Sequence[torch.Tensor], *, sizes: Sequence[int],
                 max_blocks: int, block_size: int, pad_block: int, device: torch.device, capture: bool,
                 quant: KVQuant | None = None) -> None:
        self.model, self.kv_layers, self.capture = model, kv_layers, capture
        self.sizes = tuple(sorted(set(sizes)))
        self.backend = TorchAttentionBackend(quant)
        max_blocks = min(max_blocks, MAX_CAPTURE_CONTEXT // block_size)
        self.static = self.backend.static_decode(self.sizes[-1], max_blocks, block_size, pad_block, device)
        self.widths = self.static.block_buckets(max_blocks)
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)  # [G]
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)  # [G]
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.num_runs = 0  # steps run through here (tests, logs)

    def fits(self, batch: StepBatch) -> bool:
        return (batch.num_seqs <= self.sizes[-1] and batch.block_table.shape[1] <= self.widths[-1]
                and batch.is_decode_only)

    def forward(self, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The step's hidden states [B, hidden] (a view, valid until the next step)."""
        real = batch.num_seqs
        size = next(g for g in self.sizes if g >= real)
        width = next(w for w in self.widths if w >= batch.block_table.shape[1])
        self.input_ids[:real].copy_(input_ids)
        self.positions[:real].copy_(batch.positions)
        self.input_ids[real:size] = 0
        self.positions[real:size] = 0
        self.static.fill(batch, size)
        self.num_runs += 1
        if not self.capture:
            return self._forward(size, width)[:real]
        graph = self._graphs[(size, width)]  # never run here (no GPU)
        graph.graph.replay()
        return graph.hidden[:real]

    def _forward(self, size: int, width: int) -> torch.Tensor:
        metadata = self.static.metadata(size, width)
        batch = ForwardBatch(self.positions[:size], self.kv_layers, self.backend, metadata)
        return self.model(self.input_ids[:size], batch)  # [G, hidden]

    @torch.inference_mode()
    def capture_all(self) -> None:  # never run here (no GPU)
        """Capture every (size, width) graph, widest and largest first, into one memory pool."""
        started, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        shapes = [(size, width) for width in reversed(self.widths) for size in reversed(self.sizes)]
        for i, (size, width) in enumerate(shapes):
            self._graphs[(size, width)] = self._capture(size, width, pool)
            if (i + 1) % 16 == 0:
                logger.info("captured %d of %d decode CUDA graphs", i + 1, len(shapes))
        logger.info("captured %d decode CUDA graphs (batch sizes %s, tables of up to %d blocks) in %.1f s",
                    len(shapes), list(self.sizes), self.widths[-1], time.perf_counter() - started)

    def _capture(self, size: int, width: int, pool) -> _Graph:  # never run here (no GPU)
        metadata = self.static.metadata(size, width)
        batch = ForwardBatch(self.positions[:size], self.kv_layers, self.backend, metadata)
        ids = self.input_ids[:size]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(ids, batch)  # warm-up outside the graph (lazy initialisations); writes only the pad block
        torch.cuda.current_stream().wait_stream(stream)
        metadata.forget_masks()  # computed by the warm-up: the graph must compute its own from context_lens
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.model(ids, batch)  # [G, hidden]
        return _Graph(graph, hidden)
