"""proto/tls.py with real certificates (two CAs made by openssl): the config refuses bad files and flag
combinations clearly; a TLS server refuses plaintext and unknown CAs; an mTLS server refuses clients
without a certificate of its CA; health checking works over both."""

from __future__ import annotations

import argparse
import asyncio
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import tls
from proto.tls import TlsConfig, TlsConfigError
from tests.tls_certs import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# ---- config --------------------------------------------------------------------------------------

def test_nothing_set_is_plaintext():
    assert TlsConfig.from_values(None, None, None) is None
    assert TlsConfig.from_values("", "", "") is None
    assert tls.describe(None) == "plaintext"


def test_a_full_config_is_mutual(pki):
    config = TlsConfig.from_values(str(pki.node_a.cert), str(pki.node_a.key), str(pki.ca_a))
    assert config.enabled and config.mutual and tls.describe(config) == "mTLS"
    server_only = TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key)
    assert server_only.enabled and not server_only.mutual and tls.describe(server_only) == "TLS"
    client_only = TlsConfig(ca=pki.ca_a)
    assert client_only.enabled
    with pytest.raises(TlsConfigError, match="a server also needs --tls-cert and --tls-key"):
        client_only.require_server_identity()


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: dict(key=p.node_a.key), "--tls-key needs --tls-cert"),
    (lambda p: dict(cert=p.node_a.cert), "--tls-cert needs --tls-key"),
    (lambda p: dict(ca=p.ca_a.parent / "missing.pem"), "missing.pem: no such file"),
    (lambda p: dict(cert=p.node_a.cert, key=p.node_b.key), "the private key does not match the certificate"),
    (lambda p: dict(cert=p.node_a.key, key=p.node_a.key), "cannot parse the certificate chain or the private key"),
    (lambda p: dict(ca=p.node_a.key), "--tls-ca .*not a usable CA bundle"),
    (lambda p: dict(ca=p.node_a.cert.with_suffix(".ext")), "not a PEM file"),
    (lambda p: dict(server_name="baton-worker"), "--tls-server-name needs TLS"),
])
def test_bad_configs_fail_clearly(pki, make, message):
    with pytest.raises(TlsConfigError, match=message):
        TlsConfig(**make(pki))


def test_an_unreadable_file_fails_clearly(pki, tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    locked = tmp_path / "locked.pem"
    locked.write_bytes(pki.ca_a.read_bytes())
    locked.chmod(0)
    with pytest.raises(TlsConfigError, match="cannot read it"):
        TlsConfig(ca=locked)


def test_flags_default_to_the_environment(pki):
    parser = argparse.ArgumentParser()
    env = {tls.ENV_CERT: str(pki.node_a.cert), tls.ENV_KEY: str(pki.node_a.key), tls.ENV_CA: str(pki.ca_a)}
    tls.add_arguments(parser, env)
    config = tls.from_args(parser.parse_args([]))
    assert config == TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key, ca=pki.ca_a)
    overridden = tls.from_args(parser.parse_args(["--tls-ca", str(pki.ca_b)]))
    assert overridden.ca == pki.ca_b
    plain = argparse.ArgumentParser()
    tls.add_arguments(plain, {})
    assert tls.from_args(plain.parse_args([])) is None


# ---- a real gRPC server (health checking) over TLS and mTLS -----------------------------------------

@pytest.fixture
def serve(pki):
    servers: list[grpc.Server] = []

    def start(config: TlsConfig | None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = tls.add_port(server, "127.0.0.1:0", config)
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def _check(address: str, config: TlsConfig | None) -> grpc.StatusCode | str:
    """SERVING, or the status code the call failed with."""
    with tls.channel(address, config) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_tls_server_refuses_plaintext_and_unknown_cas(pki, serve):
    address = serve(TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key))
    assert _check(address, TlsConfig(ca=pki.ca_a)) == "SERVING"
    # no client certificate is asked for, but one given does no harm
    assert _check(address, TlsConfig(cert=pki.client_a.cert, key=pki.client_a.key, ca=pki.ca_a)) == "SERVING"
    assert _check(address, None) == grpc.StatusCode.UNAVAILABLE
    assert _check(address, TlsConfig(ca=pki.ca_b)) == grpc.StatusCode.UNAVAILABLE
    assert _check(address, TlsConfig(cert=pki.client_a.cert, key=pki.client_a.key)) == grpc.StatusCode.UNAVAILABLE


def test_mtls_server_requires_a_client_certificate_of_its_ca(pki, serve):
    address = serve(TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key, ca=pki.ca_a))
    assert _check(address, TlsConfig(cert=pki.client_a.cert, key=pki.client_a.key, ca=pki.ca_a)) == "SERVING"
    assert _check(address, TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key, ca=pki.ca_a)) == "SERVING"
    assert _check(address, TlsConfig(ca=pki.ca_a)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    other_ca = TlsConfig(cert=pki.node_b.cert, key=pki.node_b.key, ca=pki.ca_a)
    assert _check(address, other_ca) == grpc.StatusCode.UNAVAILABLE
    assert _check(address, None) == grpc.StatusCode.UNAVAILABLE


def test_server_name_is_checked_against_the_certificate(pki, serve):
    address = serve(TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key))
    assert _check(address, TlsConfig(ca=pki.ca_a, server_name="localhost")) == "SERVING"  # in the SAN
    wrong = TlsConfig(ca=pki.ca_a, server_name="not-in-the-cert.example")
    assert _check(address, wrong) == grpc.StatusCode.UNAVAILABLE


def test_aio_channel_speaks_mtls(pki, serve):
    address = serve(TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key, ca=pki.ca_a))

    async def check(config: TlsConfig | None) -> str:
        async with tls.aio_channel(address, config) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    assert asyncio.run(check(TlsConfig(cert=pki.client_a.cert, key=pki.client_a.key, ca=pki.ca_a))) == "SERVING"
    assert asyncio.run(check(TlsConfig(ca=pki.ca_a))) == "UNAVAILABLE"
    assert asyncio.run(check(None)) == "UNAVAILABLE"


def test_a_server_without_a_certificate_is_refused(pki):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    with pytest.raises(TlsConfigError, match="a server also needs"):
        tls.add_port(server, "127.0.0.1:0", TlsConfig(ca=pki.ca_a))
    server.stop(0)



def test_stdlib_contexts_follow_the_same_rules(pki):
    """``ssl_server_context``/``ssl_client_context``: what a socket-level data plane would use."""
    import socket
    import ssl
    import threading

    server_context = tls.ssl_server_context(TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key, ca=pki.ca_a))

    def handshake(client: TlsConfig) -> bool:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            outcome: list[bool] = []

            def accept() -> None:
                conn, _ = listener.accept()
                try:
                    with server_context.wrap_socket(conn, server_side=True) as tls_conn:
                        tls_conn.sendall(b"ok")
                        outcome.append(True)
                except (ssl.SSLError, OSError):
                    outcome.append(False)

            thread = threading.Thread(target=accept)
            thread.start()
            try:
                with socket.create_connection(listener.getsockname(), timeout=5) as raw, \
                        tls.ssl_client_context(client).wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                    sock.recv(2)
            except (ssl.SSLError, OSError):
                pass
            thread.join(10)
            return outcome == [True]

    assert handshake(TlsConfig(cert=pki.client_a.cert, key=pki.client_a.key, ca=pki.ca_a))
    assert not handshake(TlsConfig(ca=pki.ca_a))  # no client certificate
    assert not handshake(TlsConfig(cert=pki.node_b.cert, key=pki.node_b.key, ca=pki.ca_a))  # another CA
