"""The direct P -> D handoff and the prefill retry, with real workers, a real router and real Redis:
- P's lease ends when D's pull ends, not after D's first decode step (D's steps are slowed to make the order
  visible: ``--fault-step-delay-s``);
- a prefill whose worker is killed mid-prefill is retried on the other prefill worker and finishes there, not by a
  local prefill on D.
Both leave every block pool full and no lease open."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_model import shared_tiny

PROMPT = list(range(5, 5 + 120))  # well over the disaggregation threshold: always prefilled remotely
DECODE_STEP_DELAY_S = 1.5
PREFILL_STEP_DELAY_S = 3.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture
def platform(model_dir, tmp_path):
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def stats(address: str) -> pb.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not met in {timeout_s} s"
        time.sleep(0.02)


def idle(address: str) -> bool:
    s = stats(address)
    return s.num_free_blocks == s.num_total_blocks and s.num_open_leases == 0 and s.num_running == 0


def generate(router: str, max_tokens: int = 4, first: threading.Event | None = None,
             ) -> tuple[list[float], list[pb.GenerateResponse]]:
    """The responses of one request and the instant (monotonic) each arrived; ``first`` is set on the first."""
    arrivals, responses = [], []
    with grpc.insecure_channel(router) as channel:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT),
                                     sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=60):
            arrivals.append(time.monotonic())
            responses.append(response)
            if first is not None:
                first.set()
    return arrivals, responses


def test_p_releases_its_lease_when_the_pull_ends_before_d_first_decode_step(platform: Cluster) -> None:
    p = platform.start_worker("prefill", worker_id="p0")
    d = platform.start_worker("decode", "--fault-step-delay-s", str(DECODE_STEP_DELAY_S), worker_id="d0")
    router = platform.start_router("--policy", "least_loaded")
    platform.wait_for_workers({"p0", "d0"})
    wait_until(lambda: _serving(router.address), what="router serving")
    result: dict = {}
    prefilled = threading.Event()  # the client has P's first token: P answered, so its lease is open (or over)

    def client() -> None:
        result["arrivals"], result["responses"] = generate(router.address, first=prefilled)

    thread = threading.Thread(target=client)
    thread.start()
    assert prefilled.wait(60), "no first token from P"
    wait_until(lambda: stats(p.address).num_open_leases == 0, what="P's lease released")
    released_s = time.monotonic()
    thread.join(60)
    arrivals, responses = result["arrivals"], result["responses"]
    final = responses[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and final.usage.completion_tokens == 4
    assert (final.timings.route_kind, final.timings.prefill_worker, final.timings.decode_worker) == \
        ("remote", "p0", "d0")
    # arrivals[0] is P's first token; arrivals[1] D's first, which needed a slow decode step after the pull: P's
    # lease ended before that step did (the router, which releases only after D's first answer, could not have)
    assert released_s < arrivals[1] - DECODE_STEP_DELAY_S / 2, (released_s, arrivals)
    wait_until(lambda: idle(p.address) and idle(d.address), what="pools full")


def test_a_prefill_worker_killed_mid_prefill_is_replaced_by_the_other(platform: Cluster) -> None:
    slow = ("--fault-step-delay-s", str(PREFILL_STEP_DELAY_S))
    prefills = {"p0": platform.start_worker("prefill", *slow, worker_id="p0"),
                "p1": platform.start_worker("prefill", *slow, worker_id="p1")}
    d = platform.start_worker("decode", worker_id="d0")
    router = platform.start_router("--policy", "least_loaded")
    platform.wait_for_workers({"p0", "p1", "d0"})
    wait_until(lambda: _serving(router.address), what="router serving")
    result: dict = {}
    client = threading.Thread(target=lambda: result.update(responses=generate(router.address)[1]))
    client.start()

    def computing() -> str | None:
        """The prefill worker whose engine is inside a step: its Stats waits for the step's end (a slow one),
        while the other, idle, answers. Both slow (a busy machine) or both quick: not known yet, ask again."""
        busy = []
        for worker_id, proc in prefills.items():
            try:
                with grpc.insecure_channel(proc.address) as channel:
                    pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=PREFILL_STEP_DELAY_S / 3)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                busy.append(worker_id)
        return busy[0] if len(busy) == 1 else None

    deadline = time.monotonic() + 30
    while (first := computing()) is None:
        assert time.monotonic() < deadline, "no prefill worker started computing the prompt"
    prefills[first].kill()  # SIGKILL mid-prefill (its step sleeps PREFILL_STEP_DELAY_S before computing)
    client.join(60)
    other = "p1" if first == "p0" else "p0"
    final = result["responses"][-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and final.usage.completion_tokens == 4
    t = final.timings
    assert (t.route_kind, t.prefill_worker, t.decode_worker) == ("remote", other, "d0"), t.route_reason
    assert t.route_reason.startswith(f"retry: prefill on {first} failed"), t.route_reason
    wait_until(lambda: idle(prefills[other].address) and idle(d.address), what="pools full")


def _serving(router: str) -> bool:
    """The router answers (a one-token request routes, which needs the workers in its directory)."""
    try:
        with grpc.insecure_channel(router) as channel:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=1))
            list(pb_grpc.GenerationStub(channel).Generate(request, timeout=30))
        return True
    except grpc.RpcError:
        time.sleep(0.3)
        return False
