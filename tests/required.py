"""What a run requires of its machine: ``BATON_TEST_REQUIRE=root,mooncake,redis`` (``.ci/run`` sets it) turns the
skips of tests that lack one of those into failures, so a CI run cannot lose the multi-host or store suites with
only a skip line. Unset (a developer's run), the tests skip with their reason as before."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

KNOWN = frozenset({"root", "mooncake", "redis"})
REQUIRED = frozenset(filter(None, os.environ.get("BATON_TEST_REQUIRE", "").split(",")))
if REQUIRED - KNOWN:
    raise ValueError(f"BATON_TEST_REQUIRE names {sorted(REQUIRED - KNOWN)}; known: {sorted(KNOWN)}")


def unavailable(what: str, reason: str | None) -> str | None:
    """``reason`` (why the tests that need ``what`` skip; None: they run), or a failure when the run requires it."""
    if reason is not None and what in REQUIRED:
        pytest.fail(f"BATON_TEST_REQUIRE names {what}, but: {reason}", pytrace=False)
    return reason


def skip_unless(what: str, reason: str | None) -> None:
    """Skip the calling test or module (fail, when the run requires ``what``) unless ``reason`` is None."""
    if unavailable(what, reason) is not None:
        pytest.skip(reason, allow_module_level=True)


def import_or_skip(module: str, what: str, reason: str) -> ModuleType:
    """``pytest.importorskip`` that fails instead when the run requires ``what``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        skip_unless(what, f"{reason} ({exc})")
        raise  # not reached: skip_unless raised
