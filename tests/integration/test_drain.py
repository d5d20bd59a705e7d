"""`baton admin drain` on workers started on their own (no `baton up`), real processes: a drained decode
worker finishes the stream it is serving, token for token, then exits 0 and leaves the registry; new requests
go to the other worker. A worker started with `--on-drain stay` stays up, idle, and serves again once undrained."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time

import grpc
import pytest

from kv_transfer.registry import Registry, connect
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster, set_draining_seen
from tests.integration.test_e2e import _wait_serving
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_model import shared_tiny

PROMPT = [5, 6, 7, 8, 9, 10, 11]
LONG = 1200  # output tokens of the stream in flight while its worker drains
STEP_DELAY_S = 0.005  # d-exit's steps are slowed: LONG tokens take >= 6 s however fast the machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_redis_server()
    model_dir = shared_tiny(tmp_path_factory)
    redis = RedisServer.start()
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("logs"))
    try:
        cluster.exiting = cluster.start_worker("decode", "--drain-settle-s", "2", "--fault-step-delay-s",
                                               str(STEP_DELAY_S), worker_id="d-exit", num_blocks=512)
        cluster.staying = cluster.start_worker("decode", "--on-drain", "stay", "--drain-settle-s", "2",
                                               worker_id="d-stay", num_blocks=512)
        cluster.wait_for_workers({"d-exit", "d-stay"})
        cluster.router = cluster.start_router("--disagg-threshold-tokens", "100000", "--policy", "least_loaded")
        _wait_serving(cluster.router.address)
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def admin(cluster) -> pb_grpc.AdminStub:
    return pb_grpc.AdminStub(grpc.insecure_channel(cluster.router.address))


def stream(cluster, max_tokens: int):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(cluster.router.address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=params), timeout=120)


def registered(cluster) -> set[str]:
    async def ids() -> set[str]:
        redis = connect(cluster.redis_url)
        try:
            return {info.worker_id for info, _ in await Registry(redis, cluster.namespace).list_workers()}
        finally:
            await redis.aclose()

    return asyncio.run(ids())


def test_a_drained_worker_finishes_its_stream_then_exits(cluster):
    stub = admin(cluster)
    assert stub.Drain(pb.DrainRequest(worker_id="d-stay"), timeout=5).changed
    # until the router routes by a listing with d-stay draining (probes: refused with both drained, then served)
    set_draining_seen(grpc.insecure_channel(cluster.router.address), cluster.redis_url, cluster.namespace,
                      decode_ids=("d-stay", "d-exit"), draining=("d-stay",))
    responses, received = [], threading.Event()

    def consume() -> None:
        for response in stream(cluster, LONG):
            responses.append(response)
            received.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert received.wait(60), "no first token"
    assert stub.Drain(pb.DrainRequest(worker_id="d-exit"), timeout=5).changed
    assert stub.Undrain(pb.DrainRequest(worker_id="d-stay"), timeout=5).changed
    tokens_at_drain = sum(len(r.token_ids) for r in responses)
    reader.join(120)
    assert not reader.is_alive()
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens_at_drain < LONG, "the stream ended before the drain"
    assert len(tokens) == LONG and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[-1].timings.decode_worker == "d-exit"
    assert cluster.exiting.popen.wait(60) == 0, cluster.exiting.log()
    assert "drained: exiting" in cluster.exiting.log()
    assert "d-exit" not in registered(cluster)
    last = served_after_exit(cluster)
    assert last.timings.decode_worker == "d-stay" and last.finish_reason == pb.FINISH_REASON_LENGTH


def served_after_exit(cluster, timeout_s: float = 20.0) -> pb.GenerateResponse:
    """A request's last response once the router serves one: until its listing drops the exited worker, a request
    sent there may fail (it has gone; no fixed sleep can know when the router re-lists)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list(stream(cluster, 4))[-1]
        except grpc.RpcError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"no request served {timeout_s} s after d-exit left: {exc.details()}") from exc
            time.sleep(0.1)


def test_a_worker_with_on_drain_stay_stays_up(cluster):
    stub = admin(cluster)
    assert stub.Drain(pb.DrainRequest(worker_id="d-stay"), timeout=5).changed
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            cluster.staying.popen.wait(5)  # longer than its settle time and poll period
        assert "d-stay" in registered(cluster)
        workers = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
        assert [w.state for w in workers if w.worker_id == "d-stay"] == [pb.WORKER_STATE_DRAINING]
    finally:
        stub.Undrain(pb.DrainRequest(worker_id="d-stay"), timeout=5)
    # and it is the same process, serving: it decodes a request (sent to it directly, whichever worker the
    # router would pick) and was never restarted
    worker = pb_grpc.WorkerStub(grpc.insecure_channel(cluster.staying.address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    responses = list(worker.Decode(pb.DecodeRequest(request_id="after-undrain", token_ids=PROMPT, sampling=params),
                                   timeout=30))
    assert sum(len(r.token_ids) for r in responses) == 4 and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert cluster.staying.popen.poll() is None
