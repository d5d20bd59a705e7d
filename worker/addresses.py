"""The address a worker registers for its peers (routers dial its gRPC port there, decode workers its KV data
plane): ``--advertise-host`` when given, else ``--host`` — unless ``--host`` is a wildcard (0.0.0.0, ::), which
means nothing to a peer (one dialling 0.0.0.0 reaches itself): then the address of this host's interface that
routes to Redis, the one place every peer reaches too. A loopback ``--host`` with Redis on another host is
reachable by no peer: ``loopback_warning`` says so at start.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def advertised_host(host: str, redis_url: str) -> str:
    """What peers dial to reach a worker serving on ``host``."""
    if host not in WILDCARDS:
        return host
    redis_host = _redis_host(redis_url)
    if redis_host is None or _is_loopback(redis_host):
        return "127.0.0.1" if host != "::" else "::1"
    return route_source(redis_host) or socket.gethostname()


def loopback_warning(advertised: str, redis_url: str) -> str | None:
    """Why peers on other hosts cannot reach ``advertised`` (a loopback address while Redis is elsewhere), or None."""
    redis_host = _redis_host(redis_url)
    if not _is_loopback(advertised) or redis_host is None or _is_loopback(redis_host):
        return None
    return (f"this worker advertises {advertised}, a loopback address, but Redis is at {redis_host}: routers and "
            "workers on other hosts cannot reach it; serve on an address they reach (--host ADDRESS, or --host 0.0.0.0 "
            "to advertise the one that routes to Redis; --advertise-host behind NAT)")


def route_source(peer_host: str) -> str | None:
    """This host's source address toward ``peer_host`` (a UDP socket's connect picks the route; nothing is sent)."""
    try:
        infos = socket.getaddrinfo(peer_host, 9, type=socket.SOCK_DGRAM)
        with socket.socket(infos[0][0], socket.SOCK_DGRAM) as sock:
            sock.connect(infos[0][4])
            return sock.getsockname()[0]
    except (OSError, IndexError):
        return None


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC dials it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _redis_host(redis_url: str) -> str | None:
    parts = urlsplit(redis_url)
    return None if parts.scheme == "unix" else parts.hostname


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
