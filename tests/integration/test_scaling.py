"""`baton admin plan --apply` and `baton admin scale` under `baton up`: a second decode worker joins routing;
scaling back drains it (no new work, stopped once idle) and the platform keeps serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import ROOT, free_port, interrupt
from tests.redis_server import require_redis_server
from tests.tiny_model import shared_tiny


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    require_redis_server()
    model_dir = shared_tiny(tmp_path_factory)
    port, log_dir = free_port(), tmp_path_factory.mktemp("up")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--model", str(model_dir), "--port", str(port),
           "--metrics-port", str(free_port()), "--http-port", "0", "--log-dir", str(log_dir)]  # no fixed port 8000
    with (log_dir / "up.out").open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    address = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: decode_workers(address) == ["decode-0"], 90, proc, log_dir)
        yield address, proc, log_dir
    finally:
        interrupt(proc)


def decode_workers(address: str) -> list[str]:
    try:
        reply = pb_grpc.AdminStub(grpc.insecure_channel(address)).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    except grpc.RpcError:
        return []
    return sorted(w.worker_id for w in reply.workers if w.role == "decode" and w.state == pb.WORKER_STATE_UP)


def wait_for(condition, timeout_s: float, proc, log_dir) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"baton up exited:\n{(log_dir / 'up.out').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out:\n{(log_dir / 'up.out').read_text()[-3000:]}")
        time.sleep(0.5)


def prefill_workers(address: str) -> list[str]:
    reply = pb_grpc.AdminStub(grpc.insecure_channel(address)).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    return sorted(w.worker_id for w in reply.workers if w.role == "prefill" and w.state == pb.WORKER_STATE_UP)


def generate(address: str, prompt: list[int] | None = None) -> pb.GenerateResponse:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt or [5, 6, 7, 8]), sampling=params)
    return list(stub.Generate(request, timeout=30))[-1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except OSError:
        return False


def scale(address: str, size: int) -> None:
    admin = pb_grpc.AdminStub(grpc.insecure_channel(address))
    admin.ScalePool(pb.ScalePoolRequest(role="decode", size=size), timeout=5)


# A profile and traffic for which `baton admin plan` says 1 prefill and 2 decode workers: 10 requests/s of 60
# output tokens at 20 ms ITL keep 12 sequences decoding, and a worker holds 8 of them within the 20 ms ITL
# SLO; the prefill pool's 10 ms per 100-token prompt meets a 1 s TTFT with one worker.
PLAN_FOR_TWO_DECODE = {"prefill": {"prompt_lens": [100, 1000], "tokens_per_s": [10000, 10000]},
                       "decode": {"batch_sizes": [1, 8], "itl_ms": [10, 20]}}


def plan_apply(address: str, tmp_path) -> str:
    """`baton admin plan ... --apply`, as an operator runs it; returns what it printed."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PLAN_FOR_TWO_DECODE))
    cmd = [sys.executable, "-m", "deploy.cli", "admin", "--router", address, "plan", "--ttft-p90", "1000",
           "--itl-p90", "20", "--rate", "10", "--isl", "100", "--osl", "60", "--profile", str(profile), "--apply"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_plan_apply_scales_decode_up_and_scale_takes_it_down(platform, tmp_path):
    """`baton admin plan --apply` sets the pools to the plan (2 decode workers) and the running `baton up`
    starts the second, which serves requests; scaled back, it stops (gone from the registry, its process
    exited) and the platform keeps serving."""
    address, proc, log_dir = platform
    printed = plan_apply(address, tmp_path)
    assert "applied" in printed.lower(), printed
    wait_for(lambda: decode_workers(address) == ["decode-0", "decode-1"], 90, proc, log_dir)
    assert prefill_workers(address) == ["prefill-0"]  # the plan's 1 prefill worker: unchanged
    served: set[str] = set()

    def new_worker_served() -> bool:  # concurrent distinct prompts: the router's in-flight books spread them
        with ThreadPoolExecutor(6) as pool:
            finals = list(pool.map(lambda i: generate(address, [9 + i, 40 + i, 7, 8, 3 * i + 11]), range(6)))
        served.update(f.timings.decode_worker for f in finals)
        return "decode-1" in served

    wait_for(new_worker_served, 60, proc, log_dir)
    pid = _pid_of("decode-1", str(log_dir.parent))
    scale(address, 1)
    wait_for(lambda: _worker(address, "decode-1") is None and not _alive(pid), 90, proc, log_dir)
    assert decode_workers(address) == ["decode-0"]
    assert generate(address).finish_reason == pb.FINISH_REASON_LENGTH  # still serving
    assert proc.poll() is None


def test_an_operator_drain_under_baton_up_leaves_the_worker_up_and_idle(platform):
    """`baton up` starts workers with --on-drain stay: only its own scale-down stops them."""
    address, proc, log_dir = platform
    admin = pb_grpc.AdminStub(grpc.insecure_channel(address))
    assert admin.Drain(pb.DrainRequest(worker_id="decode-0"), timeout=5).changed
    try:
        time.sleep(8)  # past the worker's drain settle time (5 s) and poll period
        workers = admin.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
        assert [w.state for w in workers if w.worker_id == "decode-0"] == [pb.WORKER_STATE_DRAINING]
        assert proc.poll() is None
    finally:
        admin.Undrain(pb.DrainRequest(worker_id="decode-0"), timeout=5)
    wait_for(lambda: decode_workers(address) == ["decode-0"], 10, proc, log_dir)
    assert generate(address).finish_reason == pb.FINISH_REASON_LENGTH


def _pid_of(worker_id: str, model_marker: str) -> int:
    """The pid of the worker process `baton up` started (matched by its id and this module's model folder)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        started_by_up = b"--on-drain" in args and b"stay" in args  # `baton up`'s workers, no other test's
        if started_by_up and worker_id.encode() in args and any(model_marker.encode() in a for a in args):
            return int(entry)
    raise AssertionError(f"no process of {worker_id}")


def _worker(address: str, worker_id: str) -> pb.AdminWorker | None:
    reply = pb_grpc.AdminStub(grpc.insecure_channel(address)).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    return next((w for w in reply.workers if w.worker_id == worker_id), None)


def test_a_killed_worker_is_restarted_and_requests_in_flight_finish(platform):
    """SIGKILL of the prefill worker while prompts are in flight: they all finish (through the fault paths),
    `baton up` starts the worker again under its id (counted in `baton admin status`) and keeps serving."""
    import threading

    address, proc, log_dir = platform
    wait_for(lambda: _worker(address, "prefill-0") is not None, 60, proc, log_dir)
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results: dict[int, object] = {}

    def run(i: int) -> None:
        prompt = [(13 * i + 7 * j) % 3000 + 10 for j in range(300)]  # long: prefilled on prefill-0
        try:
            results[i] = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params),
                                            timeout=120))[-1]
        except grpc.RpcError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(_pid_of("prefill-0", str(log_dir.parent)), signal.SIGKILL)
    for t in threads:
        t.join(150)
    assert all(isinstance(r, pb.GenerateResponse) and r.usage.completion_tokens == 8 for r in results.values()), results
    assert len(results) == 4
    wait_for(lambda: (w := _worker(address, "prefill-0")) is not None and w.restarts == 1, 90, proc, log_dir)
    assert "prefill-0 exited with -9" in (log_dir / "up.out").read_text()
    assert generate(address).finish_reason == pb.FINISH_REASON_LENGTH and proc.poll() is None
