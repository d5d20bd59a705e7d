"""FlashInfer attention on CUDA (flashinfer-python 0.7): paged prefill/append and decode wrappers.

A layer's cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` is FlashInfer's "NHD" paged
layout, so the kernels read it in place. Once per step, ``build_metadata`` turns the block tables
into FlashInfer's CSR page tables (kept on the CPU, where ``plan()`` reads them, so planning never
waits on the GPU) and the cache rows each new token's key and value go to.

``plan()`` needs head counts, dtype, scale and window, which the protocol hands only to
``forward``; so a wrapper is planned by the first layer of a step that needs it and reused by the
others. FlashInfer fixes the sliding window at plan time (``run`` asserts it is unchanged), so each
distinct window has its own wrapper. All wrappers share one workspace buffer: they run one after
another on one stream. Steps where every sequence has one query token use the decode wrapper
(tensor cores for GQA); any step with a longer chunk uses the prefill wrapper, causal, which also
serves its one-token rows.

FlashInfer has no float32 kernels: float32 attention falls back to the torch reference backend.
flashinfer is imported only inside functions, so this module loads on a CPU-only machine.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.attention.base import StepBatch
from engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-KV scratch size
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_HEAD_DIMS = (64, 128, 256)


def flashinfer_available() -> bool:
    """True when a CUDA device is present and ``import flashinfer`` works. Never raises."""
    try:
        if not torch.cuda.is_available():
            return False
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install failing at import
        return False
    return True


def kernel_refusal(head_dim: int) -> str | None:
    """Why FlashInfer's paged kernels cannot serve a model's attention, or None when they can (head dims 64,
    128 and 256; float32 is served by the torch fallback inside the backend)."""
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"has no kernels for head_dim {head_dim} (only {', '.join(map(str, KERNEL_HEAD_DIMS))})"
    return None


def window_left(window: int | None) -> int:
    """FlashInfer's inclusive left window: a query at position p sees keys p - window_left .. p,
    i.e. ``window`` keys counting itself (the torch backend's ``p - key < window``). -1: no window."""
    return -1 if window is None else window - 1


@dataclass(frozen=True, slots=True)
class PagedKVTables:
    """One step's page tables in FlashInfer's CSR form; int32 tensors on the CPU."""

    qo_indptr: torch.Tensor  # [S + 1] sequence i's query rows are [qo_indptr[i], qo_indptr[i + 1])
    kv_indptr: torch.Tensor  # [S + 1] sequence i's pages are kv_indices[kv_indptr[i] : kv_indptr[i + 1]]
    kv_indices: torch.Tensor  # [num_pages] block ids, sequence after sequence
    kv_last_page_len: torch.Tensor  # [S] filled slots of each sequence's last page, in [1, block_size]


def paged_kv_tables(batch: StepBatch) -> PagedKVTables:
    """The pages holding each sequence's context (its new tokens included) after this step's write, from the
    batch's host arrays (planning never reads the device)."""
    size = batch.block_size
    contexts = batch.context_lens_host  # [B]
    num_pages = -(-contexts // size)  # [B]
    table = batch.block_table_host  # [B, W]
    assert table.shape[1] >= num_pages.max(initial=0), "block table shorter than context"
    used = np.arange(table.shape[1])[None, :] < num_pages[:, None]  # [B, W]
    return PagedKVTables(
        qo_indptr=_int32(_offsets(batch.counts)),
        kv_indptr=_int32(_offsets(num_pages)),
        kv_indices=_int32(table[used]),  # row-major: sequence after sequence
        kv_last_page_len=_int32(contexts - (num_pages - 1) * size),
    )


def kv_cache_rows(batch: StepBatch) -> torch.Tensor:
    """[T] int64 on the batch's device: where each new token's key goes in a layer's cache viewed as
    ``[num_blocks * 2 * block_size, num_kv_heads, head_dim]``; its value goes ``block_size`` rows on."""
    block, offset = batch.slots // batch.block_size, batch.slots % batch.block_size  # [T]
    return block * (2 * batch.block_size) + offset


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows, value_rows) -> None:
    """Store this step's keys and values: kv_cache [num_blocks, 2, bs, kvh, d], k and v [T, kvh, d]."""
    flat = kv_cache.view(-1, *kv_cache.shape[-2:])  # [num_blocks * 2 * bs, kvh, d], shares storage
    flat.index_copy_(0, key_rows, k)
    flat.index_copy_(0, value_rows, v)


@dataclass(slots=True)
class FlashInferMetadata:
    step: int  # which build_metadata call made it; a wrapper's plan belongs to one step
    batch: StepBatch
    block_size: int
    tables: PagedKVTables  # on the CPU, for plan()
    key_rows: torch.Tensor  # [T] int64 on the device
    value_rows: torch.Tensor  # [T]
    decode_only: bool  # every sequence has one query token: the decode wrapper
    reference: TorchAttentionMetadata | None = None  # the float32 fallback's, built on first use


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything a wrapper's plan() depends on; a wrapper is re-planned when this changes."""

    step: int
    window: int | None
    scale: float
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        # Split-KV scratch shared by every wrapper; FlashInfer asks for zeros before first use.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[tuple[bool, int | None], Any] = {}  # (decode_only, window) -> wrapper
        self._plans: dict[tuple[bool, int | None], _Plan] = {}  # what each wrapper is planned for now
        self._steps = itertools.count()
        self._reference = TorchAttentionBackend()
        self._warned_fallback = False

    def build_metadata(self, batch: StepBatch) -> FlashInferMetadata:
        key_rows = kv_cache_rows(batch)  # [T]
        return FlashInferMetadata(
            step=next(self._steps), batch=batch, block_size=batch.block_size, tables=paged_kv_tables(batch),
            key_rows=key_rows, value_rows=key_rows + batch.block_size, decode_only=batch.is_decode_only,
        )

    def forward(self, q, k, v, kv_cache, metadata: FlashInferMetadata, window, scale):
        # q [T, h, d], k/v [T, kvh, d], kv_cache [num_blocks, 2, bs, kvh, d]
        if q.dtype not in KERNEL_DTYPES:
            return self._reference_forward(q, k, v, kv_cache, metadata, window, scale)
        write_kv(kv_cache, k, v, metadata.key_rows, metadata.value_rows)
        wrapper = self._planned_wrapper(metadata, q, kv_cache, window, scale)
        return wrapper.run(q.contiguous(), kv_cache)  # [T, h, d]

    def _planned_wrapper(self, metadata: FlashInferMetadata, q, kv_cache, window, scale):
        _, num_heads, head_dim = q.shape
        _, _, page_size, num_kv_heads, _ = kv_cache.shape
        assert page_size == metadata.block_size and kv_cache.dtype == q.dtype, "cache does not match the step"
        plan = _Plan(metadata.step, window, float(scale), num_heads, num_kv_heads, head_dim, page_size, q.dtype)
        slot = (metadata.decode_only, window)
        if slot not in self._wrappers:
            self._wrappers[slot] = self._new_wrapper(metadata.decode_only, plan)
        if self._plans.get(slot) != plan:
            planner = _plan_decode if metadata.decode_only else _plan_prefill
            planner(self._wrappers[slot], metadata.tables, plan)
            self._plans[slot] = plan
        return self._wrappers[slot]

    def _new_wrapper(self, decode_only: bool, plan: _Plan):
        import flashinfer

        if decode_only:
            # Tensor cores pay off once several query heads share a KV head (GQA).
            tensor_cores = plan.num_qo_heads > plan.num_kv_heads
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=tensor_cores)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")

    def _reference_forward(self, q, k, v, kv_cache, metadata: FlashInferMetadata, window, scale):
        if metadata.reference is None:
            if not self._warned_fallback:
                logger.warning("FlashInfer has no %s kernels; attention runs on the torch backend", q.dtype)
                self._warned_fallback = True
            metadata.reference = self._reference.build_metadata(metadata.batch)
        return self._reference.forward(q, k, v, kv_cache, metadata.reference, window, scale)


def _plan_prefill(wrapper, tables: PagedKVTables, plan: _Plan) -> None:
    # BatchPrefillWithPagedKVCacheWrapper.plan(qo_indptr, paged_kv_indptr, paged_kv_indices,
    # paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, ...)
    wrapper.plan(
        tables.qo_indptr, tables.kv_indptr, tables.kv_indices, tables.kv_last_page_len,
        plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
        causal=True, sm_scale=plan.scale, window_left=window_left(plan.window),
        q_data_type=plan.dtype, kv_data_type=plan.dtype,
    )


def _plan_decode(wrapper, tables: PagedKVTables, plan: _Plan) -> None:
    # BatchDecodeWithPagedKVCacheWrapper.plan(indptr, indices, last_page_len, num_qo_heads,
    # num_kv_heads, head_dim, page_size, ...)
    wrapper.plan(
        tables.kv_indptr, tables.kv_indices, tables.kv_last_page_len,
        plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
        sm_scale=plan.scale, window_left=window_left(plan.window),
        q_data_type=plan.dtype, kv_data_type=plan.dtype,
    )


def _offsets(counts: np.ndarray) -> np.ndarray:  # [n] -> [n + 1]
    return np.concatenate(([0], np.cumsum(counts)))


def _int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))
