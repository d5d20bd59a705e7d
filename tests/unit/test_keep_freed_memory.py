"""``engine.engine_setup.keep_freed_memory``: after it, memory a large tensor freed stays with the process for the
next step (glibc would otherwise unmap it at once and fault fresh pages in next time)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.engine_setup import keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_a_freed_large_tensor_stays_resident_for_the_next():
    assert keep_freed_memory()
    before = rss_bytes()
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page touched
    del big
    assert rss_bytes() - before > 48 << 20  # kept (glibc's default serves this from an mmap it unmaps on free)
    for _ in range(8):  # freed memory is reused: the process does not grow by a tensor each time
        again = torch.ones(64 << 20, dtype=torch.uint8)
        del again
    assert rss_bytes() - before < 200 << 20
