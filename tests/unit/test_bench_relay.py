"""``bench relay``: its arithmetic, its table and plot, and (slow) one short run end to end against the real
router and the synthetic fast decode worker (``bench.relay_worker``, a real process over real gRPC)."""

from __future__ import annotations

import json

import pytest

from bench.relay_load import Point
from bench.relay_report import plot, print_table


def _row(path: str, processes: int, concurrency: int, tokens_per_s: float) -> dict:
    return {"path": path, "api": "grpc", "loop": "uvloop", "router_processes": processes, "concurrency": concurrency,
            "tokens_per_s": tokens_per_s, "messages_per_token": 1.0, "requests": 10, "seconds": 2.0,
            "router_cores": 0.9 if processes else 0.0, "worker_cores": 0.5, "client_cores": 0.5,
            "tokens_per_router_core_s": tokens_per_s / 0.9 if processes else None}


def test_a_point_gives_tokens_per_second_and_per_core_second():
    point = Point(path="router", concurrency=4, tokens=10_000, messages=5_000, requests=20, seconds=2.0,
                  cpu_s={"router0": 0.5, "router1": 0.0, "client": 1.0, "machine": 2.0})
    assert point.tokens_per_s == 5_000 and point.other_cores == pytest.approx(0.25)
    assert point.cores("client") == 0.5 and point.cores("worker") == 0.0
    assert point.tokens_per_core_s("router0") == 20_000 and point.tokens_per_core_s("router1") is None


def test_the_table_and_the_plot(tmp_path, capsys):
    rows = [_row("direct", 0, c, 30_000.0) for c in (1, 16)] + [_row("router", 1, c, 8_000.0) for c in (1, 16)]
    report = {"cpus": 2, "loadavg_before": (0.5, 0.6, 0.7), "max_tokens": 512, "rows": rows}
    print_table(report)
    out = capsys.readouterr().out
    assert "direct (uvloop)" in out and "router x1 grpc (uvloop)" in out and "8,889" in out
    plot(report, tmp_path / "relay.png")
    assert (tmp_path / "relay.png").stat().st_size > 1000


@pytest.mark.slow
def test_a_short_run_through_one_and_two_router_processes(tmp_path):
    from bench.relay import main

    out = tmp_path / "relay.json"
    assert main(["--concurrency", "4", "--max-tokens", "64", "--duration-s", "0.5", "--warmup-s", "0.2",
                 "--loops", "uvloop", "--router-processes", "1", "2", "--apis", "grpc", "http",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["path"], r["router_processes"], r["api"]) for r in rows} == {
        ("direct", 0, "grpc"), ("router", 1, "grpc"), ("router", 1, "http"), ("router", 2, "grpc"),
        ("router", 2, "http")}
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["requests"] > 0
        assert (row["router_cores"] > 0) == (row["path"] == "router")
    direct = next(r for r in rows if r["path"] == "direct")
    assert direct["messages_per_token"] == pytest.approx(1.0, abs=0.01)  # the worker sends one token a message
