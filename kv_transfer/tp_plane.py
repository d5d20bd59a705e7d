"""The KV data plane between workers of different tensor-parallel degrees (P with TP=a, D with TP=b).

A worker of N ranks serves each rank's cache on its own URI per transport kind, tagged ``?tp_rank=r`` (a single
rank's URIs stay untagged), and hands out rank 0's layout; rank r's differs only in ``tp_rank``. Each rank's
cache is a whole cache of its ``num_kv_heads / N`` heads, so every transport serves it unchanged, checking
the layout (rank included) before any byte moves.

The decode side pulls a handle's blocks from every rank of the serving worker, over the first kind of its own
the server offers:
- **same degree** (a == b): rank r's blocks straight into its own rank r's cache, in place;
- **another degree**: each serving rank's blocks into a host buffer of that rank's layout, then re-cut into its
  own ranks' heads (``reshard``: the heads of every source rank side by side, split b ways), on the cache's
  device. The bytes moved are the whole model's KV of those blocks whatever the degrees; only the placement
  differs. Both sides must cache the same model alike (``KVLayout.check_same_model``), checked before any pull.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import torch

from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.staging import KVRegion
from kv_transfer.transport import TransferStats

RANK_QUERY = "tp_rank"

# (uri, the serving rank's layout, destination buffer, destination block ids) -> that rank's pull
RankPull = Callable[[str, KVLayout, KVBuffer, Sequence[int]], Awaitable[TransferStats]]


def tag_uri(uri: str, rank: int) -> str:
    """``uri`` naming the tensor-parallel rank whose cache it serves (``?tp_rank=r``, beside any other query)."""
    parts = urlsplit(uri)
    query = [(k, v) for k, values in parse_qs(parts.query).items() for v in values if k != RANK_QUERY]
    return urlunsplit(parts._replace(query=urlencode([*query, (RANK_QUERY, str(rank))])))


def uri_rank(uri: str) -> int:
    """The rank a URI serves (0 when untagged: a single-rank worker)."""
    values = parse_qs(urlsplit(uri).query).get(RANK_QUERY)
    try:
        return int(values[0]) if values else 0
    except ValueError:
        raise KVTransferError(f"bad {RANK_QUERY} in KV data-plane URI {uri!r}") from None


def rank_uris(offered: str, kind: str, tp_size: int) -> list[str]:
    """The URIs of ``kind`` in ``offered`` (space-separated) for ranks 0..tp_size-1, in rank order."""
    by_rank: dict[int, str] = {}
    for uri in offered.split():
        if urlsplit(uri).scheme == kind:
            by_rank.setdefault(uri_rank(uri), uri)
    missing = [r for r in range(tp_size) if r not in by_rank]
    if missing:
        raise KVTransferError(f"the peer's {kind}:// URIs name no server for tensor-parallel ranks {missing} "
                              f"of {tp_size}: {offered!r}")
    return [by_rank[r] for r in range(tp_size)]


async def pull_ranks(pull_rank: RankPull, uris: Sequence[str], layout: KVLayout, regions: Sequence[KVRegion],
                     buffers: Sequence[KVBuffer], src: Sequence[int], dst: Sequence[int]) -> TransferStats:
    """Pull blocks ``src`` of every serving rank (``uris`` in rank order, ``layout`` rank 0's) into this worker's
    blocks ``dst``: ``buffers`` / ``regions`` are this worker's ranks' caches (host buffers, and the caches as
    regions for re-cutting)."""
    own = regions[0].layout
    layout.check_same_model(own)
    if len(uris) != layout.tp_size:
        raise KVTransferError(f"{len(uris)} URIs for a worker of {layout.tp_size} tensor-parallel ranks")
    started = time.perf_counter()
    if layout.tp_size == own.tp_size:
        stats = await asyncio.gather(*(pull_rank(uri, layout.for_rank(r), buffers[r], dst)
                                       for r, uri in enumerate(uris)))
        return merge(stats, started)
    landing = [KVBuffer.allocate(layout.for_rank(r), len(src)) for r in range(layout.tp_size)]
    stats = await asyncio.gather(*(pull_rank(uri, layout.for_rank(r), landing[r], range(len(src)))
                                   for r, uri in enumerate(uris)))
    reshard(landing, regions, dst)
    return merge(stats, started)


def reshard(landed: Sequence[KVBuffer], regions: Sequence[KVRegion], dst: Sequence[int]) -> None:
    """Re-cut blocks landed in the source ranks' layouts (``landed[r]``: its first ``len(dst)`` blocks) into the
    heads of this worker's ranks (``regions``, rank order) at blocks ``dst``."""
    src_layout, layout = landed[0].layout, regions[0].layout
    num_layers, n, bs, row = layout.num_layers, len(dst), layout.block_size, layout.row_bytes
    parts = [torch.from_numpy(b.array[:, :n]).view(num_layers, n, 2, bs, src_layout.local_kv_heads, row)
             for b in landed]
    whole = torch.cat(parts, dim=4)  # [layers, n, 2, block_size, num_kv_heads, row bytes]: every head, in order
    heads = layout.local_kv_heads
    for rank, region in enumerate(regions):
        cache = region.kv.view(num_layers, region.num_blocks, 2, bs, heads, row)  # [L, blocks, 2, bs, h, row]
        index = torch.tensor(list(dst), dtype=torch.int64, device=cache.device)
        cache.index_copy_(1, index, whole[:, :, :, :, rank * heads : (rank + 1) * heads].to(cache.device))


def merge(stats: Sequence[TransferStats], started: float) -> TransferStats:
    """The ranks' pulls as one: their bytes together, from the first start until the last byte."""
    first_layers = [s.first_layer_s for s in stats]
    return TransferStats(
        num_blocks=stats[0].num_blocks, num_bytes=sum(s.num_bytes for s in stats),
        seconds=time.perf_counter() - started,
        first_layer_s=None if None in first_layers else max(first_layers),
        started_unix_s=min(s.started_unix_s for s in stats),
    )

