"""Reference attention on any device: gather the paged KV, then SDPA.

Decode sequences (one query token) are bucketed by context length (powers of two from 64), so a
step costs a handful of batched gathers + SDPA calls per layer with at most 2x padding, instead of
one call per sequence or padding everyone to the longest context. Prefill chunks attend one
sequence at a time (there are few per step); a chunk with no cached context skips the gather.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import SeqSlice

_MIN_BUCKET_TOKENS = 64


@dataclass(slots=True)
class _DecodeGroup:
    token_index: torch.Tensor  # [B] flat index of each sequence's query token
    block_table: torch.Tensor  # [B, nb] each sequence's blocks, padded with block 0 (masked)
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


class TorchAttentionBackend:
    name = "torch"

    def build_metadata(self, slices: Sequence[SeqSlice], block_size: int, device: torch.device) -> TorchAttentionMetadata:
        tables = _block_tables(slices, device)  # [S, max_blocks]
        num_new = torch.tensor([s.num_new_tokens for s in slices], device=device)  # [S]
        starts = torch.tensor([s.start for s in slices], device=device)  # [S]
        seq_of_token = torch.repeat_interleave(torch.arange(len(slices), device=device), num_new)  # [T]
        first_row = torch.cumsum(num_new, 0) - num_new  # [S]
        positions = starts[seq_of_token] + torch.arange(seq_of_token.numel(), device=device) - first_row[seq_of_token]
        buckets: dict[int, list[int]] = defaultdict(list)
        prefills: list[_PrefillSeq] = []
        row = 0
        for i, s in enumerate(slices):
            if s.num_new_tokens == 1:
                buckets[((s.context_len - 1) // _MIN_BUCKET_TOKENS).bit_length()].append(i)
            else:
                prefills.append(_prefill_seq(row, s, tables[i], block_size))
            row += s.num_new_tokens
        rows = first_row.tolist()
        groups = [_decode_group(idx, slices, rows, tables, block_size) for _, idx in sorted(buckets.items())]
        return TorchAttentionMetadata(
            tables[seq_of_token, positions // block_size], positions % block_size, groups, prefills
        )

    def forward(self, q, k, v, kv_cache, metadata: TorchAttentionMetadata, window, scale):
        # kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]
        kv_cache[metadata.slot_block, :, metadata.slot_offset] = torch.stack((k, v), dim=1)  # [T, 2, kvh, d]
        out = torch.empty_like(q)  # [T, h, d]
        for group in metadata.decode_groups:
            out[group.token_index] = _decode_attention(q, kv_cache, group, window, scale)
        for seq in metadata.prefills:
            out[seq.token_start : seq.token_end] = _prefill_attention(q, k, v, kv_cache, seq, window, scale)
        return out


def _decode_attention(q, kv_cache, group: _DecodeGroup, window, scale) -> torch.Tensor:
    """Whole-block gather (one index_select), then GQA as a batched matmul: each KV head's group of
    query heads attends at once, so K/V are never repeated per query head."""
    num_seqs, num_blocks = group.block_table.shape
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    length = num_blocks * block_size
    blocks = kv_cache.index_select(0, group.block_table.reshape(-1))  # [B*nb, 2, bs, kvh, d]
    blocks = blocks.view(num_seqs, num_blocks, 2, block_size, num_kv_heads, head_dim)
    keys = blocks[:, :, 0].permute(0, 3, 1, 2, 4).reshape(num_seqs, num_kv_heads, length, head_dim)  # [B, kvh, L, d]
    values = blocks[:, :, 1].permute(0, 3, 1, 2, 4).reshape(num_seqs, num_kv_heads, length, head_dim)
    query = q[group.token_index].view(num_seqs, num_kv_heads, -1, head_dim)  # [B, kvh, h/kvh, d]
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale  # [B, kvh, h/kvh, L]
    mask = group.mask(window, block_size).view(num_seqs, 1, 1, length)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(values.dtype)
    return torch.matmul(probs, values).reshape(num_seqs, -1, head_dim)  # [B, h, d]


def _prefill_attention(q, k, v, kv_cache, seq: _PrefillSeq, window, scale) -> torch.Tensor:
    rows = slice(seq.token_start, seq.token_end)
    query = q[rows].transpose(0, 1)  # [h, q, d]
    if seq.key_block is None:
        keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [kvh, q, d]
    else:
        kv = kv_cache[seq.key_block, :, seq.key_offset]  # [ctx, 2, kvh, d]
        keys, values = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [kvh, ctx, d]
    mask = seq.mask(window, q.device)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )  # [h, q, d]
    return out.transpose(0, 1)  # [q, h, d]


def _block_tables(slices: Sequence[SeqSlice], device) -> torch.Tensor:
    width = max(len(s.block_ids) for s in slices)
    padded = [list(s.block_ids) + [0] * (width - len(s.block_ids)) for s in slices]
    return torch.tensor(padded, dtype=torch.int64, device=device)  # [S, width]


def _prefill_seq(row: int, s: SeqSlice, table: torch.Tensor, block_size: int) -> _PrefillSeq:
    if s.start == 0:
        return _PrefillSeq(row, row + s.num_new_tokens, 0, None, None)
    key_pos = torch.arange(s.context_len, device=table.device)  # [ctx]
    return _PrefillSeq(row, row + s.num_new_tokens, s.start, table[key_pos // block_size], key_pos % block_size)


def _decode_group(members: list[int], slices, rows: list[int], tables: torch.Tensor, block_size: int) -> _DecodeGroup:
    device = tables.device
    num_blocks = -(-max(slices[i].context_len for i in members) // block_size)
    index = torch.tensor(members, device=device)  # [B]
    return _DecodeGroup(
        torch.tensor([rows[i] for i in members], device=device),
        tables[index, :num_blocks],  # [B, nb] (padding entries are block 0; masked)
        torch.tensor([slices[i].context_len for i in members], device=device),
    )
