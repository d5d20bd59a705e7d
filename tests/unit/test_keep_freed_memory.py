"""``engine.engine_setup.keep_freed_memory``: a fresh process's large temporaries (up to 32 MiB) come from the heap and
stay there once freed (glibc's defaults serve each one above a moving threshold from an mmap it unmaps on free, and
trim the heap's top: pages faulted in again every step). Each case runs in a fresh interpreter: glibc's
thresholds move with what a process has freed before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.cluster import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

PROBE = """
import ctypes, json, sys
import torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "keep":
    from engine.engine_setup import keep_freed_memory
    assert keep_freed_memory()
start = libc.mallinfo2()
one = torch.ones(16 << 20, dtype=torch.uint8)
mmapped = libc.mallinfo2().hblkhd - start.hblkhd
del one
many = [torch.ones(20 << 20, dtype=torch.uint8) for _ in range(4)]
peak = libc.mallinfo2()
del many
print(json.dumps({"mmapped": mmapped, "trimmed": peak.arena - libc.mallinfo2().arena,
                  "heap_mmapped": peak.hblkhd}))
"""


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_large_temporaries_come_from_the_heap_and_stay_there_once_freed():
    default, kept = probe("default"), probe("keep")
    assert default["mmapped"] >= 16 << 20 and default["heap_mmapped"] >= 80 << 20, default  # glibc's own ways
    assert kept["mmapped"] == 0 and kept["trimmed"] == 0 and kept["heap_mmapped"] < 16 << 20, kept
