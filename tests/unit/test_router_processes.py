"""Several router processes on one port (``baton router --processes N``, ``router.processes``) and the event loop
they run on (``proto.event_loop``: uvloop unless ``--no-uvloop`` or ``BATON_UVLOOP=0``)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc, event_loop
from router.processes import sibling_argv
from tests.redis_server import RedisServer, free_port, require_redis_server
from tests.unit.test_router_server import make_model_folder

ROOT = Path(__file__).resolve().parents[2]


def test_siblings_get_the_arguments_without_processes_and_the_next_metrics_port():
    argv = ["--port", "50051", "--processes", "2", "--metrics-port", "9450", "--processes=2", "--no-uvloop"]
    assert sibling_argv(argv, 1, 9450) == ["--port", "50051", "--metrics-port", "9450", "--no-uvloop",
                                           "--metrics-port", "9451", "--reuse-port"]
    assert sibling_argv(["--metrics-port", "0"], 2, 0)[-3:] == ["--metrics-port", "0", "--reuse-port"]  # none stays


@pytest.mark.parametrize(("flag", "env", "expected"), [
    (None, {}, True), (None, {"BATON_UVLOOP": "0"}, False), (None, {"BATON_UVLOOP": "off"}, False),
    (None, {"BATON_UVLOOP": "1"}, True), (False, {}, False), (False, {"BATON_UVLOOP": "1"}, False),
])
def test_uvloop_is_on_unless_the_flag_or_the_environment_turns_it_off(flag, env, expected):
    assert event_loop.wanted(flag, env) is expected


def test_run_uses_the_loop_asked_for():
    async def name() -> str:
        return event_loop.loop_name()

    assert event_loop.run(name(), use_uvloop=True) == "uvloop"
    assert event_loop.run(name(), use_uvloop=False) == "asyncio"


def _two_free_ports() -> int:
    for _ in range(50):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def _errors(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("baton:request_errors_total{") and 'code="UNAVAILABLE"' in line)


def _lines(proc: subprocess.Popen, n: int, timeout_s: float) -> list[str]:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout.readline() for _ in range(n)), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out


@pytest.fixture
def redis_url():
    require_redis_server()
    with RedisServer.start() as server:
        yield server.url


def test_two_router_processes_share_the_grpc_and_http_ports_and_stop_together(tmp_path, redis_url):
    model_dir = make_model_folder(tmp_path / "tiny")
    grpc_port, http_port, metrics_port = free_port(), free_port(), _two_free_ports()
    args = [sys.executable, "-m", "router.main", "--redis-url", redis_url, "--model", str(model_dir), "--host",
            "127.0.0.1", "--port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(metrics_port),
            "--processes", "2"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    siblings: list[psutil.Process] = []
    try:
        lines = _lines(proc, 2, timeout_s=30)  # each process prints once it listens (a refused bind: never)
        assert len(lines) == 2 and all(f"listening on 127.0.0.1:{grpc_port}" in line and "uvloop" in line
                                       for line in lines), lines
        siblings = psutil.Process(proc.pid).children()
        assert len(siblings) == 1
        # no workers: every Generate fails with UNAVAILABLE, counted by the process that served it; each
        # channel is its own connection, which the kernel hands to one process
        for _ in range(16):
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=(("grpc.use_local_subchannel_pool", 1),)) as ch:
                with pytest.raises(grpc.RpcError) as failure:
                    list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt="hi"), timeout=10))
                assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        grpc_errors = (_errors(metrics_port), _errors(metrics_port + 1))
        for _ in range(16):  # urllib opens a connection per request
            request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", method="POST",
                                             data=b'{"prompt": "hi"}', headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 503
        http_errors = (_errors(metrics_port) - grpc_errors[0], _errors(metrics_port + 1) - grpc_errors[1])
        assert sum(grpc_errors) == sum(http_errors) == 16
        assert min(grpc_errors) > 0 and min(http_errors) > 0, (grpc_errors, http_errors)  # 2 x 2^-15: both served
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not siblings[0].is_running() or siblings[0].status() == psutil.STATUS_ZOMBIE
    finally:
        for process in [*siblings, psutil.Process(proc.pid)] if proc.poll() is None else siblings:
            if process.is_running():
                process.kill()
        proc.wait()


def test_a_second_router_on_a_taken_port_fails_at_start_and_the_first_keeps_serving(tmp_path, redis_url):
    """Without --processes / --reuse-port the ports are not shared: a router left running (or started twice by
    mistake) would otherwise take half the connections, silently."""
    model_dir = make_model_folder(tmp_path / "tiny")
    grpc_port, http_port = free_port(), free_port()

    def router(port: int, http: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "router.main", "--redis-url", redis_url, "--model",
                                 str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http),
                                 "--metrics-port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    first = router(grpc_port, http_port)
    try:
        assert f"listening on 127.0.0.1:{grpc_port}" in _lines(first, 1, timeout_s=30)[0]
        for port, http in ((grpc_port, free_port()), (free_port(), http_port)):  # the gRPC port, then the HTTP one
            second = router(port, http)
            try:
                assert second.wait(timeout=30) == 1
                assert "baton router: error:" in second.stderr.read()
            finally:
                if second.poll() is None:
                    second.kill()
                    second.wait()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # the first still serves: no workers
            with pytest.raises(grpc.RpcError) as failure:
                list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt="hi"), timeout=10))
            assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            first.wait(timeout=20)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
