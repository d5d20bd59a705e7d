"""nixl:// faults through real worker processes (issue 20): the decode worker D pulls over nixl from a prefill
worker that is killed while D's pull is in flight, that restarts at the same address (a new incarnation: D must
never READ through its stale metadata of the old one), or whose READ notifications never come
(``--fault-nixl-lose-notifications``). Each ends in a clean local recompute on D (greedy tokens equal the offline
engine), no call hangs (each has a deadline) and every pool is full afterwards; after the restart, pulls over
nixl work again. The Worker RPCs are driven by hand, as the router drives them, so a handle can outlive its
holder. Runs in nixl's own pytest process (tests/unit/test_kv_nixl.py), as every nixl case does."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from kv_transfer.nixl import installed as nixl_installed
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster, Proc, free_port
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_model import shared_tiny

pytestmark = pytest.mark.skipif(
    os.environ.get("BATON_TEST_NIXL") != "1" or not nixl_installed(),
    reason="nixl's cases run in a process of their own (test_kv_nixl.py, BATON_TEST_NIXL=1)")

PROMPTS = [[(11 * i + 7 * j) % 2000 + 10 for j in range(36 + i)] for i in range(6)]
MAX_TOKENS = 8
DEADLINE_S = 60.0  # any call still running past it has hung
D_IO_TIMEOUT_S = 3.0  # D gives up on a silent P after this long (at any one wait)
NIXL = ("--kv-transport", "nixl")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def expected(model_dir):
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=256, block_size=4))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    out: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            out.setdefault(int(delta.request_id), []).extend(delta.new_token_ids)
    return out


class Platform:
    """Redis, P (nixl, on fixed ports so it can come back at its address), P-lost (nixl, every READ notification
    lost) and D (pulls over nixl only)."""

    def __init__(self, model_dir, log_dir) -> None:
        self.redis = RedisServer.start()
        self.cluster = Cluster(self.redis.url, model_dir, log_dir)
        self.p_port, self.p_kv_port = free_port(), free_port()
        self.p = self.start_p()
        self.p_lost = self.cluster.start_worker("prefill", *NIXL, "--fault-nixl-lose-notifications",
                                                worker_id="p-lost")
        self.d = self.cluster.start_worker("decode", *NIXL, "--kv-io-timeout-s", str(D_IO_TIMEOUT_S), worker_id="d")
        self.cluster.wait_for_workers({"p", "p-lost", "d"})

    def start_p(self) -> Proc:
        proc = self.cluster.start_worker("prefill", *NIXL, "--kv-port", str(self.p_kv_port), "--port", str(self.p_port),
                                         worker_id="p")
        proc.address = f"127.0.0.1:{self.p_port}"  # the later --port wins
        return proc

    def stop(self) -> None:
        self.cluster.stop_all()
        self.redis.stop()


@pytest.fixture(scope="module")
def platform(model_dir, tmp_path_factory):
    require_redis_server()
    platform = Platform(model_dir, tmp_path_factory.mktemp("nixl-fault-logs"))
    try:
        yield platform
    finally:
        platform.stop()


def stub(proc: Proc) -> pb_grpc.WorkerStub:
    return pb_grpc.WorkerStub(grpc.insecure_channel(proc.address))


def greedy() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prefill(p: Proc, rid: str, i: int) -> pb.PrefillResponse:
    return stub(p).Prefill(pb.PrefillRequest(request_id=rid, token_ids=PROMPTS[i], sampling=greedy()),
                           timeout=DEADLINE_S)


def decode(d: Proc, rid: str, i: int, pre: pb.PrefillResponse) -> tuple[list[int], pb.Timings]:
    """D adopts the prefill's handle (pulls over nixl, or recomputes); the tokens P and D made, D's timings."""
    request = pb.DecodeRequest(request_id=rid, token_ids=[*PROMPTS[i], pre.first_token], sampling=greedy(),
                               handle=pre.handle, prompt_len=len(PROMPTS[i]))
    responses = list(stub(d).Decode(request, timeout=DEADLINE_S))
    return [pre.first_token, *(t for r in responses for t in r.token_ids)], responses[0].timings


def assert_pools_full(*procs: Proc, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [stub(p).Stats(pb.StatsRequest(), timeout=5) for p in procs]
        if all(s.num_free_blocks == s.num_total_blocks and s.num_open_leases == 0 and s.num_running == 0
               for s in stats):
            return
        assert time.monotonic() < deadline, f"pools not full: {stats}"
        time.sleep(0.1)


def assert_recomputed(tokens: list[int], timings: pb.Timings, want: list[int]) -> None:
    assert tokens == want  # D prefilled the prompt itself: the offline engine's tokens
    assert timings.local_fallback and "KV pull failed" in timings.route_reason and not timings.transfer_bytes, timings


def test_a_read_whose_notification_never_comes_ends_in_a_local_recompute(platform, expected):
    fallbacks = stub(platform.d).Stats(pb.StatsRequest()).kv_pull_fallbacks
    started = time.monotonic()
    tokens, timings = decode(platform.d, "lost", 0, prefill(platform.p_lost, "lost", 0))
    assert_recomputed(tokens, timings, expected[0])
    assert time.monotonic() - started < DEADLINE_S
    assert stub(platform.d).Stats(pb.StatsRequest()).kv_pull_fallbacks == fallbacks + 1
    assert_pools_full(platform.p_lost, platform.d)  # P-lost's server let go of the read D gave up on


def test_a_prefill_worker_killed_while_the_pull_is_in_flight_ends_in_a_local_recompute(platform, expected):
    """P-lost never sees the READ's notification, so D's pull sits between its READ and P's DONE (for up to
    D's io timeout): P is killed there. D recomputes at once, not after its timeout."""
    pre = prefill(platform.p_lost, "killed", 1)
    result: dict[str, object] = {}
    pulling = threading.Thread(target=lambda: result.update(out=decode(platform.d, "killed", 1, pre)))
    pulling.start()
    time.sleep(D_IO_TIMEOUT_S / 3)  # D's READ is done, it waits for DONE
    killed = time.monotonic()
    platform.p_lost.kill(signal.SIGKILL)
    pulling.join(DEADLINE_S)
    assert not pulling.is_alive(), "the Decode call hung"
    tokens, timings = result["out"]
    assert_recomputed(tokens, timings, expected[1])
    assert "closed the connection" in timings.route_reason, timings.route_reason  # in flight, not refused
    assert time.monotonic() - killed < DEADLINE_S
    assert_pools_full(platform.d)


def test_a_prefill_worker_restarted_at_its_address_is_a_new_incarnation(platform, expected):
    """A handle from P's old life is refused by the new P (D recomputes); D then READs through the new
    incarnation's metadata, never the stale one (a READ through the old agent fails: no fallback here)."""
    tokens, timings = decode(platform.d, "before", 2, prefill(platform.p, "before", 2))
    assert tokens == expected[2] and timings.transport == "nixl" and not timings.local_fallback, timings
    stale = prefill(platform.p, "stale", 3)
    platform.p.kill(signal.SIGKILL)
    platform.p = platform.start_p()
    _wait_serving(platform.p)  # its KV servers start before its gRPC server
    tokens, timings = decode(platform.d, "stale", 3, stale)
    assert_recomputed(tokens, timings, expected[3])
    for i in (4, 5):
        tokens, timings = decode(platform.d, f"after{i}", i, prefill(platform.p, f"after{i}", i))
        assert tokens == expected[i] and timings.transport == "nixl" and timings.transfer_bytes > 0, timings
        assert not timings.local_fallback, timings
    assert "restarted (new incarnation" in platform.d.log_path.read_text(errors="replace")
    assert_pools_full(platform.p, platform.d)


def _wait_serving(proc: Proc, timeout_s: float = 60.0) -> None:
    with grpc.insecure_channel(proc.address) as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
