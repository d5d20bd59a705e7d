"""Exact argmax / argmin and top-k of long rows in two levels: each row's chunk maxima first (a fast vectorised
reduction), then only the chunks that can hold the answer. On a CPU a full-row ``argmax`` or ``topk`` over
a 150k vocabulary costs several times a chunked ``amax``; the answers are the same.

argmax: with contiguous chunks, the first chunk holding the row's max, then the first max inside it, is
the row's first max (as ``torch.argmax`` has it, NaN included). top-k: chunks may be any partition (here
columns j, j + M, j + 2M, ...: their maxima are one fast column-wise reduction). Fewer than k elements
exceed the k-th largest value v, so fewer than k chunks have a max above v; the k chunks with the largest
maxima therefore hold at least k elements >= v, hence the row's k largest values (ties at v may be other
ids of the same value).
"""

from __future__ import annotations

import math

import torch

ARGMAX_CHUNK = 128
SMALL_NUMEL = 1 << 16  # below this many elements one plain argmax is cheaper than the extra ops
MIN_CHUNK = 8  # smaller top-k chunks: one plain topk is as fast


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [B, V], exact (first index of the max). Token ids [B]."""
    return _arg_extreme(logits, largest=True)


def argmin(values: torch.Tensor) -> torch.Tensor:
    """``values.argmin(dim=-1)`` of [B, V], exact (first index of the min). Ids [B]."""
    return _arg_extreme(values, largest=False)


def _arg_extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
    num_rows, vocab_size = values.shape
    arg = torch.argmax if largest else torch.argmin
    if vocab_size < 4 * ARGMAX_CHUNK or values.numel() < SMALL_NUMEL:
        return arg(values, dim=-1)  # [B]
    extremes = _chunk_extremes(values, ARGMAX_CHUNK, torch.amax if largest else torch.amin)  # [B, M]
    columns = _chunk_columns(arg(extremes, dim=-1, keepdim=True), ARGMAX_CHUNK).squeeze(1)  # [B, c]
    chunk = _gather_columns(values, columns, ARGMAX_CHUNK, float("-inf") if largest else float("inf"))  # [B, c]
    return columns.gather(-1, arg(chunk, dim=-1, keepdim=True)).squeeze(-1)  # [B]


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of logits [B, V], descending, and their ids: [B, k] x2."""
    num_rows, vocab_size = logits.shape
    chunk = topk_chunk(k, vocab_size)
    if chunk is None:
        return logits.topk(k, dim=-1)  # [B, k] x2
    num_chunks = vocab_size // chunk  # M; chunk j holds the columns j, j + M, j + 2M, ...
    main = logits[:, : num_chunks * chunk].view(num_rows, chunk, num_chunks)  # [B, c, M]
    chosen = main.amax(dim=1).topk(k, dim=-1, sorted=False).indices  # [B, k]
    columns = chosen[:, :, None] + torch.arange(chunk, device=logits.device) * num_chunks  # [B, k, c]
    columns = columns.flatten(1)  # [B, k * c]
    if num_chunks * chunk < vocab_size:  # the last V mod c columns join the pool as they are
        tail = torch.arange(num_chunks * chunk, vocab_size, device=logits.device)  # [r]
        columns = torch.cat((columns, tail.expand(num_rows, -1)), dim=-1)  # [B, k * c + r]
    values, at = logits.gather(-1, columns).topk(k, dim=-1)  # [B, k] x2
    return values, columns.gather(-1, at)  # [B, k] x2


def topk_chunk(k: int, vocab_size: int) -> int | None:
    """The chunk size for a two-level top-k: about sqrt(V / k), which balances the chunk maxima's top-k
    against the pool's; None (one plain ``topk``) when the pool would be over half the row."""
    chunk = 1 << round(math.log2(math.sqrt(vocab_size / k)))
    return chunk if chunk >= MIN_CHUNK and 2 * k * chunk <= vocab_size else None


def _chunk_extremes(values: torch.Tensor, chunk: int, reduce) -> torch.Tensor:
    """``reduce`` (amax / amin) of each run of ``chunk`` columns [B, M]; a shorter last run is a chunk too."""
    num_rows, vocab_size = values.shape
    num_full = vocab_size // chunk
    extremes = reduce(values[:, : num_full * chunk].view(num_rows, num_full, chunk), dim=-1)  # [B, M]
    if num_full * chunk == vocab_size:
        return extremes
    tail = reduce(values[:, num_full * chunk :], dim=-1, keepdim=True)  # [B, 1]
    return torch.cat((extremes, tail), dim=-1)  # [B, M + 1]


def _chunk_columns(chunks: torch.Tensor, chunk: int) -> torch.Tensor:
    """The column ids of contiguous chunks [B, n]: [B, n, chunk] (a last, shorter one runs past V)."""
    return chunks[:, :, None] * chunk + torch.arange(chunk, device=chunks.device)  # [B, n, c]


def _gather_columns(logits: torch.Tensor, columns: torch.Tensor, chunk: int,
                    fill: float = float("-inf")) -> torch.Tensor:
    """logits at the columns [B, N] of whole chunks; columns past the vocabulary read ``fill``."""
    vocab_size = logits.shape[-1]
    if vocab_size % chunk == 0:
        return logits.gather(-1, columns)  # [B, N] no chunk runs past V
    values = logits.gather(-1, columns.clamp(max=vocab_size - 1))  # [B, N]
    return values.masked_fill(columns >= vocab_size, fill)  # [B, N]
