"""GPU-direct serving, decided per transport kind (``kv_transfer/staging.py`` ``staged_kinds``,
``worker/kv_plane.py``): a device-resident cache is served and pulled in place by nixl, ucx and nccl (a
``TensorKVBuffer``) and through host staging by tcp and cma; ``--kv-staging always`` stages every kind.

No GPU here, so the device is played two ways: a region on torch's ``meta`` device (the decision and the
wiring; no bytes) and a CPU cache that says it is not on the host (``DeviceLike``: the whole device path moves
real bytes, every line but the CUDA calls). One handle (cache block ids) serves a staged kind and an in-place
kind at once. nixl's case runs in nixl's own pytest process (tests/unit/test_kv_nixl.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kv_transfer import nccl, rows
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.staging import KVRegion, staged_kinds
from kv_transfer.tensor_buffer import IN_PLACE_KINDS, TensorKVBuffer
from kv_transfer.transport import TransportConfig, connect, kind_available, make_server
from worker.kv_plane import KVPlane
from worker.leases import WorkerLeases

LAYOUT = KVLayout(model_fingerprint=b"in-place", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2,
                  head_dim=8)
CONFIG = TransportConfig(connect_timeout_s=3.0, io_timeout_s=3.0)
SHAPE = (LAYOUT.num_layers, 16, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)  # the engine's


def _kind(kind: str):
    if kind == "nixl":
        from tests.unit.test_kv_nixl import nixl_skip_reason  # in a process of its own

        why = nixl_skip_reason()
    else:
        why = kind_available(kind)
    return pytest.param(kind, marks=pytest.mark.skipif(why is not None, reason=why or ""))


IN_PLACE = [_kind(k) for k in sorted(IN_PLACE_KINDS)]


class DeviceLike(KVRegion):
    """A CPU cache that is not on the host as far as the decision goes: served as a device cache would be."""

    is_host = False


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_a_device_cache_is_staged_only_for_the_kinds_that_cannot_move_device_memory():
    region = KVRegion(LAYOUT, torch.empty(SHAPE, device="meta"))
    assert not region.is_host
    kinds = ("nixl", "tcp", "ucx", "cma", "nccl")
    assert staged_kinds(kinds, region, "auto") == {"tcp", "cma"}
    assert staged_kinds(kinds, region, "always") == set(kinds)
    assert staged_kinds(("nixl", "nccl"), region, "auto") == set()  # GPU-direct only: no staging pool
    host = KVRegion(LAYOUT, torch.zeros(SHAPE))
    assert staged_kinds(kinds, host, "auto") == set() and staged_kinds(kinds, host, "always") == set(kinds)


def test_the_plane_wires_each_kind_to_the_cache_or_to_staging():
    region = KVRegion(LAYOUT, torch.empty(SHAPE, device="meta"))
    leases = WorkerLeases(ttl_s=5.0, free=lambda _: None)
    plane = KVPlane(region, ("ucx", "tcp", "nccl"), "auto", leases, staging_blocks=4)
    assert plane.staged == {"tcp"} and plane.pool is not None and leases.staged is not None
    tcp = plane.server("tcp", CONFIG)
    assert tcp.buffer is plane.pool.buffer and tcp.locate == leases.staged.locate
    for kind in ("ucx", "nccl"):
        server = plane.server(kind, CONFIG)
        assert isinstance(server.buffer, TensorKVBuffer) and server.buffer.tensor.device.type == "meta"
        assert getattr(server, "locate", None) is None  # reads the cache's own ids
    assert KVPlane(region, ("nixl",), "auto", WorkerLeases(5.0, lambda _: None), 4).pool is None
    everything = KVPlane(region, ("ucx", "tcp"), "always", WorkerLeases(5.0, lambda _: None), 4)
    assert everything.buffer("ucx") is everything.buffer("tcp") is everything.pool.buffer


def test_host_only_kinds_refuse_a_device_buffer_before_anything_moves():
    device = TensorKVBuffer(LAYOUT, torch.zeros((3, 4, LAYOUT.bytes_per_block_per_layer), dtype=torch.uint8))
    for kind in ("tcp", "cma"):
        with pytest.raises(ValueError, match="host memory only"):
            make_server(kind, buffer=device, resolve=lambda _: [0])
    client = connect("tcp://")
    with pytest.raises(KVTransferError, match="host memory only"):
        run(client.pull("tcp://127.0.0.1:1", LAYOUT, "lease", [0], device, [0]))
    client.close()
    with pytest.raises(ValueError):
        TensorKVBuffer(LAYOUT, torch.zeros((3, 4, 7), dtype=torch.uint8))  # not this layout's segments


class Worker:
    """A worker's data plane on a device-like cache: its leases, its plane, a server and a client per kind."""

    def __init__(self, kinds: tuple[str, ...], seed: int, mode: str = "auto") -> None:
        cache = torch.from_numpy(np.random.default_rng(seed).standard_normal(SHAPE, dtype=np.float32))
        self.region = DeviceLike(LAYOUT, cache if seed else torch.zeros(SHAPE))
        self.freed: list[int] = []
        self.leases = WorkerLeases(ttl_s=30.0, free=self.freed.extend)
        self.plane = KVPlane(self.region, kinds, mode, self.leases, staging_blocks=8)
        self.servers = {kind: self.plane.server(kind, CONFIG) for kind in kinds}
        self.clients = {kind: connect(f"{kind}://", CONFIG) for kind in kinds}
        self.uris: dict[str, str] = {}

    async def start(self) -> Worker:
        self.uris = {kind: await server.start("127.0.0.1", 0) for kind, server in self.servers.items()}
        return self

    async def stop(self) -> None:
        for client in self.clients.values():
            if callable(close := getattr(client, "close", None)):
                close()
        for server in self.servers.values():
            await server.stop()

    async def pull(self, holder: Worker, kind: str, lease_id: str, src: list[int], dst: list[int]):
        return await self.plane.pull(self.clients[kind], kind, holder.uris[kind], LAYOUT, lease_id, src, dst)


@pytest.mark.parametrize("kind", IN_PLACE)
def test_one_handle_serves_a_staged_kind_and_an_in_place_kind_at_once(kind: str):
    """P serves ``kind`` GPU-direct and tcp through staging, D pulls with each: the same handle (cache ids)
    lands the same blocks. P's cache changes after the lease was staged: the in-place read sees the change,
    the staged one the copy made when the lease opened (so each kind really reads where it should)."""

    async def scenario() -> None:
        p, d = await Worker((kind, "tcp"), seed=1).start(), await Worker((kind, "tcp"), seed=0).start()
        try:
            assert p.plane.staged == d.plane.staged == {"tcp"}
            p.leases.hand_over("r1", [11, 2, 3, 7])
            lease = p.leases.take("r1")
            handle_ids = p.leases.read_ids(lease)
            assert handle_ids == [11, 2, 3, 7] and p.plane.pool.num_free == 4  # staged as it opened
            staged_copy = p.region.kv[:, handle_ids].clone()
            p.region.kv[:, 2] = 0x5A  # the cache moves on (the staged copy does not)
            await d.pull(p, "tcp", lease.lease_id, handle_ids, [5, 6, 0, 9])
            assert torch.equal(d.region.kv[:, [5, 6, 0, 9]], staged_copy)
            stats = await d.pull(p, kind, lease.lease_id, handle_ids[1:], [1, 2, 3])
            assert stats.num_blocks == 3 and torch.equal(d.region.kv[:, [1, 2, 3]], p.region.kv[:, [2, 3, 7]])
            assert d.plane.pool.num_free == d.plane.pool.num_blocks  # D's staging is back
            assert p.leases.release(lease.lease_id)
            assert p.plane.pool.num_free == p.plane.pool.num_blocks and sorted(p.freed) == [2, 3, 7, 11]
        finally:
            await p.stop()
            await d.stop()

    run(scenario())


@pytest.mark.parametrize("kind", IN_PLACE)
def test_always_stages_every_kind_of_a_device_cache(kind: str):
    async def scenario() -> None:
        p = await Worker((kind,), seed=2, mode="always").start()
        d = await Worker((kind,), seed=0, mode="always").start()
        try:
            p.leases.hand_over("r1", [4, 9])
            lease = p.leases.take("r1")
            staged_copy = p.region.kv[:, [4, 9]].clone()
            p.region.kv[:, 4] = 0x11
            await d.pull(p, kind, lease.lease_id, [4, 9], [0, 1])
            assert torch.equal(d.region.kv[:, [0, 1]], staged_copy)  # read from staging, not the cache
            p.leases.release(lease.lease_id)
            assert p.plane.pool.num_free == p.plane.pool.num_blocks == d.plane.pool.num_free
        finally:
            await p.stop()
            await d.stop()

    run(scenario())


def test_rows_pair_by_byte_offset_whatever_either_side_cuts():
    """The server lists its rows of the blocks it reads (staged: other ids than the reader's), the reader
    cuts both at each other's boundaries; the pieces copy exactly the wire-order bytes."""
    src = KVBuffer(LAYOUT, np.random.default_rng(5).integers(0, 256, LAYOUT.bytes_per_block * 12, np.uint8))
    dst = KVBuffer.allocate(LAYOUT, 12)
    server_ids, dst_ids = [3, 4, 9, 0, 1], [7, 2, 3, 4, 10]  # runs (3,2) (9,1) (0,2) vs (7,1) (2,3) (10,1)
    remote = rows.buffer_iovecs(src, server_ids)
    local, paired = rows.pair_rows(dst, dst_ids, remote, "test://")
    assert (local[:, 1] == paired[:, 1]).all() and len(local) == 5 * LAYOUT.num_layers
    copy_pieces(src, dst, local, paired)
    assert np.array_equal(dst.array[:, dst_ids], src.array[:, server_ids])
    with pytest.raises(KVTransferError, match="do not cover"):
        rows.pair_rows(dst, dst_ids[:4], remote, "test://")
    skewed = remote.copy()
    skewed[2, 1] += LAYOUT.bytes_per_block_per_layer // 2  # layer 0's last row runs into layer 1
    skewed[3, 1] -= LAYOUT.bytes_per_block_per_layer // 2
    with pytest.raises(KVTransferError, match="each layer"):
        rows.pair_rows(dst, dst_ids, skewed, "test://")


def copy_pieces(src: KVBuffer, dst: KVBuffer, local: np.ndarray, remote: np.ndarray) -> None:
    """What a one-sided READ of the paired rows does: a memcpy per piece, by address."""
    for (to, n), (frm, _) in zip(local.tolist(), remote.tolist()):
        dst.array.reshape(-1)[to - dst.base_ptr : to - dst.base_ptr + n] = src.array.reshape(-1)[
            frm - src.base_ptr : frm - src.base_ptr + n]


def test_rows_of_whole_blocks_pair_as_the_general_cut_does_and_copy_the_same_bytes():
    """A server lists whole blocks, so the reader pairs them block by block (``_pair_blocks``): the pieces equal
    the general cut's (``_pair_cuts``) and those built from the server's geometry alone (``paired_rows``), rows
    split into single blocks pair to the same pieces, a piece never crosses a layer (the last case: both sides
    are contiguous across every layer)."""
    rng = np.random.default_rng(11)
    num_blocks, seg = 24, LAYOUT.bytes_per_block_per_layer
    src = KVBuffer(LAYOUT, rng.integers(0, 256, LAYOUT.bytes_per_block * num_blocks, np.uint8))
    cases = [(sorted(rng.choice(num_blocks, n, replace=False).tolist()), rng.choice(num_blocks, n, replace=False))
             for n in (1, 2, 5, 9, 17, 24)]
    cases += [(list(range(4, 14)), np.arange(10)), (list(range(num_blocks)), np.arange(num_blocks))]
    for server_ids, dst_ids in cases:
        dst_ids = [int(b) for b in dst_ids]
        remote = rows.buffer_iovecs(src, server_ids)
        dst = KVBuffer.allocate(LAYOUT, num_blocks)
        local, paired = rows.pair_rows(dst, dst_ids, remote, "test://")
        general = rows._pair_cuts(dst, dst_ids, remote, remote[:, 1].astype(np.int64), "test://")
        assert np.array_equal(local, general[0]) and np.array_equal(paired, general[1])
        known = rows.paired_rows(dst, dst_ids, src.base_ptr, num_blocks, server_ids)  # nixl's posted read
        assert np.array_equal(local, known[0]) and np.array_equal(paired, known[1])
        single = rows.split_rows(remote, remote, seg)[1]  # the same bytes, a row per block
        assert all(np.array_equal(a, b) for a, b in zip(rows.pair_rows(dst, dst_ids, single, "test://"),
                                                        (local, paired)))
        copy_pieces(src, dst, local, paired)
        assert np.array_equal(dst.array[:, dst_ids], src.array[:, server_ids])
    assert len(local) == LAYOUT.num_layers  # every block in order: a piece per layer, though the layers touch
    rows_of = lambda ids: rows.buffer_iovecs(src, ids).reshape(LAYOUT.num_layers, -1, 2)  # noqa: E731
    uneven = np.concatenate([rows_of([3, 4, 5])[0], rows_of([3, 9, 5])[1], rows_of([3, 4, 5])[2]])
    with pytest.raises(KVTransferError, match="each layer"):  # whole blocks, but layer 1 read from elsewhere
        rows.pair_rows(KVBuffer.allocate(LAYOUT, num_blocks), [0, 1, 2], uneven, "test://")


def test_an_nccl_plan_must_partition_the_destination_into_runs():
    data = lambda counts: b"\0" * 8 + nccl.encode_plan(counts)  # noqa: E731 - DATA: u64 bytes, then the plan
    assert nccl.decode_plan("u", data([2, 1, 1]), [5, 6, 0, 9]) == [(5, 2), (0, 1), (9, 1)]
    for counts in ([1, 2, 1], [4], [2, 1], [2, 0, 2]):  # a run across a gap, too few or empty runs
        with pytest.raises(KVTransferError, match="plan"):
            nccl.decode_plan("u", data(counts), [5, 6, 0, 9])
    with pytest.raises(KVTransferError, match="malformed DATA plan"):
        nccl.decode_plan("u", b"\0" * 9, [5])
