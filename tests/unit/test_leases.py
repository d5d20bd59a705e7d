"""LeaseTable: pure logic with an injected clock; every lease is handed back exactly once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.errors import KVTransferError, LeaseNotFound
from kv_transfer.leases import Lease, LeaseTable


def test_create_and_get() -> None:
    table = LeaseTable(default_ttl_s=30.0)
    lease = table.create([3, 1, 2], now=100.0)
    assert lease == Lease(lease_id=lease.lease_id, block_ids=(3, 1, 2), expires_at=130.0)
    assert len(lease.lease_id) == 32 and int(lease.lease_id, 16) >= 0
    assert table.get(lease.lease_id, now=129.9) is lease
    assert table.create([4], ttl_s=5.0, now=100.0).expires_at == 105.0
    assert len({table.create([9], now=0.0).lease_id for _ in range(50)}) == 50
    assert len(table) == 52


def test_get_refuses_unknown_and_expired_leases() -> None:
    table = LeaseTable()
    lease = table.create([1], ttl_s=10.0, now=0.0)
    with pytest.raises(LeaseNotFound, match="unknown"):
        table.get("deadbeef" * 4, now=0.0)
    with pytest.raises(LeaseNotFound, match="expired"):
        table.get(lease.lease_id, now=10.0)
    assert issubclass(LeaseNotFound, KVTransferError)
    assert len(table) == 1  # still pinned until expire() hands it back


def test_release_hands_the_lease_back_once() -> None:
    table = LeaseTable()
    lease = table.create([5, 6], now=0.0)
    assert table.release(lease.lease_id) is lease
    assert table.release(lease.lease_id) is None
    with pytest.raises(LeaseNotFound):
        table.get(lease.lease_id, now=0.0)
    assert table.expire(now=1e9) == []


def test_expire_removes_and_returns_expired_leases_earliest_first() -> None:
    table = LeaseTable()
    late = table.create([1], ttl_s=20.0, now=0.0)
    early = table.create([2], ttl_s=10.0, now=0.0)
    live = table.create([3], ttl_s=30.0, now=0.0)
    assert table.next_expiry() == 10.0
    assert table.expire(now=9.9) == []
    assert table.expire(now=25.0) == [early, late]
    assert table.expire(now=25.0) == []
    assert table.release(early.lease_id) is None  # already handed back by expire
    assert table.pinned_block_ids() == {3} and table.next_expiry() == 30.0
    assert table.get(live.lease_id, now=25.0) is live


def test_invalid_leases_are_refused() -> None:
    table = LeaseTable()
    for bad in ([1, 1], [-1]):
        with pytest.raises(ValueError, match="distinct"):
            table.create(bad, now=0.0)
    with pytest.raises(ValueError, match="ttl_s"):
        table.create([1], ttl_s=0.0, now=0.0)
    with pytest.raises(ValueError, match="default_ttl_s"):
        LeaseTable(default_ttl_s=-1.0)


def test_resolver_reads_the_injected_clock() -> None:
    now = [0.0]
    table = LeaseTable()
    lease = table.create([7, 8], ttl_s=5.0, now=0.0)
    resolve = table.resolver(lambda: now[0])
    assert resolve(lease.lease_id) == (7, 8)
    now[0] = 5.0
    with pytest.raises(LeaseNotFound):
        resolve(lease.lease_id)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["create", "release", "expire"]), st.integers(0, 20)), max_size=40))
def test_every_lease_is_handed_back_exactly_once(ops: list[tuple[str, int]]) -> None:
    table, now, created, handed_back = LeaseTable(default_ttl_s=5.0), 0.0, [], []
    for op, arg in ops:
        now += arg / 4
        if op == "create":
            created.append(table.create([arg], now=now).lease_id)
        elif op == "release" and created:
            lease = table.release(created[arg % len(created)])
            handed_back += [lease.lease_id] if lease else []
        elif op == "expire":
            handed_back += [lease.lease_id for lease in table.expire(now)]
    handed_back += [lease.lease_id for lease in table.expire(now + 1e9)]
    assert sorted(handed_back) == sorted(created) and len(table) == 0


def test_renew_restarts_an_open_lease_and_never_shortens_it() -> None:
    table = LeaseTable(default_ttl_s=5.0)
    lease = table.create([1, 2], now=0.0)
    renewed = table.renew(lease.lease_id, now=4.0)
    assert renewed is not None and renewed.expires_at == 9.0 and renewed.block_ids == (1, 2)
    assert table.get(lease.lease_id, now=8.0).expires_at == 9.0  # would have expired at 5.0
    assert table.renew(lease.lease_id, ttl_s=1.0, now=4.0).expires_at == 9.0  # not shortened
    assert table.release(lease.lease_id) is not None
    assert table.renew(lease.lease_id, now=4.0) is None  # released: nothing to renew
