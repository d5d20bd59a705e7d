"""The router as a process: it never imports torch (DESIGN.md), `baton router` serves until SIGTERM and
stops cleanly, and both CLIs answer --help."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.redis_server import RedisServer, require_redis_server
from tests.unit.test_router_server import make_model_folder

ROOT = Path(__file__).resolve().parents[2]

# Starts a real router on a free port, serves a Generate (no workers: UNAVAILABLE) and a Tokenize, stops.
_RUN_ROUTER = """
import asyncio, sys
from pathlib import Path
import grpc
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.config import RouterConfig
from engine.model_source import resolve_model
from router.server import start_router

async def main(model_dir, redis_url):
    resolve_model("tiny", build=False)
    router = await start_router(RouterConfig(model_path=Path(model_dir), redis_url=redis_url, host="127.0.0.1", port=0))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            async for _ in stub.Generate(pb.GenerateRequest(prompt="hi")):
                pass
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        assert (await stub.Tokenize(pb.TokenizeRequest(prompt="hi"))).token_ids
    await router.stop(0.5)

asyncio.run(main(sys.argv[1], sys.argv[2]))
heavy = sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules)
assert not heavy, heavy
print("NO-TORCH-OK")
"""


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_router_modules_import_without_torch():
    code = "import router.server, router.main, router.generate_cli, sys; assert 'torch' not in sys.modules"
    result = _run(["-c", code])
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def redis_server():
    require_redis_server()
    with RedisServer.start() as server:
        yield server


def test_running_router_has_no_torch(tmp_path, redis_server):
    model_dir = make_model_folder(tmp_path / "tiny")
    result = _run(["-c", _RUN_ROUTER, str(model_dir), redis_server.url])
    assert result.returncode == 0 and "NO-TORCH-OK" in result.stdout, result.stderr[-3000:]


def test_a_router_serving_a_gguf_reads_its_tokenizer_without_torch(redis_server):
    from engine.model_source import resolve_model

    gguf = resolve_model("smollm2").path  # make install installs it
    result = _run(["-c", _RUN_ROUTER, str(gguf), redis_server.url])
    assert result.returncode == 0 and "NO-TORCH-OK" in result.stdout, result.stderr[-3000:]


def test_cli_help_exits_cleanly():
    for module in ("router.main", "router.generate_cli"):
        result = _run(["-m", module, "--help"])
        assert result.returncode == 0 and "usage: baton" in result.stdout, result.stderr


def test_router_process_serves_then_stops_on_sigterm(tmp_path, redis_server):
    import grpc

    from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc

    model_dir = make_model_folder(tmp_path / "tiny")
    args = [sys.executable, "-m", "router.main", "--redis-url", redis_server.url, "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "baton router listening on 127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        port = int(line.split("127.0.0.1:")[1].split()[0])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert info.model == "tiny"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_router_process_reports_a_bad_model_folder(tmp_path):
    result = _run(["-m", "router.main", "--model", str(tmp_path / "missing"), "--port", "0"])
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr
    (tmp_path / "empty").mkdir()
    result = _run(["-m", "router.main", "--model", str(tmp_path / "empty"), "--port", "0"])
    assert result.returncode == 2 and "no tokenizer.json" in result.stderr and "Traceback" not in result.stderr


def test_policy_flags_reach_the_router_config(tmp_path):
    from router.main import build_parser, config_from_args

    args = build_parser().parse_args(["--model", str(tmp_path), "--policy", "prefix_overlap",
                                      "--router-temperature", "0.25", "--itl-target-ms", "40"])
    policy = config_from_args(args).policy
    assert (policy.policy, policy.cost.temperature_s, policy.cost.itl_target_s) == ("prefix_overlap", 0.25, 0.04)
    defaults = config_from_args(build_parser().parse_args(["--model", str(tmp_path)])).policy
    assert (defaults.policy, defaults.cost.temperature_s, defaults.cost.itl_target_s) == ("cost", 0.0, 0.1)


def test_policy_flags_reject_bad_values(tmp_path, capsys):
    from router.main import build_parser, config_from_args

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--policy", "fastest"])
    with pytest.raises(ValueError):
        config_from_args(parser.parse_args(["--model", str(tmp_path), "--router-temperature", "-1"]))
