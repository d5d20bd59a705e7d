"""KV between workers of different tensor-parallel degrees (``kv_transfer/tp_plane.py``) over real tcp servers:
each serving rank serves its own heads on its own URI; the pulling side reads every rank and places the heads
into its own ranks, whatever the two degrees."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from kv_transfer.errors import KVTransferError, LayoutMismatch
from kv_transfer.layout import KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.staging import KVRegion
from kv_transfer.tp_plane import pull_ranks, rank_uris, tag_uri, uri_rank
from kv_transfer.transport import TransportConfig, connect, make_server

LAYOUT = KVLayout(model_fingerprint=b"tp", dtype="float32", block_size=4, num_layers=2, num_kv_heads=4, head_dim=3)
INT8 = dataclasses.replace(LAYOUT, dtype="uint8", scale_bytes=4)  # a quantized cache: 3 values and a scale per row
CONFIG = TransportConfig(connect_timeout_s=2.0, io_timeout_s=2.0)
NUM_BLOCKS = 12
SENTINEL = 0xAB


def _whole(seed: int, base: KVLayout = LAYOUT) -> np.ndarray:
    """A whole model's cache as bytes: [layers, blocks, 2, block_size, kv heads, row bytes]."""
    shape = (base.num_layers, NUM_BLOCKS, 2, base.block_size, base.num_kv_heads, base.row_bytes)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _regions(whole: np.ndarray, tp_size: int, base: KVLayout = LAYOUT) -> list[KVRegion]:
    """Each rank's cache of a worker of ``tp_size`` ranks: its slice of the heads, contiguous."""
    layout, heads = dataclasses.replace(base, tp_size=tp_size), base.num_kv_heads // tp_size
    slices = [np.ascontiguousarray(whole[..., r * heads : (r + 1) * heads, :]) for r in range(tp_size)]
    return [KVRegion(layout.for_rank(r), torch.from_numpy(part)) for r, part in enumerate(slices)]


def _reassembled(regions: list[KVRegion]) -> np.ndarray:
    """The whole cache again, from the ranks' caches."""
    layout = regions[0].layout
    shape = (layout.num_layers, NUM_BLOCKS, 2, layout.block_size, layout.local_kv_heads, layout.row_bytes)
    return np.concatenate([r.kv.numpy().reshape(shape) for r in regions], axis=4)


async def _serve(regions: list[KVRegion], table: LeaseTable) -> tuple[list, str]:
    servers = [make_server("tcp", buffer=r.host_buffer(), resolve=table.resolver(lambda: 0.0), config=CONFIG)
               for r in regions]
    uris = [await s.start("127.0.0.1", 0) for s in servers]
    tagged = uris if len(uris) == 1 else [tag_uri(u, r) for r, u in enumerate(uris)]
    return servers, " ".join(tagged)


async def _transfer(src_tp: int, dst_tp: int, src_ids, dst_ids, *, uris_of=None, dst_layout=LAYOUT, base=LAYOUT):
    prefill, decode = _regions(_whole(1, base), src_tp, base), _regions(np.full_like(_whole(2, base), SENTINEL),
                                                                        dst_tp, base)
    if dst_layout is not LAYOUT:
        decode = [KVRegion(dataclasses.replace(dst_layout, tp_size=dst_tp, tp_rank=r), d.kv) for r, d in
                  enumerate(decode)]
    table = LeaseTable()
    lease = table.create(src_ids, now=0.0)
    servers, offered = await _serve(prefill, table)
    client = connect("tcp://", CONFIG)
    try:
        uris = (uris_of or rank_uris)(offered, "tcp", src_tp)

        async def pull_rank(uri, layout, buffer, ids):
            return await client.pull(uri, layout, lease.lease_id, src_ids, buffer, ids)

        stats = await pull_ranks(pull_rank, uris, prefill[0].layout, decode, [d.host_buffer() for d in decode],
                                 src_ids, dst_ids)
    finally:
        client.close()
        for server in servers:
            await server.stop()
    return prefill, decode, stats


@pytest.mark.parametrize("src_tp, dst_tp, base", [(2, 1, LAYOUT), (1, 2, LAYOUT), (2, 2, LAYOUT), (4, 2, LAYOUT),
                                                  (1, 4, LAYOUT), (4, 1, LAYOUT), (2, 1, INT8), (1, 4, INT8)])
def test_blocks_land_whole_whatever_the_two_degrees(src_tp, dst_tp, base):
    src_ids, dst_ids = [3, 4, 5, 9], [7, 0, 1, 2]
    prefill, decode, stats = asyncio.run(asyncio.wait_for(_transfer(src_tp, dst_tp, src_ids, dst_ids, base=base),
                                                          20))
    sent, landed = _reassembled(prefill), _reassembled(decode)
    assert np.array_equal(landed[:, dst_ids], sent[:, src_ids])  # every head of every block, in its place
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert (landed[:, untouched] == SENTINEL).all()
    assert stats.num_blocks == 4 and stats.num_bytes == 4 * base.bytes_per_block  # the whole model's bytes once


def test_a_layout_of_another_model_is_refused_before_any_byte_moves():
    other = dataclasses.replace(LAYOUT, model_fingerprint=b"other")
    with pytest.raises(LayoutMismatch, match="model_fingerprint"):
        asyncio.run(asyncio.wait_for(_transfer(2, 1, [1], [1], dst_layout=other), 20))


def test_a_rank_server_refuses_a_reader_that_expects_another_rank():
    """Each rank's layout names its rank: URIs given in the wrong order are refused by the servers."""
    def swapped(offered, kind, tp_size):
        return rank_uris(offered, kind, tp_size)[::-1]

    with pytest.raises(LayoutMismatch, match="tp_rank"):
        asyncio.run(asyncio.wait_for(_transfer(2, 2, [1], [1], uris_of=swapped), 20))


def test_rank_uris_are_tagged_and_found_in_rank_order():
    cma = tag_uri("cma://127.0.0.1:5001?boot=ab12", 1)
    assert uri_rank(cma) == 1 and "boot=ab12" in cma and uri_rank("tcp://h:1") == 0
    offered = f"{tag_uri('tcp://h:2', 1)} {cma} {tag_uri('tcp://h:1', 0)}"
    assert rank_uris(offered, "tcp", 2) == [tag_uri("tcp://h:1", 0), tag_uri("tcp://h:2", 1)]
    with pytest.raises(KVTransferError, match=r"ranks \[1\] of 2"):
        rank_uris("tcp://h:1", "tcp", 2)


def test_layout_json_names_the_degree_only_when_there_is_one():
    assert LAYOUT.to_json() == KVLayout.from_json(LAYOUT.to_json()).to_json() and "tp_" not in LAYOUT.to_json()
    rank1 = dataclasses.replace(LAYOUT, tp_size=2, tp_rank=1)
    assert '"tp_rank":1' in rank1.to_json() and '"tp_size":2' in rank1.to_json()
    assert KVLayout.from_json(rank1.to_json()) == rank1
    assert rank1.local_kv_heads == 2 and rank1.model_bytes_per_block == LAYOUT.bytes_per_block
    assert rank1.bytes_per_block == LAYOUT.bytes_per_block // 2
    rank1.check_same_model(LAYOUT)
    with pytest.raises(LayoutMismatch, match="tp_size"):
        rank1.check_compatible(LAYOUT.for_rank(0))
    with pytest.raises(ValueError, match="tp_size must divide num_kv_heads"):
        dataclasses.replace(LAYOUT, tp_size=3)
    with pytest.raises(ValueError, match="tp_rank must be below"):
        dataclasses.replace(LAYOUT, tp_size=2, tp_rank=2)


def test_every_ranks_server_follows_a_layer_wise_lease_until_its_layers_are_computed():
    """A worker's KV plane serves rank 1 as it serves rank 0: a lease still computing is streamed layer by
    layer as rank 0's hooks complete them (every rank has written layer i by then), never sent early."""
    from kv_transfer.progress import LayerProgress
    from worker.kv_plane import KVPlane
    from worker.leases import WorkerLeases

    async def scenario():
        prefill, decode = _regions(_whole(1), 2), _regions(np.full_like(_whole(2), SENTINEL), 2)
        leases = WorkerLeases(30.0, lambda block_ids: None)
        plane = KVPlane(prefill[0], ("tcp",), "auto", leases, 4, rank_regions=prefill[1:])
        server = plane.server("tcp", CONFIG, rank=1)
        uri = tag_uri(await server.start("127.0.0.1", 0), 1)
        progress = LayerProgress(LAYOUT.num_layers)
        lease = leases.pin_admitted("r", [3, 4], progress)
        client = connect("tcp://", CONFIG)
        try:
            pull = asyncio.ensure_future(client.pull(uri, prefill[1].layout, lease.lease_id, [3, 4],
                                                     decode[1].host_buffer(), [0, 1]))
            with pytest.raises(asyncio.TimeoutError):  # no layer computed: nothing can arrive
                await asyncio.wait_for(asyncio.shield(pull), 1.0)
            for layer in range(LAYOUT.num_layers):
                progress.complete(layer)
            await pull
        finally:
            client.close()
            await server.stop()
        return prefill, decode

    prefill, decode = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert np.array_equal(decode[1].kv.numpy()[:, :2], prefill[1].kv.numpy()[:, 3:5])


def test_a_tensor_parallel_plane_refuses_host_staging():
    from worker.kv_plane import KVPlane
    from worker.leases import WorkerLeases

    regions = _regions(_whole(1), 2)
    with pytest.raises(ValueError, match="not combined with host staging"):
        KVPlane(regions[0], ("tcp",), "always", WorkerLeases(5.0, lambda ids: None), 4, rank_regions=regions[1:])
