"""`baton up` keeps pools at their desired size: pure decisions, then the manager against a real
redis-server and real child processes."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import redis

from deploy.pools import PoolAction, PoolManager, reconcile
from kv_transfer.redis_index import RedisKeys
from tests.redis_server import RedisServer, require_redis_server


@pytest.mark.parametrize(("desired", "active", "action"), [
    (None, ["d-0"], PoolAction()),
    (1, ["d-0"], PoolAction()),
    (3, ["d-0"], PoolAction(num_to_start=2)),
    (1, ["d-0", "d-1", "d-2"], PoolAction(to_drain=("d-2", "d-1"))),  # newest first
    (0, ["d-0"], PoolAction(to_drain=("d-0",))),
])
def test_reconcile(desired, active, action):
    assert reconcile(desired, active) == action


@dataclass
class Child:
    name: str
    popen: subprocess.Popen


@pytest.fixture
def manager():
    require_redis_server()
    server = RedisServer.start()
    client = redis.Redis.from_url(server.url)
    now = [0.0]
    started: list[Child] = []

    def start_worker(role: str, worker_id: str) -> Child:
        child = Child(worker_id, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        started.append(child)
        return child

    pools = PoolManager(redis=client, keys=RedisKeys("t"), start_worker=start_worker, clock=lambda: now[0])
    pools.now = now
    yield pools
    for child in started:
        child.popen.kill()
        child.popen.wait()
    server.stop()


def test_scale_up_then_drain_the_newest_once_idle(manager):
    keys, r = manager.keys, manager.redis
    manager.start("decode")
    r.set(keys.pool_desired("decode"), 2)
    manager.tick()
    assert [c.name for c in manager.workers["decode"]] == ["decode-0", "decode-1"]

    r.set(keys.pool_desired("decode"), 1)
    r.hset(keys.load("decode-1"), mapping={"running": 1, "waiting": 0})  # still serving a request
    manager.tick()
    assert [c.name for c in manager.workers["decode"]] == ["decode-0"]
    assert r.smembers(keys.draining) == {b"decode-1"}  # the router stops sending it work
    child = manager.draining["decode-1"][0]
    manager.now[0] = 10.0
    manager.tick()
    assert child.popen.poll() is None  # busy: never stopped mid-request

    r.hset(keys.load("decode-1"), mapping={"running": 0})
    manager.now[0] = 11.0
    manager.tick()  # idle for longer than a heartbeat: stopped
    child.popen.wait(10)
    manager.tick()
    assert manager.draining == {} and r.smembers(keys.draining) == set()


def test_a_worker_that_dies_is_restarted_under_its_id_after_a_growing_backoff(manager):
    keys, r = manager.keys, manager.redis
    reports: list[str] = []
    manager.report = reports.append
    first = manager.start("prefill")
    first.popen.kill()
    first.popen.wait()
    manager.now[0] = 5.0
    manager.tick()  # seen dead: counted, a restart scheduled 1 s from now
    assert r.hget(keys.restarts, "prefill-0") == b"1" and "restarting in 1 s (restart 1)" in reports[-1]
    assert manager.workers["prefill"] == [first]  # still the pool's member: no second worker is started
    manager.now[0] = 6.0
    manager.tick()
    second = manager.workers["prefill"][0]
    assert second is not first and second.name == "prefill-0" and second.popen.poll() is None
    second.popen.kill()  # dies again at once: the next wait doubles
    second.popen.wait()
    manager.now[0] = 7.0
    manager.tick()
    assert "restarting in 2 s (restart 2)" in reports[-1]
    manager.now[0] = 8.5
    manager.tick()
    assert manager.workers["prefill"][0] is second  # not yet
    manager.now[0] = 9.0
    manager.tick()
    third = manager.workers["prefill"][0]
    assert third not in (first, second) and third.popen.poll() is None
    third.popen.kill()  # after a healthy minute the backoff starts over
    third.popen.wait()
    manager.now[0] = 70.0
    manager.tick()
    assert "restarting in 1 s (restart 3)" in reports[-1]


def test_a_dead_worker_scaled_away_is_not_started_again(manager):
    keys, r = manager.keys, manager.redis
    child = manager.start("decode")
    child.popen.kill()
    child.popen.wait()
    manager.tick()  # restart scheduled
    r.set(keys.pool_desired("decode"), 0)
    manager.now[0] = 2.0
    manager.tick()  # drained away instead; it has exited, so it is simply gone
    manager.now[0] = 10.0
    manager.tick()
    assert manager.workers["decode"] == [] and manager.draining == {}
