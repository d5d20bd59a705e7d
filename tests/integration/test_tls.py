"""Real processes over TLS: a password-protected redis-server, a decode worker and a router both serving
mTLS with certificates of one test CA. Generate works end to end (token-exact with the offline engine);
clients with no TLS, no certificate or a certificate of another CA are refused with UNAVAILABLE; the
router -> worker hop is TLS too: a plaintext router, or one whose certificate another CA signed, cannot
reach the worker. The worker's ``/metrics`` is HTTPS under the same mTLS, and the router's admin API reads the
worker's Stats over TLS too."""

from __future__ import annotations

import asyncio
import io
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.tiny import build_model
from kv_transfer.workers import WorkerInfo
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from proto import tls
from proto.tls import TlsConfig
from router import generate_cli
from router.admin.convert import worker_rates
from tests.integration.cluster import Cluster, Proc, free_port
from tests.redis_server import RedisServer, require_redis_server
from tests.tls_certs import KeyPair, Pki, make_pki

PROMPT = [(5 * j) % 300 + 10 for j in range(21)]
MAX_TOKENS = 6
PASSWORD = "tls-test-pass"


def _flags(pair: KeyPair, ca) -> tuple[str, ...]:
    return ("--tls-cert", str(pair.cert), "--tls-key", str(pair.key), "--tls-ca", str(ca))


def _client(pki: Pki) -> TlsConfig:
    return TlsConfig(cert=pki.client_a.cert, key=pki.client_a.key, ca=pki.ca_a)


def _wait_serving(proc: Proc, config: TlsConfig, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    with tls.channel(proc.address, config) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited early:\n{proc.log()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} not serving over TLS in {timeout_s} s:\n{proc.log()}")
            time.sleep(0.3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("tiny"), train_steps=20, progress=lambda _: None)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=64, block_size=4, num_threads=1))
    engine.add_request("0", PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            out.extend(delta.new_token_ids)
    return out


@pytest.fixture(scope="module")
def platform(model_dir, tmp_path_factory):
    require_redis_server()
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    redis = RedisServer.start(password=PASSWORD)
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("logs"))
    try:
        cluster.metrics_port = free_port()
        cluster.worker = cluster.start_worker("decode", *_flags(pki.node_a, pki.ca_a),
                                              "--metrics-port", str(cluster.metrics_port), worker_id="d0")
        cluster.wait_for_workers({"d0"})
        cluster.router = cluster.start_router(*_flags(pki.node_a, pki.ca_a), "--policy", "least_loaded")
        _wait_serving(cluster.router, _client(pki))
        cluster.pki = pki
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def _generate(address: str, config: TlsConfig | None) -> tuple[list[int], pb.GenerateResponse]:
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=params)
    with tls.channel(address, config) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
    return [t for r in responses for t in r.token_ids], responses[-1]


def _refused(address: str, config: TlsConfig | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        _generate(address, config)
    return caught.value


def test_generate_over_mtls_equals_the_offline_engine(platform, expected):
    tokens, final = _generate(platform.router.address, _client(platform.pki))
    assert tokens == expected
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and final.timings.decode_worker == "d0"
    assert "gRPC mTLS" in platform.worker.log() and "(mTLS)" in platform.router.log()
    assert PASSWORD not in platform.router.log() + platform.worker.log()  # the Redis URL is redacted


def test_baton_generate_speaks_mtls(platform):
    pki, out, err = platform.pki, io.StringIO(), io.StringIO()
    base = ["hello", "--router", platform.router.address, "--max-tokens", "3", "--temperature", "0"]
    client = ["--tls-cert", str(pki.client_a.cert), "--tls-key", str(pki.client_a.key), "--tls-ca", str(pki.ca_a)]
    assert generate_cli.main(base + client, out=out, err=err) == 0, err.getvalue()
    assert "decode d0" in out.getvalue() and "3 tokens (length)" in out.getvalue()
    assert generate_cli.main(base + ["--tls-ca", str(pki.ca_a)], out=io.StringIO(), err=err) == 1
    assert "TLS" in err.getvalue()


def test_clients_without_valid_credentials_are_refused(platform):
    pki, address = platform.pki, platform.router.address
    for config in (
        None,  # plaintext
        TlsConfig(ca=pki.ca_a),  # TLS, but no client certificate
        TlsConfig(cert=pki.node_b.cert, key=pki.node_b.key, ca=pki.ca_a),  # a certificate of another CA
        TlsConfig(cert=pki.client_a.cert, key=pki.client_a.key, ca=pki.ca_b),  # the router is not trusted
    ):
        assert _refused(address, config).code() == grpc.StatusCode.UNAVAILABLE, config


def test_health_and_reflection_work_over_mtls(platform):
    with tls.channel(platform.router.address, _client(platform.pki)) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="baton.v1.Generation"), timeout=5).status
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        services = {s.name for reply in replies for s in reply.list_services_response.service}
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert {"baton.v1.Generation", "baton.v1.Admin", "grpc.health.v1.Health"} <= services


def test_the_worker_refuses_clients_without_its_ca(platform):
    pki, address = platform.pki, platform.worker.address
    with tls.channel(address, _client(pki)) as channel:
        stats = pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
    assert stats.num_total_blocks > 0
    for config in (None, TlsConfig(ca=pki.ca_a), TlsConfig(cert=pki.node_b.cert, key=pki.node_b.key, ca=pki.ca_a)):
        with tls.channel(address, config) as channel, pytest.raises(grpc.RpcError) as caught:
            pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, config


def test_the_router_to_worker_hop_is_tls(platform):
    pki = platform.pki
    plain = platform.start_router("--policy", "least_loaded")  # no TLS: the worker refuses its calls
    other = platform.start_router("--tls-cert", str(pki.node_b.cert), "--tls-key", str(pki.node_b.key),
                                  "--tls-ca", str(pki.ca_a), "--policy", "least_loaded")  # client cert of CA b
    other_client = TlsConfig(cert=pki.client_a.cert, key=pki.client_a.key, ca=pki.ca_b)
    try:
        _wait_serving(plain, None)
        _wait_serving(other, other_client)
        for router, client in ((plain, None), (other, other_client)):
            error = _refused(router.address, client)
            assert error.code() == grpc.StatusCode.UNAVAILABLE, (router.name, error.details())
            assert "decode worker d0" in error.details(), error.details()  # refused at the worker, not here
        # the mTLS router still reaches the same worker
        assert _generate(platform.router.address, _client(pki))[1].timings.decode_worker == "d0"
    finally:
        for router in (plain, other):
            router.kill()
            platform.procs.remove(router)


def test_the_workers_metrics_are_https_under_mtls(platform):
    url = f"https://127.0.0.1:{platform.metrics_port}/metrics"
    context = tls.ssl_client_context(_client(platform.pki))
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        body = response.read().decode()
    assert 'baton:num_requests_running{worker_id="d0"}' in body
    no_certificate = tls.ssl_client_context(TlsConfig(ca=platform.pki.ca_a))
    for url, context in ((url.replace("https", "http"), None), (url, no_certificate)):
        with pytest.raises(OSError):
            urllib.request.urlopen(url, timeout=10, context=context).read()


def test_the_admin_api_reads_the_tls_workers_stats(platform):
    """``ListWorkers`` asks each worker for its Stats as the router calls it: over mTLS with its certificate."""
    pki, client = platform.pki, _client(platform.pki)
    _generate(platform.router.address, client)  # the worker has looked up its prefix cache
    with tls.channel(platform.router.address, client) as channel:
        workers = pb_grpc.AdminStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=10).workers
    d0 = {worker.worker_id: worker for worker in workers}["d0"]
    assert d0.HasField("prefix_cache_hit_rate"), d0
    info = WorkerInfo(worker_id="d0", role="decode", grpc_address=d0.grpc_address, kv_uri=d0.kv_uri,
                      model_fingerprint="", layout_json="", total_blocks=d0.num_total_blocks)
    router_tls = TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key, ca=pki.ca_a)
    assert set(asyncio.run(worker_rates([info], 5.0, router_tls))) == {"d0"}
    assert asyncio.run(worker_rates([info], 5.0, None)) == {}  # a plaintext caller is refused: left out
