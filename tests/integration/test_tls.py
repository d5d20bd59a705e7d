"""Real processes over TLS everywhere: a password-protected redis-server serving TLS only (``rediss://``), a
prefill and a decode worker and two routers, all serving mTLS with certificates of one test CA.

Generate goes P -> D over those hops (router -> P, router -> D, D -> P's ``ReleaseLease``), token-exact with the
offline engine, the KV really pulled; a router that imports a prefix calls P's ``LeasePrefix`` over mTLS
too. Clients with no TLS, no certificate or a certificate of another CA are refused with UNAVAILABLE; the
router -> worker hop is TLS too: a plaintext router, or one whose certificate another CA signed, cannot
reach the worker. The worker's ``/metrics`` is HTTPS under the same mTLS, and the router's admin API reads the
worker's Stats over TLS too. ``baton up --tls-*`` brings up such a platform by itself."""

from __future__ import annotations

import asyncio
import io
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kv_transfer.workers import WorkerInfo
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from proto import tls
from proto.tls import TlsConfig
from router import generate_cli
from router.admin.convert import worker_rates
from tests.integration.cluster import Cluster, Proc, free_port
from tests.integration.test_e2e import assert_pools_full
from tests.redis_server import RedisServer, RedisTls, require_redis_server
from tests.tiny_model import shared_tiny
from tests.tls_certs import KeyPair, Pki, make_pki

PROMPT = [(5 * j) % 300 + 10 for j in range(21)]
LONG_PROMPT = [(7 * j) % 3000 + 10 for j in range(900)]  # its first 896 tokens are imported: 224 blocks
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
    return shared_tiny(tmp_path_factory)


def _offline(model_dir, prompt: list[int]) -> list[int]:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=256, block_size=4, num_threads=1))
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            out.extend(delta.new_token_ids)
    return out


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    return _offline(model_dir, PROMPT)


@pytest.fixture(autouse=True)
def pools_return_to_full(request):
    """After every test of the module: p0's and d0's pools full, no lease open, nothing running (asked over mTLS)."""
    yield
    if "platform" in request.fixturenames:
        platform = request.getfixturevalue("platform")
        client = _client(platform.pki)
        assert_pools_full(platform, channel=lambda address: tls.channel(address, client),
                          workers=[platform.prefill, platform.worker])


@pytest.fixture(scope="module")
def platform(model_dir, tmp_path_factory):
    require_redis_server()
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    try:
        redis = RedisServer.start(password=PASSWORD, tls=RedisTls(pki.node_a.cert, pki.node_a.key, pki.ca_a))
    except RuntimeError as exc:  # a redis-server built without TLS says so in its log
        pytest.skip(f"this redis-server cannot serve TLS: {exc}")
    cluster = Cluster(redis.url, model_dir, tmp_path_factory.mktemp("logs"))  # rediss://:PASSWORD@...?ssl_ca_certs=
    try:
        cluster.metrics_port = free_port()
        cluster.prefill = cluster.start_worker("prefill", *_flags(pki.node_a, pki.ca_a), "--kv-transport", "tcp",
                                               worker_id="p0", num_blocks=512)
        cluster.worker = cluster.start_worker("decode", *_flags(pki.node_a, pki.ca_a), "--kv-transport", "tcp",
                                              "--metrics-port", str(cluster.metrics_port), worker_id="d0",
                                              num_blocks=512)
        cluster.wait_for_workers({"p0", "d0"})
        # every prompt of more than 8 tokens is prefilled on p0 and pulled by d0
        cluster.router = cluster.start_router(*_flags(pki.node_a, pki.ca_a), "--policy", "least_loaded",
                                              "--disagg-threshold-tokens", "8")
        # every prompt is prefilled on d0: with a prefix cached on p0 only, the cost policy imports it
        cluster.local_router = cluster.start_router(*_flags(pki.node_a, pki.ca_a), "--policy", "cost",
                                                    "--disagg-threshold-tokens", "100000")
        _wait_serving(cluster.router, _client(pki))
        _wait_serving(cluster.local_router, _client(pki))
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
    """Router -> P, router -> D and D -> P (the lease's release) are all mTLS calls; the KV moved (no fallback)."""
    tokens, final = _generate(platform.router.address, _client(platform.pki))
    t = final.timings
    assert tokens == expected
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert (t.route_kind, t.prefill_worker, t.decode_worker) == ("remote", "p0", "d0"), t
    assert t.transfer_blocks > 0 and t.transfer_bytes > 0 and not t.local_fallback, t
    assert t.lease_released, t  # D reached P's Worker service over mTLS to end the lease
    for proc in (platform.prefill, platform.worker):
        assert "gRPC mTLS" in proc.log(), proc.name
    assert "(mTLS)" in platform.router.log()
    logs = platform.router.log() + platform.local_router.log() + platform.worker.log() + platform.prefill.log()
    assert PASSWORD not in logs  # the Redis URL is redacted


def test_every_process_reaches_redis_over_tls_only(platform):
    """The Redis serves TLS only: the workers registered and the routers list them, so each spoke TLS to it."""
    import socket

    with tls.channel(platform.router.address, _client(platform.pki)) as channel:
        workers = pb_grpc.AdminStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=10).workers
    assert {w.worker_id for w in workers} == {"p0", "d0"}
    assert platform.redis_url.startswith("rediss://")
    port = int(platform.redis_url.rsplit(":", 1)[1].split("/", 1)[0])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:  # a plaintext PING is not answered
        plain.settimeout(2)
        plain.sendall(b"PING\r\n")
        try:
            reply = plain.recv(64)
        except (TimeoutError, ConnectionResetError):
            reply = b""
    assert not reply.startswith((b"+PONG", b"-NOAUTH")), reply


def test_a_prefix_cached_on_the_prefill_worker_is_imported_over_mtls(platform, model_dir):
    """p0 alone holds the prompt's first 896 tokens (prefilled on it by hand, its lease released); the local
    router's request for the whole prompt is prefilled on d0, which first leases that prefix from p0
    (``LeasePrefix`` over mTLS), pulls it and computes only the rest. (Pulling 224 blocks of the tiny model
    is far cheaper than recomputing 896 tokens at any rate the cost policy can have learned here.)"""
    client = _client(platform.pki)
    salt = f"import-{time.monotonic_ns()}"  # nothing of it is cached anywhere yet
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with tls.channel(platform.prefill.address, client) as channel:
        p0 = pb_grpc.WorkerStub(channel)
        warm = p0.Prefill(pb.PrefillRequest(request_id=salt, token_ids=LONG_PROMPT[:897], sampling=params,
                                            cache_salt=salt), timeout=60)
        assert p0.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=warm.handle.lease_id), timeout=10).found
    routers = sum(p.name.startswith("router-") and p.popen.poll() is None for p in platform.procs)
    platform.wait_indexed("p0", LONG_PROMPT[:896], salt=salt, mirrors=routers)  # in the index and every mirror
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=LONG_PROMPT), sampling=params, cache_salt=salt)
    with tls.channel(platform.local_router.address, client) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
    t = responses[-1].timings
    assert [tok for r in responses for tok in r.token_ids] == _offline(model_dir, LONG_PROMPT)
    assert (t.route_kind, t.decode_worker) == ("local", "d0"), t
    assert "(896 tokens from p0)" in t.route_reason and "imported 896 prefix tokens from p0" in t.route_reason, t
    assert t.transfer_blocks == 224 and not t.local_fallback, t
    assert responses[-1].usage.cached_prompt_tokens >= 896


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
    local = ("--policy", "least_loaded", "--disagg-threshold-tokens", "100000")  # the prompt goes to d0
    plain = platform.start_router(*local)  # no TLS: the worker refuses its calls
    other = platform.start_router("--tls-cert", str(pki.node_b.cert), "--tls-key", str(pki.node_b.key),
                                  "--tls-ca", str(pki.ca_a), *local)  # a client certificate of CA b
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


def test_baton_up_with_tls_flags_serves_mtls_on_every_hop(platform, model_dir, expected, tmp_path):
    """`baton up --tls-*` over the TLS-only Redis (its own namespace): the router and both workers it starts
    serve mTLS; a prompt goes P -> D through them token-exact, a plaintext client is refused, and Ctrl-C
    stops every process it started."""
    import os
    import socket
    import subprocess
    import sys

    from tests.integration.cluster import ROOT, interrupt

    pki, port, log_dir = platform.pki, free_port(), tmp_path / "up"
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--model", str(model_dir), "--redis-url", platform.redis_url,
           "--namespace", "tls-up", "--port", str(port), "--metrics-port", str(free_port()), "--http-port", "0",
           "--log-dir", str(log_dir), *_flags(pki.node_a, pki.ca_a), "--num-blocks", "128", "--block-size", "4",
           "--policy", "least_loaded", "--disagg-threshold-tokens", "8"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    log_dir.mkdir()
    with (log_dir / "up.out").open("wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    router = Proc("up-router", up, log_dir / "up.out", address=f"127.0.0.1:{port}")
    rows = []
    try:
        _wait_serving(router, _client(pki), timeout_s=90)
        deadline = time.monotonic() + 60
        while True:  # both workers registered (the router lists them over its mTLS admin API)
            with tls.channel(router.address, _client(pki)) as channel:
                rows = pb_grpc.AdminStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=10).workers
            if {w.role for w in rows} == {"prefill", "decode"}:
                break
            assert time.monotonic() < deadline and up.poll() is None, (log_dir / "up.out").read_text()[-3000:]
            time.sleep(0.5)
        tokens, final = _generate(router.address, _client(pki))
        t = final.timings
        assert tokens == expected
        assert (t.route_kind, t.prefill_worker, t.decode_worker) == ("remote", "prefill-0", "decode-0"), t
        assert t.transfer_blocks > 0 and not t.local_fallback and t.lease_released, t
        assert _refused(router.address, None).code() == grpc.StatusCode.UNAVAILABLE
        for worker in rows:  # each worker refuses a plaintext caller too
            with grpc.insecure_channel(worker.grpc_address) as channel, pytest.raises(grpc.RpcError) as caught:
                pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, worker.worker_id
    finally:
        interrupt(up, 60.0)
    assert up.returncode == 0, (log_dir / "up.out").read_text()[-3000:]
    for address in [router.address, *(w.grpc_address for w in rows)]:  # nothing it started still listens
        host, port_text = address.rsplit(":", 1)
        with pytest.raises(OSError):
            socket.create_connection((host, int(port_text)), timeout=2).close()
