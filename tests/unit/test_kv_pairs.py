"""The transport of a worker pair (kv_transfer/pairs.py), against real in-process cma and tcp servers over one
buffer: a transport whose handshake shows it cannot work for the pair (a cma server in another PID namespace)
is fallen through within the same pull, remembered for the pair and reported once; a request's own failure
(an expired lease) is not a transport's and falls through nothing; an unreachable peer fails at once for a while."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from kv_transfer.errors import KVTransferError, LeaseNotFound, PeerUnreachable, TransportUnusable
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.pairs import Fallthrough, PairTransports
from kv_transfer.transport import TransportConfig, connect, kind_available, make_server

pytestmark = pytest.mark.skipif(kind_available("cma") is not None, reason=kind_available("cma") or "")

LAYOUT = KVLayout(model_fingerprint=b"pairs", dtype="float16", block_size=4, num_layers=2, num_kv_heads=2,
                  head_dim=8)
CONFIG = TransportConfig(connect_timeout_s=2.0, io_timeout_s=2.0)
NUM_BLOCKS = 16


class Peer:
    """A serving worker's data plane: cma and tcp servers over one buffer of random blocks."""

    def __init__(self) -> None:
        rng = np.random.default_rng(5)
        self.src = KVBuffer(LAYOUT, rng.integers(0, 256, LAYOUT.bytes_per_block * NUM_BLOCKS, dtype=np.uint8))
        self.table = LeaseTable()
        resolve = self.table.resolver(lambda: 0.0)
        self.servers = {kind: make_server(kind, buffer=self.src, resolve=resolve, config=CONFIG)
                        for kind in ("cma", "tcp")}
        self.offered = ""

    async def __aenter__(self) -> Peer:
        self.offered = " ".join([await self.servers["cma"].start(), await self.servers["tcp"].start()])
        return self

    async def __aexit__(self, *exc) -> None:
        for server in self.servers.values():
            await server.stop()

    def lease(self) -> str:
        return self.table.create(range(NUM_BLOCKS), now=0.0).lease_id


class Puller:
    """The pulling side: a client per kind, pulls into its own buffer."""

    def __init__(self) -> None:
        self.dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
        self.clients = {kind: connect(f"{kind}://", CONFIG) for kind in ("cma", "tcp")}

    def pull(self, lease_id: str, src: list[int], dst: list[int]):
        async def pull(uri: str):
            return await self.clients[uri.split(":")[0]].pull(uri, LAYOUT, lease_id, src, self.dst, dst)

        return pull

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30.0))


def test_a_cma_peer_in_another_pid_namespace_is_fallen_through_remembered_and_reported_once() -> None:
    events: list[Fallthrough] = []

    async def scenario() -> None:
        async with Peer() as peer:
            peer.servers["cma"].pid_namespace = 1  # what a server in another PID namespace advertises
            pairs, puller = PairTransports(("cma", "tcp"), events.append), Puller()
            assert pairs.chosen(peer.offered).startswith("cma://")  # nothing known yet: the puller's first kind
            for src, dst in (([1, 2, 3], [4, 5, 6]), ([7], [0])):
                stats, uri = await pairs.pull("p0", peer.offered, puller.pull(peer.lease(), src, dst))
                assert uri.startswith("tcp://") and stats.num_bytes == len(src) * LAYOUT.bytes_per_block
                assert np.array_equal(puller.dst.array[:, dst], peer.src.array[:, src])  # the KV moved, over tcp
            assert pairs.chosen(peer.offered).startswith("tcp://")
            assert peer.servers["cma"].num_accepted == 1  # the second pull went straight to tcp
            puller.close()

    run(scenario())
    assert [(e.peer, e.kind, e.reason, e.next_kind) for e in events] == [("p0", "cma", "pid_namespace", "tcp")]
    assert "another pid namespace" in events[0].detail


def test_a_pair_whose_first_choice_works_keeps_it_and_reports_nothing() -> None:
    events: list[Fallthrough] = []

    async def scenario() -> None:
        async with Peer() as peer:
            pairs, puller = PairTransports(("cma", "tcp"), events.append), Puller()
            _, uri = await pairs.pull("p0", peer.offered, puller.pull(peer.lease(), [1], [1]))
            assert uri.startswith("cma://") and peer.servers["tcp"].num_accepted == 0
            puller.close()

    run(scenario())
    assert events == []


def test_a_requests_own_failure_falls_through_nothing() -> None:
    events: list[Fallthrough] = []

    async def scenario() -> None:
        async with Peer() as peer:
            pairs, puller = PairTransports(("cma", "tcp"), events.append), Puller()
            with pytest.raises(LeaseNotFound):
                await pairs.pull("p0", peer.offered, puller.pull("no-such-lease", [1], [1]))
            assert pairs.chosen(peer.offered).startswith("cma://") and peer.servers["tcp"].num_accepted == 0
            puller.close()

    run(scenario())
    assert events == []


def test_when_no_transport_is_left_the_error_names_each_and_why() -> None:
    async def refuse(uri: str):
        raise TransportUnusable(f"{uri} cannot work here", "test_reason")

    events: list[Fallthrough] = []
    pairs = PairTransports(("cma", "tcp"), events.append)
    offered = "cma://10.0.0.1:1 tcp://10.0.0.1:2"
    with pytest.raises(KVTransferError, match=r"no KV transport works between this worker and p0: cma: test_reason"
                                              r".*tcp: test_reason"):
        run(pairs.pull("p0", offered, refuse))
    assert [(e.kind, e.next_kind) for e in events] == [("cma", "tcp"), ("tcp", None)]
    assert pairs.chosen(offered) is None
    assert pairs.chosen("cma://10.0.0.2:1 tcp://10.0.0.2:2").startswith("cma://")  # another peer: judged afresh


def test_only_so_many_degraded_pairs_are_remembered() -> None:
    async def refuse_cma(uri: str):
        if uri.startswith("cma://"):
            raise TransportUnusable("no", "test_reason")
        return uri

    pairs = PairTransports(("cma", "tcp"), max_pairs=2)
    offers = [f"cma://10.0.0.{i}:1 tcp://10.0.0.{i}:2" for i in range(3)]
    for offered in offers:
        run(pairs.pull("p", offered, refuse_cma))
    assert [pairs.chosen(o).split(":")[0] for o in offers] == ["cma", "tcp", "tcp"]  # the oldest was dropped


def test_an_unreachable_peer_fails_at_once_for_a_while_then_is_tried_again() -> None:
    now = [0.0]
    told: list[str] = []
    pairs = PairTransports(("tcp",), on_unreachable=lambda peer, exc: told.append(peer), unreachable_retry_s=10.0,
                           clock=lambda: now[0])
    attempts: list[str] = []
    puller = Puller()

    async def refused(uri: str):
        attempts.append(uri)
        return await puller.pull("lease", [1], [1])(uri)

    with socket.socket() as closed:  # a port nobody listens on: the connection is refused
        closed.bind(("127.0.0.1", 0))
        offered = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(PeerUnreachable, match="cannot connect to KV server tcp://127.0.0.1:.*--host"):
            run(pairs.pull("p0", offered, refused))
        now[0] = 9.0
        with pytest.raises(PeerUnreachable, match=r"\[9.0 s ago; not retried for 10 s\]"):
            run(pairs.pull("p0", offered, refused))
        assert len(attempts) == 1 and told == ["p0"]  # failed at once, reported once
        now[0] = 10.5
        with pytest.raises(PeerUnreachable):
            run(pairs.pull("p0", offered, refused))
        assert len(attempts) == 2 and told == ["p0", "p0"]  # tried again: a new spell
    puller.close()
