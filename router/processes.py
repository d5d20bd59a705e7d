"""``baton router --processes N``: N router processes serving one port, so the relay can use N cores.

Every output token crosses a router's event loop, and one Python process uses one core for it (docs/benchmarks.md,
"Relay capacity"). The kernel's ``SO_REUSEPORT`` lets several processes listen on one port and hands each new
*connection* to one of them. Every process of the group sets it (``--reuse-port``: the first because of
``--processes``, the others are started with it) on the gRPC server (``grpc.so_reuseport``, which gRPC's Python
server would set by default on Linux: a router turns it off otherwise, so that a second router on a taken port fails
at start instead of silently taking half the connections) and on the OpenAI front (``router.openai.http``). A
client's channel is one connection, so it stays with one process; many clients (or a client with several channels)
spread over all of them.

The process started by the user serves as number 0 and starts the N-1 others with its own arguments, each with
``/metrics`` on the next port (``--metrics-port`` + i: a scrape must reach one process, not whichever the kernel
picks). They share nothing but the port and Redis: each has its own in-flight books (as separate routers do,
DESIGN.md "Scale and hosts"). The others get SIGTERM when number 0 stops, and die with it if it is killed
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def sibling_argv(argv: list[str], index: int, metrics_port: int) -> list[str]:
    """``argv`` for process ``index``: without ``--processes``, ``/metrics`` on ``metrics_port + index`` (0: none)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            out.append(arg)
    return [*out, "--metrics-port", str(metrics_port + index if metrics_port else 0), "--reuse-port"]


def _die_with_parent() -> None:
    """In the child between fork and exec: SIGTERM when the parent dies, however it dies (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: stopping the siblings is left to stop_siblings
        pass


def start_siblings(argv: list[str], processes: int, metrics_port: int) -> list[subprocess.Popen]:
    """Start processes 1..N-1 of a ``--processes N`` router (their output goes where this one's goes)."""
    children = []
    for index in range(1, processes):
        cmd = [sys.executable, "-m", "deploy.cli", "router", *sibling_argv(argv, index, metrics_port)]
        children.append(subprocess.Popen(cmd, preexec_fn=_die_with_parent))
    log.info("started %d more router processes on the same port: pids %s", len(children), [c.pid for c in children])
    return children


def stop_siblings(children: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each (they stop gracefully, as this one did), then SIGKILL any still running after ``grace_s``."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(grace_s + 5.0)
        except subprocess.TimeoutExpired:
            log.warning("router process %d did not stop in time: killing it", child.pid)
            child.kill()
            child.wait()
