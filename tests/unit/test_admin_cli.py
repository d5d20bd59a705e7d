"""``baton admin`` against a real router and redis-server: status tables, --json, scale, drain / undrain,
plan with a profile file, and a clear error (exit 1, nothing changed) for a missing or wrong token."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest

from kv_transfer.workers import WorkerLoad
from router.admin import cli as admin_cli
from router.admin.cli import table
from router.server import RunningRouter
from tests.redis_server import RedisServer, require_redis_server
from tests.unit.test_admin_server import NS, TOKEN, register, start, worker
from tests.unit.test_router_server import LoopThread, make_model_folder


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    require_redis_server()
    with RedisServer.start() as server:
        yield server


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def router(loop, redis_server, tmp_path_factory) -> Iterator[RunningRouter]:
    running = start(loop, redis_server, make_model_folder(tmp_path_factory.mktemp("cli-model") / "tiny"), NS, TOKEN)
    yield running
    loop.run(running.stop(0.5))


@pytest.fixture
def redis(redis_server) -> Iterator[object]:
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_server.url, decode_responses=True)
    for key in client.scan_iter(f"{NS}:*"):
        client.delete(key)
    yield client
    client.close()


def cli(router, *argv: str, token: str | None = TOKEN) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = ["--router", f"127.0.0.1:{router.port}", *(["--token", token] if token else []), *argv]
    return admin_cli.main(args, out=out, err=err), out.getvalue(), err.getvalue()


def test_status_prints_aligned_tables_without_colors_off_a_tty(router, redis, loop, redis_server):
    load = WorkerLoad(running=2, waiting=0, free_blocks=90, queued_prefill_tokens=0)
    register(loop, redis_server, (worker("prefill-0", "prefill"), load), (worker("d1", "decode"), None))
    redis.set(f"{NS}:pool:decode:desired", 2)
    redis.sadd(f"{NS}:draining", "d1")
    redis.hset(f"{NS}:restarts", "prefill-0", 2)  # what `baton up`'s supervisor counts
    code, out, err = cli(router, "status")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["WORKER", "ROLE", "ADDRESS", "STATE", "RUN", "WAIT", "KV", "USED", "FREE/TOTAL",
                                "LOAD", "AGE", "PREFIX", "HIT", "KV", "GB/S", "RESTARTS"]
    # no worker answers Stats at these addresses: no hit rate, no GB/s; restarts as counted
    assert lines[1].split()[-3:] == ["-", "-", "0"] and lines[2].split()[-1] == "2"
    assert lines[1].split()[:7] == ["d1", "decode", "127.0.0.1:9002", "draining", "-", "-", "-"]
    assert lines[2].split()[:8] == ["prefill-0", "prefill", "127.0.0.1:9009", "up", "2", "0", "10%", "90/100"]
    assert lines[0].index("ROLE") == lines[1].index("decode") == lines[2].index("prefill ")
    assert "\x1b[" not in out
    pools = {line.split()[0]: line.split()[1:] for line in lines[4:7]}
    assert pools == {"POOL": ["DESIRED", "ACTUAL", "DRAINING"], "prefill": ["-", "1", "0"], "decode": ["2", "1", "1"]}
    assert lines[7] == "" and lines[8].startswith("traffic, last ") and "0 requests" in lines[8]


def test_status_json(router, redis, loop, redis_server):
    register(loop, redis_server, (worker("p1", "prefill"), None))
    code, out, _ = cli(router, "--json", "status")
    data = json.loads(out)
    assert code == 0 and [w["worker_id"] for w in data["workers"]] == ["p1"]
    assert data["workers"][0]["state"] == "WORKER_STATE_UP"
    assert [p["role"] for p in data["pools"]] == ["prefill", "decode"]


def test_scale_drain_undrain(router, redis, loop, redis_server):
    register(loop, redis_server, (worker("d1", "decode"), None))
    assert cli(router, "scale", "decode", "2")[:2] == (0, "decode pool: desired unset -> 2 (actual 1)\n")
    assert redis.get(f"{NS}:pool:decode:desired") == "2"
    assert cli(router, "drain", "d1")[:2] == (0, "d1: drained\n")
    assert redis.smembers(f"{NS}:draining") == {"d1"}
    assert cli(router, "undrain", "d1")[:2] == (0, "d1: undrained\n")
    assert cli(router, "undrain", "d1")[:2] == (0, "d1: already undrained\n")
    code, _, err = cli(router, "drain", "ghost")
    assert code == 1 and "INVALID_ARGUMENT" in err and "ghost" in err


def test_plan_with_a_profile_file_prints_the_reasoning_and_applies(router, redis, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"prefill": {"prompt_lens": [128, 4096], "tokens_per_s": [1e4, 1e4]},
                                   "decode": {"batch_sizes": [1, 8, 32, 64], "itl_ms": [10, 12, 20, 36]}}))
    argv = ["plan", "--ttft-p90", "300", "--itl-p90", "20", "--rate", "10", "--isl", "1000", "--osl", "200",
            "--profile", str(profile)]
    code, out, err = cli(router, *argv)
    assert code == 0, err
    assert out.splitlines()[0].split() == ["POOL", "TERM", "VALUE", "UNIT", "NOTE"]
    assert "predicted TTFT p90" in out and out.endswith("plan: 2 prefill, 2 decode\n")
    assert redis.get(f"{NS}:pool:prefill:desired") is None
    code, out, _ = cli(router, "--json", *argv, "--apply")
    assert code == 0 and json.loads(out)["applied"] is True
    assert (redis.get(f"{NS}:pool:prefill:desired"), redis.get(f"{NS}:pool:decode:desired")) == ("2", "2")


@pytest.mark.parametrize("token", [None, "wrong"])
def test_missing_or_wrong_token_fails_clearly_and_changes_nothing(router, redis, token, monkeypatch):
    monkeypatch.delenv("BATON_ADMIN_TOKEN", raising=False)
    code, out, err = cli(router, "scale", "prefill", "4", token=token)
    assert (code, out) == (1, "")
    assert "UNAUTHENTICATED: missing or wrong admin token" in err
    assert redis.get(f"{NS}:pool:prefill:desired") is None


def test_unreachable_router_says_so():
    out, err = io.StringIO(), io.StringIO()
    assert admin_cli.main(["--router", "127.0.0.1:1", "--timeout", "2", "status"], out=out, err=err) == 1
    assert "baton admin: error:" in err.getvalue()


def test_table_aligns_colored_cells():
    lines = table(["A", "N"], [["\x1b[32mup\x1b[0m", "1"], ["draining", "10"]], right=(1,))
    assert lines == ["A          N", "\x1b[32mup\x1b[0m         1", "draining  10"]


def test_colors_only_on_a_terminal(router, redis, loop, redis_server, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    register(loop, redis_server, (worker("d1", "decode"), None))
    out = Terminal()
    assert admin_cli.main(["--router", f"127.0.0.1:{router.port}", "--token", TOKEN, "status"], out=out) == 0
    assert "\x1b[32mup\x1b[0m" in out.getvalue()


def test_connection_options_go_before_or_after_the_command():
    """kubectl-style: ``baton admin status --json`` works as ``baton admin --json status`` does."""
    from router.admin.cli import build_parser

    parser = build_parser()
    for argv in (["--json", "--router", "h:1", "status"], ["status", "--json", "--router", "h:1"],
                 ["--router", "h:1", "status", "--json"]):
        args = parser.parse_args(argv)
        assert (args.json, args.router, args.command) == (True, "h:1", "status"), argv
    defaults = parser.parse_args(["status"])
    assert defaults.json is False and defaults.timeout == 10.0  # not given anywhere: the defaults stand
    assert parser.parse_args(["--timeout", "3", "drain", "d0"]).timeout == 3.0  # before the verb stands too
