"""The event loop every Baton server runs on: uvloop unless turned off (``--no-uvloop`` or ``BATON_UVLOOP=0``).

Every output token crosses the router's event loop twice (read from the decode worker, written to the client)
and the worker's once, so the loop's per-callback cost is part of the relay's capacity (docs/benchmarks.md,
"Relay capacity", measures it). grpc.aio runs on uvloop (its completion queue poller hands results to whichever
loop is running); the integration tests that start routers and workers run on it. Lives beside the other
plumbing every server shares (``proto.metrics_http``) because the router may not import the nodes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

log = logging.getLogger(__name__)

ENV_VAR = "BATON_UVLOOP"
_OFF = frozenset({"0", "false", "no", "off"})

T = TypeVar("T")


def add_argument(parser: Any) -> None:
    """``--no-uvloop``: the standard library's loop instead (for comparison, or a platform without uvloop)."""
    parser.add_argument("--no-uvloop", dest="uvloop", action="store_false", default=None,
                        help=f"run on asyncio's default event loop instead of uvloop (also ${ENV_VAR}=0)")


def wanted(flag: bool | None, environ: Mapping[str, str]) -> bool:
    """uvloop unless the flag (``False`` from ``--no-uvloop``) or ``BATON_UVLOOP`` turns it off."""
    if flag is not None:
        return flag
    return environ.get(ENV_VAR, "1").strip().lower() not in _OFF


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool) -> T:
    """``asyncio.run(main)`` on uvloop when asked and importable (a missing uvloop only warns)."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed: running on asyncio's default event loop")
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)


def loop_name() -> str:
    """The running loop's kind, for logs and benchmark reports: ``uvloop`` or ``asyncio``."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
