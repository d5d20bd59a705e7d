"""``baton.v1.Admin`` on a real router (in-process) against a real redis-server: the bearer token guards
every call and a refused call changes nothing; scale / drain / undrain edit the registry's keys; status
lists registered workers with their load; plan explains itself and, with apply, sets both pools."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from kv_transfer.registry import Registry, connect
from kv_transfer.workers import WorkerInfo, WorkerLoad
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.server import RunningRouter, start_router
from tests.redis_server import RedisServer, require_redis_server
from tests.unit.test_router_server import LoopThread, make_model_folder

NS = "adm"
TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PREFILL_CURVE = pb.PrefillCurve(prompt_lens=[128, 4096], tokens_per_s=[10_000, 10_000])
DECODE_CURVE = pb.DecodeCurve(batch_sizes=[1, 8, 32, 64], itl_ms=[10, 12, 20, 36])


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    require_redis_server()
    with RedisServer.start() as server:
        yield server


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


def start(loop: LoopThread, redis_server: RedisServer, model_dir, ns: str, token: str | None) -> RunningRouter:
    config = RouterConfig(model_path=model_dir, redis_url=redis_server.url, ns=ns, host="127.0.0.1", port=0,
                          worker_list_ttl_s=0.0)
    return loop.run(start_router(config, admin_token=token))


@pytest.fixture(scope="module")
def router(loop, redis_server, tmp_path_factory) -> Iterator[RunningRouter]:
    model_dir = make_model_folder(tmp_path_factory.mktemp("admin-model") / "tiny")
    running = start(loop, redis_server, model_dir, NS, TOKEN)
    yield running
    loop.run(running.stop(0.5))


@pytest.fixture(scope="module")
def stub(router) -> Iterator[pb_grpc.AdminStub]:
    with grpc.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        yield pb_grpc.AdminStub(channel)


@pytest.fixture
def redis(redis_server) -> Iterator[object]:
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_server.url, decode_responses=True)
    for key in client.scan_iter(f"{NS}:*"):
        client.delete(key)
    yield client
    client.close()


def worker(worker_id: str, role: str, total_blocks: int = 100) -> WorkerInfo:
    address = f"127.0.0.1:{9000 + len(worker_id)}"
    return WorkerInfo(worker_id=worker_id, role=role, grpc_address=address,  # type: ignore[arg-type]
                      kv_uri="tcp://127.0.0.1:1", model_fingerprint="ab" * 16, layout_json="{}",
                      total_blocks=total_blocks)


def register(loop: LoopThread, redis_server: RedisServer, *pairs: tuple[WorkerInfo, WorkerLoad | None]) -> None:
    async def go() -> None:
        client = connect(redis_server.url)
        registry = Registry(client, NS, ttl_s=60.0)
        for info, load in pairs:
            await registry.register(info)
            if load is not None:
                await registry.heartbeat(info, load)
        await client.aclose()

    loop.run(go())


def refused(call, request, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=5, **kwargs)
    return info.value


def test_without_or_with_a_wrong_token_every_call_is_refused_and_nothing_changes(stub, redis, loop, redis_server):
    register(loop, redis_server, (worker("p1", "prefill"), None))
    redis.set(f"{NS}:pool:decode:desired", 1)
    calls = [(stub.ListWorkers, pb.ListWorkersRequest()), (stub.GetPools, pb.GetPoolsRequest()),
             (stub.ScalePool, pb.ScalePoolRequest(role="decode", size=5)),
             (stub.Drain, pb.DrainRequest(worker_id="p1")), (stub.Undrain, pb.DrainRequest(worker_id="p1")),
             (stub.Plan, pb.PlanRequest(ttft_p90_ms=300, itl_p90_ms=20, rate=10, isl=1000, osl=200, apply=True,
                                        prefill_curve=PREFILL_CURVE, decode_curve=DECODE_CURVE))]
    bad_metadata = [(), (("authorization", "Bearer nope"),), (("authorization", TOKEN),),
                    (("authorization", f"Basic {TOKEN}"),)]
    for call, request in calls:
        for metadata in bad_metadata:
            error = refused(call, request, metadata=metadata)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (call, metadata)
    assert redis.get(f"{NS}:pool:decode:desired") == "1"
    assert redis.get(f"{NS}:pool:prefill:desired") is None
    assert redis.smembers(f"{NS}:draining") == set()
    assert stub.GetPools(pb.GetPoolsRequest(), metadata=AUTH).pools[1].desired == 1  # the right token works


def test_scale_sets_the_desired_pool_size(stub, redis):
    first = stub.ScalePool(pb.ScalePoolRequest(role="decode", size=2), metadata=AUTH)
    assert redis.get(f"{NS}:pool:decode:desired") == "2"
    assert not first.HasField("previous_desired") and first.pool.desired == 2 and first.pool.actual == 0
    second = stub.ScalePool(pb.ScalePoolRequest(role="decode", size=3), metadata=AUTH)
    assert second.previous_desired == 2 and redis.get(f"{NS}:pool:decode:desired") == "3"
    for bad in (pb.ScalePoolRequest(role="router", size=2), pb.ScalePoolRequest(role="decode", size=0)):
        assert refused(stub.ScalePool, bad, metadata=AUTH).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert redis.get(f"{NS}:pool:decode:desired") == "3"


def test_drain_and_undrain_edit_the_draining_set(stub, redis, loop, redis_server):
    register(loop, redis_server, (worker("d1", "decode"), None), (worker("d2", "decode"), None))
    assert stub.Drain(pb.DrainRequest(worker_id="d1"), metadata=AUTH).changed
    assert redis.smembers(f"{NS}:draining") == {"d1"}
    assert not stub.Drain(pb.DrainRequest(worker_id="d1"), metadata=AUTH).changed
    pools = {p.role: p for p in stub.GetPools(pb.GetPoolsRequest(), metadata=AUTH).pools}
    assert (pools["decode"].actual, pools["decode"].draining, pools["prefill"].actual) == (2, 1, 0)
    error = refused(stub.Drain, pb.DrainRequest(worker_id="ghost"), metadata=AUTH)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "ghost" in error.details()
    assert stub.Undrain(pb.DrainRequest(worker_id="d1"), metadata=AUTH).changed
    assert redis.smembers(f"{NS}:draining") == set()
    assert not stub.Undrain(pb.DrainRequest(worker_id="d1"), metadata=AUTH).changed


def test_list_workers_shows_role_state_and_load(stub, redis, loop, redis_server):
    load = WorkerLoad(running=3, waiting=1, free_blocks=25, queued_prefill_tokens=40)
    register(loop, redis_server, (worker("p1", "prefill"), load), (worker("d1", "decode", 200), None))
    stub.Drain(pb.DrainRequest(worker_id="d1"), metadata=AUTH)
    workers = {w.worker_id: w for w in stub.ListWorkers(pb.ListWorkersRequest(), metadata=AUTH).workers}
    assert sorted(workers) == ["d1", "p1"]
    p1, d1 = workers["p1"], workers["d1"]
    assert (p1.role, p1.state, p1.has_load, p1.num_running, p1.num_waiting) == (
        "prefill", pb.WORKER_STATE_UP, True, 3, 1)
    assert (p1.num_free_blocks, p1.num_total_blocks, p1.queued_prefill_tokens) == (25, 100, 40)
    assert p1.kv_cache_usage == pytest.approx(0.75)
    assert (d1.role, d1.state, d1.has_load, d1.num_total_blocks) == ("decode", pb.WORKER_STATE_DRAINING, False, 200)


def test_plan_explains_and_applies(stub, redis):
    request = pb.PlanRequest(ttft_p90_ms=300, itl_p90_ms=20, rate=10, isl=1000, osl=200,
                             prefill_curve=PREFILL_CURVE, decode_curve=DECODE_CURVE)
    response = stub.Plan(request, metadata=AUTH)
    assert (response.prefill, response.decode, response.feasible, response.applied) == (2, 2, True, False)
    assert "predicted TTFT p90" in response.reasoning and response.reasoning.endswith("plan: 2 prefill, 2 decode")
    assert {t.name for t in response.terms} >= {"service time D", "concurrent sequences"}
    assert redis.get(f"{NS}:pool:prefill:desired") is None
    request.apply = True
    assert stub.Plan(request, metadata=AUTH).applied
    assert (redis.get(f"{NS}:pool:prefill:desired"), redis.get(f"{NS}:pool:decode:desired")) == ("2", "2")


def test_plan_uses_the_stored_profile_or_says_none_is_there(stub, redis):
    request = pb.PlanRequest(ttft_p90_ms=300, itl_p90_ms=20, rate=20, isl=1000, osl=200)
    error = refused(stub.Plan, request, metadata=AUTH)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{NS}:profile:prefill" in error.details()
    redis.set(f"{NS}:profile:prefill", json.dumps({"prompt_lens": [128, 4096], "tokens_per_s": [1e4, 1e4]}))
    redis.set(f"{NS}:profile:decode", json.dumps({"batch_sizes": [1, 8, 32, 64], "itl_ms": [10, 12, 20, 36]}))
    assert stub.Plan(request, metadata=AUTH).decode == 3  # 20/s * 200 * 20 ms = 80 sequences / 32


def test_with_no_profile_plan_uses_the_workers_calibration_and_says_so(stub, redis, loop, redis_server):
    calibrated = WorkerLoad(running=0, waiting=0, free_blocks=100, queued_prefill_tokens=0,
                            prefill_tokens_per_s=5000.0, decode_step_s=0.02, decode_batch_size=1.0)
    register(loop, redis_server, (worker("p0", "prefill"), calibrated), (worker("d0", "decode"), calibrated))
    plan = stub.Plan(pb.PlanRequest(ttft_p90_ms=300, itl_p90_ms=30, rate=5, isl=1000, osl=100), metadata=AUTH)
    terms = {t.name: t for t in plan.terms}
    assert terms["calibrated rate"].value == 5000.0 and "start-up calibration" in terms["calibrated rate"].note
    assert terms["calibrated ITL at batch 1"].value == pytest.approx(20.0)
    assert "calibration" in plan.reasoning and plan.prefill >= 1 and plan.decode >= 1
    # a stored curve wins for its pool; the other still comes from the calibration
    redis.set(f"{NS}:profile:prefill", json.dumps({"prompt_lens": [128, 4096], "tokens_per_s": [1e4, 1e4]}))
    terms = {t.name for t in stub.Plan(pb.PlanRequest(ttft_p90_ms=300, itl_p90_ms=30, rate=5, isl=1000, osl=100),
                                       metadata=AUTH).terms}
    assert "calibrated rate" not in terms and "calibrated ITL at batch 1" in terms


def test_store_profile_validates_then_writes_what_plan_reads(stub, redis):
    bad = pb.StoreProfileRequest(prefill_curve=pb.PrefillCurve(prompt_lens=[512, 128], tokens_per_s=[1, 2]),
                                 decode_curve=DECODE_CURVE)
    error = refused(stub.StoreProfile, bad, metadata=AUTH)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "increasing" in error.details()
    assert redis.get(f"{NS}:profile:decode") is None  # nothing written when one curve is malformed
    assert refused(stub.StoreProfile, pb.StoreProfileRequest(decode_curve=DECODE_CURVE)).code() == (
        grpc.StatusCode.UNAUTHENTICATED)
    # ITL grid by context: at isl 500 + osl 200 / 2 = context 600, halfway between the rows 100 and 1100
    grid = pb.DecodeCurve(batch_sizes=[1, 8], itl_ms=[20, 24], context_lens=[100, 1100], itl_ms_grid=[10, 12, 20, 24])
    reply = stub.StoreProfile(pb.StoreProfileRequest(prefill_curve=PREFILL_CURVE, decode_curve=grid,
                                                     measured_on="p0,d0"), metadata=AUTH)
    assert list(reply.keys) == [f"{NS}:profile:prefill", f"{NS}:profile:decode"]
    stored = json.loads(redis.get(f"{NS}:profile:decode"))
    assert stored["context_lens"] == [100, 1100] and stored["measured_on"] == "p0,d0"
    plan = stub.Plan(pb.PlanRequest(ttft_p90_ms=300, itl_p90_ms=16.5, rate=1, isl=500, osl=200), metadata=AUTH)
    batch = next(t.value for t in plan.terms if t.name == "batch at ITL target")
    assert batch == pytest.approx(4.5)  # the row at 600 is [15, 18] ms: 16.5 ms is halfway from batch 1 to 8


def test_a_router_without_a_token_serves_admin_openly(loop, redis_server, tmp_path):
    model_dir = make_model_folder(tmp_path / "tiny")
    running = start(loop, redis_server, model_dir, "open", None)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            pools = pb_grpc.AdminStub(channel).GetPools(pb.GetPoolsRequest(), timeout=5)
        assert [p.role for p in pools.pools] == ["prefill", "decode"]
    finally:
        loop.run(running.stop(0.5))
