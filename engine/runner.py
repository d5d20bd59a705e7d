"""ModelRunner: turns a SchedulerOutput into tensors, runs the model once, samples. The only
torch-facing part of a step; one host sync per step (the sampled ids' ``tolist``, which also brings back
the sampler's unproven-row flags; a second one only in a step where some row needs a full sort).

The paged cache holds one block more than the pool hands out: the last one (``pad_block``) belongs to no
request; the padding rows of a CUDA-graph decode step write their KV there (``engine/decode_graphs.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.base import AttentionBackend, ForwardBatch, SeqSlice, StepBatch
from engine.core.outputs import SampledTokens, SchedulerOutput
from engine.decode_graphs import DecodeGraphs
from engine.host_cache import HostCache
from engine.spec_draft import DraftProposer
from engine.kv_quant import SCALE_BYTES, KVQuant
from engine.model.config import ModelConfig
from engine.sampler import Sampler
from engine.sampling.builder import SamplingBatchBuilder
from engine.step_inputs import StepInputs, pack

if TYPE_CHECKING:
    from engine.parallel.leader import TPLeader

# Layer-wise KV streaming: ``on_layer(i)`` runs on the engine thread after decoder layer i wrote this
# step's KV, layers in order. On CPU the forward is synchronous, so layer i's KV is in the cache when the
# hook runs; on CUDA it is only issued: ``ModelRunner.layer_events[i]`` (recorded just before the hook)
# completes when it is written, e.g. ``LayerProgress.complete(i, ready=runner.layer_events[i].query)``.
LayerHook = Callable[[int], None]


def cache_shape(config: ModelConfig, num_blocks: int, block_size: int, quant: KVQuant | None,
                tp_size: int = 1) -> tuple[tuple[int, ...], torch.dtype]:
    """One rank's paged cache, pad block included: ``[layers, num_blocks + 1, 2, block_size, kv_heads / tp_size,
    row]`` (row: head_dim values, or a quantized row's bytes), and its dtype."""
    dtype = getattr(torch, config.dtype) if quant is None else torch.uint8
    row = config.head_dim if quant is None else config.head_dim + SCALE_BYTES
    return (config.num_layers, num_blocks + 1, 2, block_size, config.num_kv_heads // tp_size, row), dtype


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        backend: AttentionBackend,
        num_host_blocks: int = 0,
        quant: KVQuant | None = None,
        tp: TPLeader | None = None,
        kv_ranks: torch.Tensor | None = None,
    ) -> None:
        """``tp``: rank 0 of a tensor-parallel group (its model is rank 0's share) and ``kv_ranks`` every rank's
        cache, ``[N, *cache_shape]`` in shared memory (CPU; None on CUDA, where each rank's is on its GPU)."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.sampler = Sampler()
        self.sampling = SamplingBatchBuilder(config.vocab_size, device)  # holds per-request penalty state
        self.quant = quant  # a quantized cache: uint8 rows of head_dim values + their scale (engine/kv_quant.py)
        self.tp = tp
        self.max_blocks_per_seq = -(-config.max_position_embeddings // block_size)
        self.pad_block = num_blocks  # one block past the pool's (see the module docstring)
        shape, dtype = cache_shape(config, num_blocks, block_size, quant, tp.size if tp else 1)
        # this rank's paged cache (all of it without tensor parallelism)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device) if kv_ranks is None else kv_ranks[0]
        self.kv_ranks = [self.kv_cache] if kv_ranks is None else list(kv_ranks.unbind(0))  # the caches seen here
        self.kv_layers = list(self.kv_cache.unbind(0))  # per layer: [num_blocks + 1, 2, bs, kvh, d]
        self.layer_events: list = []  # CUDA only: one event per layer of the last hooked step
        self.inputs = StepInputs(device, block_size)  # persistent (pinned on CUDA) input buffers
        self.graphs: DecodeGraphs | None = None
        self.draft: DraftProposer | None = None  # draft-model speculative decoding (engine/spec_draft.py)
        # the host tier's memory; under tensor parallelism it copies every rank's layers ([N * L, blocks + 1, ...])
        host_kv = self.kv_cache if kv_ranks is None else kv_ranks.flatten(0, 1)
        self.host = HostCache(host_kv, num_host_blocks) if num_host_blocks else None

    def use_decode_graphs(self, sizes: Sequence[int], *, capture: bool) -> None:
        """Decode steps of up to ``max(sizes)`` sequences run in fixed shapes: captured as CUDA graphs
        (``capture``, CUDA only) or, without a graph, eagerly in the same shapes (tests on CPU)."""
        if self.tp is not None:  # the other ranks would not run the graph's forward: its all-reduces would hang
            raise ValueError("decode graphs are not built for tensor parallelism")
        self.graphs = DecodeGraphs(self.model, self.kv_layers, sizes=sizes, max_blocks=self.max_blocks_per_seq,
                                   block_size=self.block_size, pad_block=self.pad_block, device=self.device,
                                   capture=capture, quant=self.quant)
        if capture:
            self.graphs.capture_all()  # never run here (no GPU)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, on_layer: LayerHook | None = None) -> SampledTokens:
        self.forget(output.preempted_ids)
        seqs = output.seqs if self.draft is None else self.draft.fill(output.seqs)  # the draft model's drafts
        input_ids, logit_rows, batch = self.inputs.fill(seqs)
        hidden = self._forward(input_ids, batch, on_layer)  # [T, hidden]
        rows = [(s.request, offset) for s in seqs for offset in range(s.num_rows)]  # drafts: one row each
        if not rows:
            return SampledTokens([], seqs=seqs)
        logits = self.model.compute_logits(hidden[logit_rows])  # [S, vocab]
        result = self.sampler(logits, self.sampling.build_rows(rows), scratch=True)
        token_ids, result = self.sampler.read(result)  # the step's one host sync (two if some row falls back)
        return SampledTokens(token_ids, _logprob_lists(result), seqs)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drops the per-request state (sampling, block-table row) of requests that finished, were aborted or
        preempted (unknown ids: no-op)."""
        self.sampling.forget(request_ids)
        self.inputs.forget(request_ids)
        if self.draft is not None:
            self.draft.forget(request_ids)

    def _forward(self, input_ids: torch.Tensor, batch: StepBatch, on_layer: LayerHook | None) -> torch.Tensor:
        if on_layer is None and self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.forward(input_ids, batch)  # [B, hidden]
        if self.tp is not None:
            self.tp.step(*self.inputs.packed())  # the other ranks run this step's forward with this one
        forward_batch = ForwardBatch(batch.positions, self.kv_layers, self.backend, self.backend.build_metadata(batch))
        return self._model(input_ids, forward_batch, self._device_hook(on_layer))  # [T, hidden]

    def _model(self, input_ids: torch.Tensor, batch: ForwardBatch, on_layer: LayerHook | None = None) -> torch.Tensor:
        """The model's forward pass; under tensor parallelism a failed all-reduce ends the engine with the reason."""
        if self.tp is None:
            return self.model(input_ids, batch, on_layer)
        try:
            return self.model(input_ids, batch, on_layer)
        except RuntimeError as exc:
            raise self.tp.failure(exc) from exc

    @torch.inference_mode()
    def prompt_logits(self, token_ids: Sequence[int], block_ids: Sequence[int], *, start: int = 0,
                      last_only: bool = False) -> torch.Tensor:
        """Logits of one sequence's tokens at positions [start, start + T) [T, vocab] (``last_only``: the last
        position's [1, vocab], as a step computes them), their KV written into ``block_ids``, which hold the
        first ``start`` tokens' KV already."""
        batch = StepBatch.from_slices([SeqSlice(start, len(token_ids), block_ids)], self.block_size, self.device)
        input_ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        if self.tp is not None:
            self.tp.step(*pack(token_ids, batch, [len(token_ids) - 1]))
        metadata = self.backend.build_metadata(batch)
        hidden = self._model(input_ids, ForwardBatch(batch.positions, self.kv_layers, self.backend, metadata))
        return self.model.compute_logits(hidden[-1:] if last_only else hidden)  # [T or 1, vocab]

    def _device_hook(self, on_layer: LayerHook | None) -> LayerHook | None:
        """``on_layer`` itself on CPU; on CUDA, first record layer i's event on the current stream."""
        if on_layer is None or self.device.type != "cuda":
            return on_layer
        events = self.layer_events = [torch.cuda.Event() for _ in range(self.config.num_layers)]

        def hook(layer_index: int) -> None:  # untested here (no GPU): events record in stream order
            events[layer_index].record()
            on_layer(layer_index)

        return hook


def _logprob_lists(result) -> list[tuple[float, list[tuple[int, float]]]] | None:
    if result.logprobs is None:
        return None
    chosen = result.logprobs.tolist()
    top_ids = result.top_logprob_ids.tolist()
    top_values = result.top_logprobs.tolist()
    return [(c, list(zip(ids, vals))) for c, ids, vals in zip(chosen, top_ids, top_values)]
