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
