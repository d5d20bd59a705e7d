"""Reference attention on any device: gather the paged KV, then SDPA.

Decode sequences (one query token) are bucketed by context length (powers of two from 64), so a
step costs a handful of batched gathers + SDPA calls per layer with at most 2x padding, instead of
one call per sequence or padding everyone to the longest context. Prefill chunks attend one
sequence at a time (there are few per step); a chunk with no cached context skips the gather.
The plan is built from the step's host arrays (``StepBatch``): no host sync.

``StaticDecode`` is the same decode attention in fixed shapes (a batch of G sequences, tables of NB
blocks, all in persistent tensors), which a CUDA graph can capture once and replay every step
(``engine/decode_graphs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import StepBatch, to_device
from engine.kv_quant import KVQuant

_MIN_BUCKET_TOKENS = 64


@dataclass(slots=True)
class _DecodeGroup:
    token_index: torch.Tensor  # [B] flat index of each sequence's query token
    block_table: torch.Tensor  # [B, nb] each sequence's blocks (entries past its context are masked)
    context_lens: torch.Tensor  # [B]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B, 1, 1, L] bool

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        if window not in self.masks:
            key_pos = torch.arange(self.block_table.shape[1] * block_size, device=self.block_table.device)  # [L]
            lens = self.context_lens[:, None]  # [B, 1]
            allowed = key_pos[None, :] < lens  # [B, L]
            if window is not None:
                allowed &= (lens - 1 - key_pos[None, :]) < window
            self.masks[window] = allowed[:, None, None, :]
        return self.masks[window]


@dataclass(slots=True)
class _PrefillSeq:
    token_start: int  # this chunk's rows in the flat [T] batch
    token_end: int
    start: int  # tokens already in the cache before this chunk
    key_block: torch.Tensor | None  # [ctx] None when start == 0 (keys are this chunk's own)
    key_offset: torch.Tensor | None
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[q_len, ctx] bool, or None for plain causal attention."""
        if window not in self.masks:
            q_len = self.token_end - self.token_start
            if self.start == 0 and window is None:
                self.masks[window] = None
            else:
                q_pos = self.start + torch.arange(q_len, device=device)[:, None]  # [q, 1]
                k_pos = torch.arange(self.start + q_len, device=device)[None, :]  # [1, ctx]
                allowed = k_pos <= q_pos
                if window is not None:
                    allowed &= (q_pos - k_pos) < window
                self.masks[window] = allowed
        return self.masks[window]


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_block: torch.Tensor  # [T] where each new token's KV is written
    slot_offset: torch.Tensor  # [T]
    decode_groups: list[_DecodeGroup]
    prefills: list[_PrefillSeq]

    def forget_masks(self) -> None:
        """Masks are computed by a step's first layer and reused by the others; a replayed plan recomputes."""
        for group in self.decode_groups:
            group.masks.clear()


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, quant: KVQuant | None = None) -> None:
        self.quant = quant  # a quantized cache: rows are packed on write and unpacked where they are read

    def build_metadata(self, batch: StepBatch) -> TorchAttentionMetadata:
        counts, contexts = batch.counts, batch.context_lens_host  # [B] host
        first_rows = np.cumsum(counts) - counts  # [B] each sequence's first row in the flat batch
        decodes = np.flatnonzero(counts == 1)
        buckets = _bucket(contexts[decodes])  # [D]
        groups = [_decode_group(decodes[buckets == b], first_rows, batch) for b in np.unique(buckets)]
        prefills = [_prefill_seq(int(first_rows[i]), int(batch.starts[i]), int(counts[i]), batch.block_table[i],
                                 batch.block_size) for i in np.flatnonzero(counts != 1)]
        return TorchAttentionMetadata(batch.slots // batch.block_size, batch.slots % batch.block_size, groups, prefills)

    def forward(self, q, k, v, kv_cache, metadata: TorchAttentionMetadata, window, scale):
        # kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] (quantized: uint8, head_dim + 4)
        rows = torch.stack((k, v), dim=1) if self.quant is None else torch.stack((self.quant.pack(k), self.quant.pack(v)), 1)
        kv_cache[metadata.slot_block, :, metadata.slot_offset] = rows  # [T, 2, kvh, d]
        read = _reader(self.quant, q.dtype)
        out = torch.empty_like(q)  # [T, h, d]
        for group in metadata.decode_groups:
            out[group.token_index] = _decode_attention(q, kv_cache, group, window, scale, read)
        for seq in metadata.prefills:
            out[seq.token_start : seq.token_end] = _prefill_attention(q, k, v, kv_cache, seq, window, scale, read)
        return out

    def static_decode(self, max_seqs: int, max_blocks: int, block_size: int, pad_block: int,
                      device: torch.device) -> StaticDecode:
        return StaticDecode(max_seqs, max_blocks, block_size, pad_block, device)


class StaticDecode:
    """Decode attention in fixed shapes for CUDA graphs: up to ``max_seqs`` sequences of up to ``max_blocks``
    blocks, in tensors that live as long as the graphs. ``fill`` writes a step into them (B real sequences,
    padded to a graph's G with sequences of one token whose KV goes to ``pad_block``, a block no request
    owns); ``metadata(G, NB)`` is the plan a graph captures, reading only these tensors."""

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int, pad_block: int, device: torch.device) -> None:
        self.block_size, self.pad_block = block_size, pad_block
        self.slot_block = torch.full((max_seqs,), pad_block, dtype=torch.int64, device=device)  # [G]
        self.slot_offset = torch.zeros(max_seqs, dtype=torch.int64, device=device)  # [G]
        self.block_table = torch.full((max_seqs, max_blocks), pad_block, dtype=torch.int64, device=device)  # [G, NB]
        self.context_lens = torch.ones(max_seqs, dtype=torch.int64, device=device)  # [G]
        self.token_index = torch.arange(max_seqs, device=device)  # [G]

    def block_buckets(self, max_blocks: int) -> list[int]:
        """The table widths graphs are captured for: each step uses the narrowest that holds its contexts."""
        widths = [w for w in (4 << i for i in range(32)) if w < max_blocks]
        return [*widths, max_blocks]

    def metadata(self, num_seqs: int, num_blocks: int) -> TorchAttentionMetadata:
        group = _DecodeGroup(self.token_index[:num_seqs], self.block_table[:num_seqs, :num_blocks],
                             self.context_lens[:num_seqs])
        return TorchAttentionMetadata(self.slot_block[:num_seqs], self.slot_offset[:num_seqs], [group], [])

    def fill(self, batch: StepBatch, num_seqs: int) -> None:
        """A decode-only step of B <= ``num_seqs`` sequences; rows B.. are padding."""
        real, width = batch.num_seqs, batch.block_table.shape[1]
        self.slot_block[:real].copy_(batch.slots // self.block_size)
        self.slot_offset[:real].copy_(batch.slots % self.block_size)
        self.block_table[:real, :width].copy_(batch.block_table)  # columns past width: stale ids, masked
        self.context_lens[:real].copy_(batch.context_lens)
        self.slot_block[real:num_seqs] = self.pad_block
        self.slot_offset[real:num_seqs] = 0
        self.block_table[real:num_seqs, 0] = self.pad_block
        self.context_lens[real:num_seqs] = 1


def _reader(quant: KVQuant | None, dtype: torch.dtype):
    """Cached rows as attention reads them: as stored, or unpacked from a quantized cache."""
    if quant is None:
        return lambda rows: rows
    return lambda rows: quant.unpack(rows, dtype)


def _decode_attention(q, kv_cache, group: _DecodeGroup, window, scale, read) -> torch.Tensor:
    """Whole-block gather, head-major in one copy (one index_select on the cache viewed [2, kvh, blocks, bs, d]),
    then GQA as a batched matmul over (KV head, sequence): each KV head's group of query heads attends at once, so
    K/V are never repeated per query head. (A gather in the cache's own order then a head-major reshape copied
    every block twice: 1.35x slower at 32 sequences of 320 tokens.)"""
    num_seqs, num_blocks = group.block_table.shape
    by_head = kv_cache.permute(1, 3, 0, 2, 4)  # [2, kvh, num_blocks, bs, d] (a view)
    _, num_kv_heads, _, block_size, _ = by_head.shape
    length = num_blocks * block_size
    kv = read(by_head.index_select(2, group.block_table.reshape(-1)))  # [2, kvh, B*nb, bs, d]
    head_dim = kv.shape[-1]
    kv = kv.view(2, num_kv_heads * num_seqs, length, head_dim)  # [2, kvh*B, L, d]
    query = q[group.token_index].view(num_seqs, num_kv_heads, -1, head_dim)  # [B, kvh, h/kvh, d]
    query = query.transpose(0, 1).reshape(num_kv_heads * num_seqs, -1, head_dim)  # [kvh*B, h/kvh, d]
    scores = torch.bmm(query, kv[0].transpose(1, 2)).float() * scale  # [kvh*B, h/kvh, L]
    mask = group.mask(window, block_size).view(1, num_seqs, 1, length)
    scores = scores.view(num_kv_heads, num_seqs, -1, length).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).to(kv.dtype).view(num_kv_heads * num_seqs, -1, length)
    out = torch.bmm(probs, kv[1]).view(num_kv_heads, num_seqs, -1, head_dim)  # [kvh, B, h/kvh, d]
    return out.transpose(0, 1).reshape(num_seqs, -1, head_dim)  # [B, h, d]


def _prefill_attention(q, k, v, kv_cache, seq: _PrefillSeq, window, scale, read) -> torch.Tensor:
    """SDPA on 4-d [1, heads, tokens, d] tensors whose last dim is dense: on CPU only those reach torch's flash
    kernel (others take the math path, which materializes every score: 5x slower for a causal chunk of 2,048
    tokens; q, k, v of a column-major product, ``layers.linear``'s without a packed weight, are copied)."""
    rows = slice(seq.token_start, seq.token_end)
    query = _dense_last(q[rows].transpose(0, 1))[None]  # [1, h, q, d]
    if seq.key_block is None:
        keys, values = _dense_last(k[rows].transpose(0, 1))[None], _dense_last(v[rows].transpose(0, 1))[None]
    else:
        kv = read(kv_cache[seq.key_block, :, seq.key_offset])  # [ctx, 2, kvh, d]
        keys, values = kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]  # [1, kvh, ctx, d]
    mask = seq.mask(window, q.device)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )  # [1, h, q, d]
    return out[0].transpose(0, 1)  # [q, h, d]


def _dense_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _bucket(context_lens: np.ndarray) -> np.ndarray:
    """[D] bucket of each decode's context: 0 up to 64 tokens, then one per power of two (bit_length)."""
    return np.frexp((context_lens - 1) // _MIN_BUCKET_TOKENS)[1]  # the exponent of q = m * 2**e: q's bit_length


def _prefill_seq(row: int, start: int, count: int, table: torch.Tensor, block_size: int) -> _PrefillSeq:
    if start == 0:
        return _PrefillSeq(row, row + count, 0, None, None)
    key_pos = torch.arange(start + count, device=table.device)  # [ctx]
    return _PrefillSeq(row, row + count, start, table[key_pos // block_size], key_pos % block_size)


def _decode_group(members: np.ndarray, first_rows: np.ndarray, batch: StepBatch) -> _DecodeGroup:
    device = batch.block_table.device
    num_blocks = -(-int(batch.context_lens_host[members].max()) // batch.block_size)
    index = to_device(members, device)  # [B]
    return _DecodeGroup(
        to_device(first_rows[members], device),
        batch.block_table.index_select(0, index)[:, :num_blocks],  # [B, nb]
        batch.context_lens.index_select(0, index),
    )
