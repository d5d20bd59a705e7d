"""The ``/metrics`` endpoint every Baton process serves (router and workers alike): prometheus_client's
own HTTP server on a daemon thread, over the process's own registry. Lives beside the other wire
plumbing shared by all servers (``proto.malformed``) because the router may not import the nodes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint."""

    httpd: Any
    port: int

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None) -> MetricsServer | None:
    """Serve ``registry`` on ``host:port``; ``None`` or 0 serves nothing, a taken port only warns."""
    if not port:
        return None
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # serving requests matters more than exporting figures about them
        logger.warning("metrics endpoint on %s:%d not started: %s", host, port, exc)
        return None
    logger.info("metrics on http://%s:%d/metrics", host, port)
    return MetricsServer(httpd, port)
