"""nixl:// beyond the conformance suite (tests/unit/test_kv_transport.py runs it too): a server restarted on
the same address is a new incarnation whose agent replaces the old one's; the READ's notification is what
ends the server's part (none: the pull fails, within its bound); a client that gives up mid-wait frees the
server's waiter; ``auto`` prefers nixl for a CUDA cache only.

Every nixl case (these, nixl's in test_kv_transport.py, test_kv_staging.py and test_kv_in_place.py, and the
worker-level faults of tests/integration/test_nixl_faults.py) runs in a pytest process
of its own, started by ``test_the_nixl_cases_pass_in_a_process_of_their_own`` with ``BATON_TEST_NIXL=1``: in
the main test process NIXL's bundled UCX beside ucxx's, and NIXL agents whose peers were killed, crashed it at
random later points (a SIGSEGV in ucxx's progress, in protoc, ...), as two UCX copies in one worker could.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.transport import AUTO_PREFERENCE, TransportConfig, make_server, parse_kinds

ROOT = Path(__file__).resolve().parents[2]
OWN_PROCESS = "BATON_TEST_NIXL"
NIXL_FILES = ("tests/unit/test_kv_nixl.py", "tests/unit/test_kv_transport.py", "tests/unit/test_kv_staging.py",
              "tests/unit/test_kv_in_place.py", "tests/integration/test_nixl_faults.py")
MIN_NIXL_CASES = 30  # nixl's cases in NIXL_FILES, so a collection that silently drops them fails


def nixl_skip_reason() -> str | None:
    """None in the process of nixl's own (where NIXL must import), else why nixl's cases skip here."""
    if os.environ.get(OWN_PROCESS) != "1":
        return "nixl's cases run in a process of their own (test_kv_nixl.py::test_the_nixl_cases_pass_in_a_process_of_their_own)"
    from kv_transfer.nixl import unavailable_reason

    return unavailable_reason()


own_process = pytest.mark.skipif(nixl_skip_reason() is not None, reason=nixl_skip_reason() or "")
if nixl_skip_reason() is None:
    from kv_transfer import nixl  # only in nixl's own process


def _nixl_missing() -> str | None:
    from kv_transfer.nixl import INSTALL_HINT, installed  # installed() does not import NIXL

    if os.environ.get(OWN_PROCESS) == "1":
        return "this is nixl's own process"
    return None if installed() else INSTALL_HINT


@pytest.mark.skipif(_nixl_missing() is not None, reason=_nixl_missing() or "")
def test_the_nixl_cases_pass_in_a_process_of_their_own() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NIXL_FILES, "-k", "nixl"],
                          cwd=ROOT, env={**os.environ, OWN_PROCESS: "1"}, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= MIN_NIXL_CASES and " failed" not in proc.stdout, tail

LAYOUT = KVLayout(model_fingerprint=b"nixl", dtype="float16", block_size=8, num_layers=4, num_kv_heads=2, head_dim=16)
NUM_BLOCKS = 32
CONFIG = TransportConfig(connect_timeout_s=2.0, io_timeout_s=1.0)


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def filled(seed: int) -> KVBuffer:
    rng = np.random.default_rng(seed)
    return KVBuffer(LAYOUT, rng.integers(0, 256, LAYOUT.bytes_per_block * NUM_BLOCKS, dtype=np.uint8))


def lose_notifications(monkeypatch, server) -> None:
    """The server's agent still progresses (its polls of notifications drive it) but every notification is lost."""
    real = server.agent.nixl.get_new_notifs
    monkeypatch.setattr(server.agent.nixl, "get_new_notifs", lambda *a, **k: real(*a, **k) and {})


@own_process
def test_a_server_restarted_on_its_address_is_a_new_incarnation_whose_agent_replaces_the_old() -> None:
    async def scenario() -> None:
        table = LeaseTable()
        first = make_server("nixl", buffer=filled(1), resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri = await first.start()
        client = nixl.NixlClient(CONFIG)
        try:
            dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
            await client.pull(uri, LAYOUT, table.create([1, 2], now=0.0).lease_id, [1, 2], dst, [5, 6])
            assert np.array_equal(dst.array[:, [5, 6]], first.buffer.array[:, [1, 2]])
            await first.stop()  # its agent and registration are gone with it
            port = int(uri.rsplit(":", 1)[1])
            second = make_server("nixl", buffer=filled(2), resolve=table.resolver(lambda: 0.0), config=CONFIG)
            assert await second.start("127.0.0.1", port) == uri and second.incarnation != first.incarnation
            try:
                await client.pull(uri, LAYOUT, table.create([3, 9], now=0.0).lease_id, [3, 9], dst, [0, 4])
                # the bytes are the new server's (a READ through the old agent would fail or read freed memory)
                assert np.array_equal(dst.array[:, [0, 4]], second.buffer.array[:, [3, 9]])
                assert client.num_agents_loaded == 2
                assert client._remotes == {uri: (second.incarnation, second.agent.name)}  # the old one removed
            finally:
                await second.stop()
        finally:
            client.close()

    run(scenario())


@own_process
def test_without_the_reads_notification_the_pull_fails_within_its_bound(monkeypatch) -> None:
    async def scenario() -> None:
        table = LeaseTable()
        server = make_server("nixl", buffer=filled(3), resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri = await server.start()
        client = nixl.NixlClient(CONFIG)
        try:
            lease = table.create([1, 2, 3], now=0.0).lease_id
            lose_notifications(monkeypatch, server)
            dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
            started = asyncio.get_running_loop().time()
            with pytest.raises(KVTransferError, match="notification|silent"):
                await client.pull(uri, LAYOUT, lease, [1, 2, 3], dst, [1, 2, 3])
            assert asyncio.get_running_loop().time() - started < CONFIG.io_timeout_s + 2.0
            assert client.pool.num_idle() == 0 and not server._waiting
            monkeypatch.undo()  # notifications flow again: the same lease reads
            await client.pull(uri, LAYOUT, lease, [1, 2, 3], dst, [1, 2, 3])
            assert np.array_equal(dst.array[:, [1, 2, 3]], server.buffer.array[:, [1, 2, 3]])
            assert server.num_notifications >= 1
        finally:
            client.close()
            await server.stop()

    run(scenario())


@own_process
def test_a_client_that_gives_up_mid_wait_frees_the_servers_waiter(monkeypatch) -> None:
    async def scenario() -> None:
        table = LeaseTable()
        server = make_server("nixl", buffer=filled(4), resolve=table.resolver(lambda: 0.0),
                             config=TransportConfig(connect_timeout_s=2.0, io_timeout_s=30.0))
        uri = await server.start()
        client = nixl.NixlClient(CONFIG)
        try:
            lose_notifications(monkeypatch, server)
            pulling = asyncio.create_task(client.pull(uri, LAYOUT, table.create([7], now=0.0).lease_id, [7],
                                                      KVBuffer.allocate(LAYOUT, NUM_BLOCKS), [0]))
            while not server._waiting:
                await asyncio.sleep(0.005)
            pulling.cancel()  # the client closes its connection; the server must not wait out its 30 s
            with pytest.raises(asyncio.CancelledError):
                await pulling
            for _ in range(400):
                if not server._waiting and not server._connections:
                    break
                await asyncio.sleep(0.005)
            assert not server._waiting and not server._connections
        finally:
            client.close()
            await server.stop()

    run(scenario())


@own_process
def test_descriptors_name_the_servers_memory_and_refuse_malformed_frames() -> None:
    from kv_transfer.wire import Frame

    head = nixl.DESCS_HEAD.pack(b"i" * 8, 3, 1, b"t" * 16, 4, 2)
    rows = np.array([[4096, 64], [8192, 64]], np.uint64).tobytes()
    descs = nixl.parse_descs("nixl://h:1", Frame(nixl.N_DESCS, 0, head + b"meta" + rows))
    assert (descs.incarnation, descs.device_id, nixl.MEM_KINDS[descs.memory_kind]) == (b"i" * 8, 3, "VRAM")
    assert descs.metadata == b"meta" and descs.rows.tolist() == [[4096, 64], [8192, 64]]
    for bad in (head + b"meta" + rows[:8], nixl.DESCS_HEAD.pack(b"i" * 8, 0, 7, b"t" * 16, 0, 0), b"short"):
        with pytest.raises(KVTransferError, match="malformed N_DESCS"):
            nixl.parse_descs("nixl://h:1", Frame(nixl.N_DESCS, 0, bad))


@own_process
def test_auto_prefers_nixl_for_a_cuda_cache_only() -> None:
    assert parse_kinds("auto", device="cuda:0")[0] == "nixl" == AUTO_PREFERENCE["cuda"][0]
    assert "ucx" not in parse_kinds("auto", device="cuda:0")  # never two UCX libraries in one worker
    assert "nixl" not in parse_kinds("auto") and parse_kinds("nixl,tcp") == ("nixl", "tcp")
