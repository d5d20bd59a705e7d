"""``bench.kv_transfer`` on a tiny size (tcp + raw only) and the peers' READ descriptors; no peer packages."""

from __future__ import annotations

import ctypes
import json
import os
import sys
import types

import numpy as np
import pytest

from bench import kv_device, kv_peers, kv_transfer
from kv_transfer.layout import KVBuffer

SMALL = kv_transfer.SMALL


def test_tiny_run_writes_results_with_the_expected_bytes(tmp_path, monkeypatch):
    for name, value in kv_transfer.ENV_DEFAULTS.items():  # main sets them; restored after the test
        monkeypatch.setenv(name, os.environ.get(name, value))
    out = tmp_path / "kv.json"
    kv_transfer.main(["--tokens", "64", "--runs", "2", "--transports", "tcp", "nosuch", "--peers", "--out", str(out)])

    doc = json.loads(out.read_text())
    assert doc["runs"] == 2
    assert set(doc["systems"]) == {"raw", "raw/blocking", "raw/epoll", "plain/<pattern>", "memcpy", "tcp"}
    assert set(doc["skipped"]) == {"nosuch"}  # an unknown kind is reported, not a crash
    [result] = doc["results"]
    assert (result["tokens"], result["blocks"]) == (64, 4)
    assert result["num_bytes"] == 4 * SMALL.bytes_per_block == 4 * 128 * 1024
    assert set(result["systems"]) == {"raw", "raw/blocking", "raw/epoll", "memcpy", *PLAIN_ROWS, "tcp/contiguous",
                                      "tcp/scattered", "tcp/merged"}
    _assert_each_pattern_is_against_its_plain_row(result["systems"])
    for name, stats in result["systems"].items():
        assert stats["bytes_moved"] == result["num_bytes"], name
        assert len(stats["seconds"]) == 2 and all(s > 0 for s in stats["seconds"])
        assert stats["gbps"] > 0 and 0 < stats["p50_ms"] <= stats["p99_ms"]
    assert result["systems"]["raw"]["ratio_vs_raw"] == 1.0
    _assert_raw_is_the_faster_variant(result["systems"])
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


PLAIN_ROWS = ("plain/contiguous", "plain/scattered", "plain/merged")


def _assert_each_pattern_is_against_its_plain_row(systems: dict) -> None:
    for pattern in kv_transfer.PATTERNS:
        stats, plain = systems[f"tcp/{pattern}"], systems[f"plain/{pattern}"]
        assert stats["plain_gbps"] == plain["gbps"]
        assert stats["ratio_vs_plain"] == pytest.approx(stats["gbps"] / plain["gbps"])
        assert "ratio_vs_plain" not in plain
    assert "ratio_vs_plain" not in systems["raw"] and "ratio_vs_plain" not in systems["memcpy"]


def _assert_raw_is_the_faster_variant(systems: dict) -> None:
    raw, variants = systems["raw"], {name: systems[name] for name in kv_transfer.RAW_VARIANTS}
    best = max(variants, key=lambda name: variants[name]["gbps"])
    assert raw["best_of"] == best and raw["seconds"] == variants[best]["seconds"]
    assert all(stats["ratio_vs_raw"] <= 1.0 for stats in variants.values())


def test_isolated_run_has_a_phase_per_system_with_its_own_raw(tmp_path, monkeypatch):
    for name, value in kv_transfer.ENV_DEFAULTS.items():
        monkeypatch.setenv(name, os.environ.get(name, value))
    out = tmp_path / "kv.json"
    kv_transfer.main(["--isolate", "--tokens", "64", "--runs", "2", "--transports", "tcp", "nosuch", "--peers",
                      "--out", str(out)])

    doc = json.loads(out.read_text())
    assert doc["isolated"] is True
    assert set(doc["systems"]) == {"raw", "raw/blocking", "raw/epoll", "plain/<pattern>", "memcpy", "tcp"}
    assert set(doc["skipped"]) == {"nosuch"}
    [phase_raw] = doc["phases"]["tcp"]["raw"]
    assert phase_raw["tokens"] == 64 and len(phase_raw["seconds"]) == 2
    threads = doc["phases"]["tcp"]["threads"]
    assert threads["processes_left_after_phase"] == 0 and threads["client_peak"] >= 1
    [result] = doc["results"]
    assert set(result["systems"]) == {"raw", "raw/blocking", "raw/epoll", "memcpy", *PLAIN_ROWS, "tcp/contiguous",
                                      "tcp/scattered", "tcp/merged"}
    for name in ("memcpy", *PLAIN_ROWS):  # measured in the phase, pooled like raw
        assert len(result["systems"][name]["seconds"]) == 2 and "phase" not in result["systems"][name]
    _assert_each_pattern_is_against_its_plain_row(result["systems"])  # one phase: its plain rows are the pooled
    for name in ("tcp/contiguous", "tcp/scattered", "tcp/merged"):
        stats = result["systems"][name]
        assert stats["bytes_moved"] == result["num_bytes"] and stats["phase"] == "tcp"
        assert stats["raw_gbps"] == phase_raw["gbps"]
        assert stats["ratio_vs_raw"] == pytest.approx(stats["gbps"] / phase_raw["gbps"])
    assert result["systems"]["raw"]["ratio_vs_raw"] == 1.0
    _assert_raw_is_the_faster_variant(result["systems"])  # chosen again from the pooled variants
    assert phase_raw["best_of"] in kv_transfer.RAW_VARIANTS
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_read_descriptors_cover_exactly_the_requested_blocks():
    src, dst = _filled(12), KVBuffer.allocate(SMALL, 10)
    src_ids, dst_ids = [1, 2, 3, 7, 8, 11], [0, 1, 5, 2, 3, 9]
    src_addrs, dst_addrs, lengths = kv_peers.read_descriptors(
        kv_peers.buffer_address(src), src.num_blocks, dst, src_ids, dst_ids
    )
    # runs consecutive on both sides: (1,0,2) (3,5,1) (7,2,2) (11,9,1) -> 4 per layer
    assert len(lengths) == 4 * SMALL.num_layers
    assert int(lengths.sum()) == len(src_ids) * SMALL.bytes_per_block
    for s, d, n in zip(src_addrs.tolist(), dst_addrs.tolist(), lengths.tolist()):
        ctypes.memmove(d, s, n)  # what a READ does
    expected = KVBuffer.allocate(SMALL, 10)
    expected.copy_blocks_from(src, src_ids, dst_ids)
    assert np.array_equal(dst.array, expected.array)


def test_prompt_blocks_are_distinct_and_in_range():
    patterns = kv_transfer.prompt_blocks(1000, 200)
    assert set(patterns) == set(kv_transfer.PATTERNS)
    src_ids, first = patterns["contiguous"]
    assert len(src_ids) == 63 and src_ids == sorted(set(src_ids)) and max(src_ids) < 200
    assert src_ids != first == list(range(63))  # spread over the pool, into the first blocks
    assert patterns["scattered"][0] == src_ids
    assert len(set(patterns["scattered"][1])) == 63 and max(patterns["scattered"][1]) < 200
    assert patterns["merged"] == (first, first)  # one run per layer on both sides


def test_a_peer_that_does_not_import_is_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setitem(kv_peers._MODULES, "nixl", ("baton_no_such_module",))
    with pytest.raises(kv_peers.PeerUnavailable, match="nixl-cu1[23] not usable.*baton_no_such_module"):
        kv_peers.check_available("nixl")


def test_the_nixl_peer_imports_nixl_cu13_first_then_cu12(monkeypatch):
    """The lent GPU machine has nixl-cu13 (module nixl_cu13), this one nixl-cu12: either is the peer."""
    cu13, cu12 = types.ModuleType("nixl_cu13"), types.ModuleType("nixl_cu12")
    cu13.nixl_agent = cu12.nixl_agent = object
    monkeypatch.setitem(sys.modules, "nixl_cu13", cu13)
    monkeypatch.setitem(sys.modules, "nixl_cu12", cu12)
    assert kv_peers._import("nixl") is cu13
    monkeypatch.setitem(sys.modules, "nixl_cu13", None)  # not installed: import raises ImportError
    assert kv_peers._import("nixl") is cu12


def test_device_cuda_refuses_clearly_without_a_gpu(capsys):
    if kv_device.require_cuda() is None:
        pytest.skip("a CUDA GPU is here")
    with pytest.raises(SystemExit):
        kv_transfer.parse_args(["--device", "cuda"])
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err
    assert kv_transfer.parse_args(["--device", "cpu"]).device == "cpu"


def _filled(num_blocks: int) -> KVBuffer:
    buffer = KVBuffer.allocate(SMALL, num_blocks)
    buffer.array[:] = np.random.default_rng(0).integers(0, 256, buffer.array.shape, dtype=np.uint8)
    return buffer
