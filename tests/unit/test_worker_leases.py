"""``worker.leases.WorkerLeases``: every way a lease opens and ends frees its blocks exactly once and forgets its
request and its layer progress."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from kv_transfer.errors import LeaseNotFound
from kv_transfer.progress import LayerProgress
from worker.leases import WorkerLeases


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def freed() -> Counter:
    return Counter()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def leases(freed: Counter, clock: Clock) -> WorkerLeases:
    return WorkerLeases(ttl_s=10.0, free=lambda blocks: freed.update(blocks), clock=clock)


def test_a_prefill_lease_is_taken_once_and_freed_once_when_released(leases: WorkerLeases, freed: Counter) -> None:
    leases.hand_over("r", (1, 2, 3))
    lease = leases.take("r")
    assert lease is not None and lease.block_ids == (1, 2, 3) and leases.take("r") is None
    assert leases.resolver()(lease.lease_id) == (1, 2, 3)
    assert leases.release(lease.lease_id) and not leases.release(lease.lease_id)
    assert freed == Counter({1: 1, 2: 1, 3: 1}) and len(leases) == 0
    with pytest.raises(LeaseNotFound):
        leases.resolver()(lease.lease_id)


def test_an_abort_ends_the_lease_its_prefill_never_took(leases: WorkerLeases, freed: Counter) -> None:
    leases.hand_over("r", (4, 5))
    assert leases.release_request("r") and not leases.release_request("r")
    assert freed == Counter({4: 1, 5: 1}) and leases.take("r") is None and len(leases) == 0


def test_expiry_frees_and_forgets_the_request(leases: WorkerLeases, freed: Counter, clock: Clock) -> None:
    leases.hand_over("r", (7,))
    clock.now += 10.0
    assert [l.block_ids for l in leases.expire()] == [(7,)]
    assert freed == Counter({7: 1}) and leases.take("r") is None and not leases.release_request("r")


def test_a_layerwise_lease_pinned_at_admission_is_renewed_by_the_hand_over(
        leases: WorkerLeases, freed: Counter, clock: Clock) -> None:
    async def scenario() -> None:
        waiter = leases.wait_admitted("r")
        progress = LayerProgress(2)
        early = leases.pin_admitted("r", (1, 2), progress)
        assert waiter.result() is early and leases.progress(early.lease_id) is progress
        clock.now += 9.0
        leases.hand_over("r", (1, 2, 3))  # the request held one block more: only that one is freed
        assert freed == Counter({3: 1}) and leases.progress(early.lease_id) is None
        clock.now += 9.0  # past the admission lease's first TTL, inside the renewed one
        assert leases.expire() == []
        lease = leases.take("r")
        assert lease is not None and lease.lease_id == early.lease_id and lease.block_ids == (1, 2)
        assert leases.release(lease.lease_id)
        assert freed == Counter({1: 1, 2: 1, 3: 1})

    asyncio.run(scenario())


def test_a_layerwise_lease_released_by_its_reader_before_the_hand_over(leases: WorkerLeases, freed: Counter) -> None:
    early = leases.pin_admitted("r", (1, 2), LayerProgress(2))
    assert leases.release(early.lease_id)  # the decode worker pulled it while the step was still running
    leases.hand_over("r", (1, 2, 3))
    assert freed == Counter({1: 1, 2: 1, 3: 1}) and leases.take("r") is None and len(leases) == 0
    assert leases.progress(early.lease_id) is None


def test_a_leased_prefix_ends_by_release_or_expiry_only(leases: WorkerLeases, freed: Counter, clock: Clock) -> None:
    a, b = leases.pin((1,)), leases.pin((2,))
    assert leases.release(a.lease_id)
    clock.now += 10.0
    assert [l.lease_id for l in leases.expire()] == [b.lease_id]
    assert freed == Counter({1: 1, 2: 1}) and len(leases) == 0
