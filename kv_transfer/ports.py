"""Ports a process hands to a server it starts (``baton up``'s Redis and metrics, vLLM's NIXL side channel, the
tests' and benches' workers): chosen below the kernel's ephemeral range (Linux: 32768-60999), so no socket some other
process binds to port 0 in the meantime (vLLM's engines open dozens while they load) can take one between this
choice and the server's bind."""

from __future__ import annotations

import random
import socket

PORTS = range(20000, 32768)
_rng = random.Random()  # its own: a caller that seeds the module `random` must not make every run pick the same ports


def free_port() -> int:
    """A loopback TCP port nothing listens on now, outside the ephemeral range (``PORTS``)."""
    for _ in range(200):
        port = _rng.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1} after 200 tries")
