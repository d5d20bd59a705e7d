"""The ``/metrics`` endpoint every Baton process serves (router and workers alike): prometheus_client's
WSGI app over the process's own registry, on a thread-per-request HTTP server on a daemon thread. Lives
beside the other wire plumbing shared by all servers (``proto.malformed``) because the router may not
import the nodes.

With the process's ``TlsConfig`` it serves HTTPS with the context of ``proto.tls.ssl_server_context`` (the
certificate of its gRPC port; with a CA, client certificates of that CA are required: mTLS). The TLS
handshake runs on the request's own thread under a deadline (prometheus_client's built-in TLS does it on
the accepting thread without one, where a client that connects and sends nothing stalls every scrape)."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from proto.tls import TlsConfig, describe, ssl_server_context

logger = logging.getLogger(__name__)
CLIENT_TIMEOUT_S = 10.0  # per connection: the TLS handshake, then each read of the request


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint."""

    httpd: Any
    port: int

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        """No access log: scrapes come every few seconds."""


class _MetricsHttpServer(ThreadingMixIn, WSGIServer):
    """Thread per request; over TLS each accepted socket is wrapped, and its handshake done, on that thread."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], context: ssl.SSLContext | None) -> None:
        self.address_family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self._context = context
        super().__init__(address, _QuietHandler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        sock.settimeout(CLIENT_TIMEOUT_S)
        if self._context is not None:
            sock = self._context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.do_handshake()
            except OSError as exc:  # plaintext, no or a foreign client certificate, a silent client
                logger.debug("metrics client %s refused: %s", client_address, exc)
                return
        super().finish_request(request, client_address)


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None,
                  tls: TlsConfig | None = None) -> MetricsServer | None:
    """Serve ``registry`` on ``host:port`` (HTTPS when ``tls`` is set, mTLS when it has a CA); ``None`` or 0
    serves nothing, a taken port only warns."""
    if not port:
        return None
    try:
        httpd = _MetricsHttpServer((host, port), None if tls is None else ssl_server_context(tls))
    except OSError as exc:  # serving requests matters more than exporting figures about them
        logger.warning("metrics endpoint on %s:%d not started: %s", host, port, exc)
        return None
    httpd.set_app(make_wsgi_app(registry))
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    logger.info("metrics on %s://%s:%d/metrics (%s)", "http" if tls is None else "https", host, port, describe(tls))
    return MetricsServer(httpd, port)
