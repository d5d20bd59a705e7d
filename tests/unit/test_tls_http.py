"""The router's HTTP endpoints over TLS, with real certificates (two CAs made by openssl): a router started
with an mTLS config serves its OpenAI front and ``/metrics`` over HTTPS to clients with a certificate of its
CA, and refuses plain HTTP, clients without a certificate and clients with one of another CA; ``/metrics``
with server-only TLS needs no client certificate, and a client that connects and says nothing stalls no one."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from proto import tls
from proto.metrics_http import serve_metrics
from proto.tls import TlsConfig
from router.config import RouterConfig
from router.server import RunningRouter, start_router
from tests.integration.cluster import free_port
from tests.tls_certs import Pki, make_pki
from tests.unit.test_router_server import LoopThread, model_dir, redis_server  # noqa: F401

# what an HTTPS client can see of a refused connection: a reset, a TLS alert, a closed socket
REFUSED = (OSError, http.client.HTTPException)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def router(redis_server, model_dir, pki) -> Iterator[RunningRouter]:  # noqa: F811
    loop = LoopThread()
    config = RouterConfig(model_path=model_dir, redis_url=redis_server.url, ns="tls-http", host="127.0.0.1", port=0,
                          worker_list_ttl_s=0.0)
    server_tls = TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key, ca=pki.ca_a)
    running = loop.run(start_router(config, http_port=0, metrics_port=free_port(), tls=server_tls))
    yield running
    loop.run(running.stop(0.5))
    loop.close()


def _context(config: TlsConfig | None) -> ssl.SSLContext | None:
    return None if config is None else tls.ssl_client_context(config)


def _get(url: str, config: TlsConfig | None) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10, context=_context(config)) as response:
        return response.status, response.read()


def _clients(pki: Pki) -> dict[str, TlsConfig]:
    return {"client of CA a": TlsConfig(cert=pki.client_a.cert, key=pki.client_a.key, ca=pki.ca_a),
            "no certificate": TlsConfig(ca=pki.ca_a),
            "certificate of CA b": TlsConfig(cert=pki.node_b.cert, key=pki.node_b.key, ca=pki.ca_a)}


def test_the_openai_front_serves_https_to_clients_of_its_ca(router, pki, model_dir):  # noqa: F811
    status, body = _get(f"https://127.0.0.1:{router.http_server.port}/v1/models", _clients(pki)["client of CA a"])
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [model_dir.name]


@pytest.mark.parametrize("client", ["plain HTTP", "no certificate", "certificate of CA b"])
def test_the_openai_front_refuses_clients_without_a_certificate_of_its_ca(router, pki, client):
    scheme, config = ("http", None) if client == "plain HTTP" else ("https", _clients(pki)[client])
    with pytest.raises(REFUSED):
        _get(f"{scheme}://127.0.0.1:{router.http_server.port}/v1/models", config)


def test_metrics_serve_https_to_clients_of_its_ca(router, pki):
    status, body = _get(f"https://127.0.0.1:{router.metrics_server.port}/metrics", _clients(pki)["client of CA a"])
    assert status == 200 and "baton:time_to_first_token_seconds_bucket" in body.decode()


@pytest.mark.parametrize("client", ["plain HTTP", "no certificate", "certificate of CA b"])
def test_metrics_refuse_clients_without_a_certificate_of_its_ca(router, pki, client):
    scheme, config = ("http", None) if client == "plain HTTP" else ("https", _clients(pki)[client])
    with pytest.raises(REFUSED):
        _get(f"{scheme}://127.0.0.1:{router.metrics_server.port}/metrics", config)
    # and the endpoint still serves the next, valid client
    assert _get(f"https://127.0.0.1:{router.metrics_server.port}/metrics", _clients(pki)["client of CA a"])[0] == 200


def test_metrics_with_server_only_tls_need_no_client_certificate(pki):
    registry = CollectorRegistry()
    Counter("baton:probe", "a probe", registry=registry).inc()
    server = serve_metrics(registry, "127.0.0.1", free_port(), TlsConfig(cert=pki.node_a.cert, key=pki.node_a.key))
    assert server is not None
    try:
        status, body = _get(f"https://127.0.0.1:{server.port}/metrics", TlsConfig(ca=pki.ca_a))
        with pytest.raises(REFUSED):
            _get(f"http://127.0.0.1:{server.port}/metrics", None)
    finally:
        server.stop()
    assert status == 200 and "baton:probe_total 1.0" in body.decode()


def test_a_silent_client_does_not_stall_metrics_over_tls(router, pki):
    """The handshake runs on the request's own thread: a connection that sends nothing blocks only itself."""
    with socket.create_connection(("127.0.0.1", router.metrics_server.port), timeout=5):
        status, _ = _get(f"https://127.0.0.1:{router.metrics_server.port}/metrics", _clients(pki)["client of CA a"])
    assert status == 200
