"""The servers ``python -m bench vllm-serving`` measures, each started fresh in process groups of its own and stopped
whole: vLLM alone, ``vllm-router`` over a vLLM prefill/decode pair (NixlConnector), ``baton up`` with vLLM's engine
(NixlConnector, or ``baton-vllm:baton``: Baton's connector for vLLM) or Baton's. Each answers OpenAI ``/v1/completions`` on ``Target.http_port``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.trace_replay.up import ROOT, Up, free_port

TARGETS = ("vllm", "vllm-router:cache_aware", "vllm-router:kv_aware", "vllm-router:cache_aware+spin", "baton-vllm",
           "baton-vllm:baton", "baton")
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_ROUTER = ROOT / ".venv-vllm-router" / "bin" / "vllm-router"
NIXL_DELAY_US = "1000"  # what Baton's vLLM workers run NIXL's progress thread with (worker/vllm_engine/plugin.py)


@dataclass
class Target:
    """A started target: its OpenAI port and how to stop every process of it."""

    name: str
    http_port: int
    stop: Callable[[], None]


def start(name: str, args, source, folder: Path, model_name: str, work: Path) -> Target:
    base, _, rest = name.partition(":")
    if base == "vllm":
        return _vllm_alone(args, folder, model_name, work)
    if base == "vllm-router":
        policy, _, spin = rest.partition("+")
        return _vllm_router(args, folder, model_name, work, policy, spin == "spin")
    if base in ("baton", "baton-vllm"):
        flags = ["--max-model-len", "4096", "--num-threads", "1"]
        if base == "baton-vllm":  # ":baton": Baton's connector for vLLM (cma, then tcp) instead of NixlConnector
            flags += ["--engine", "vllm", "--vllm-kv-cache-gib", f"{args.kv_cache_gib:g}",
                      *(["--vllm-compile"] if args.vllm_compile else []),
                      *(["--vllm-kv-connector", "baton", "--kv-transport", "auto"] if rest == "baton" else [])]
        else:
            flags += ["--num-blocks", str(_baton_blocks(folder, args.kv_cache_gib))]
        up = Up.start(args.model, flags, work, prefill=1, decode=1, ready_timeout_s=600)
        return Target(name, up.http_port, up.stop)
    raise SystemExit(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")


def _baton_blocks(folder: Path, gib: float, block_size: int = 16) -> int:
    """Baton's pool of ``gib`` of float32 KV (what vLLM's ``VLLM_CPU_KVCACHE_SPACE`` holds)."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_block = 2 * config["num_hidden_layers"] * block_size * config["num_key_value_heads"] * head_dim * 4
    return int(gib * (1 << 30) // per_block)


def _vllm_env(args, cpus: str, *, spin: bool = True, side_channel: int | None = None) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=f"{args.kv_cache_gib:g}", VLLM_CPU_OMP_THREADS_BIND=cpus,
               HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    if side_channel is not None:
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_channel))
    if not spin:
        env["BATON_VLLM_NIXL_PROGRESS_DELAY_US"] = NIXL_DELAY_US
    return env


def _vllm_server(folder: Path, model_name: str, port: int, env: dict, log: Path, *extra: str,
                 compile_: bool = False) -> subprocess.Popen:
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name",
           model_name, "--dtype", "float32", *([] if compile_ else ["--enforce-eager"]), "--max-model-len", "4096",
           "--host", "127.0.0.1",
           "--port", str(port), "--enable-prompt-tokens-details", *extra]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def _vllm_alone(args, folder: Path, model_name: str, work: Path) -> Target:
    port = free_port()
    server = _vllm_server(folder, model_name, port, _vllm_env(args, "0-1"), work / "vllm.log",
                          compile_=args.vllm_compile)
    return _ready(Target("vllm", port, lambda: _stop_all([server])), [port], [server])


def _vllm_router(args, folder: Path, model_name: str, work: Path, policy: str, spin: bool) -> Target:
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
    ports, router_port = [free_port(), free_port()], free_port()
    events = f"ipc://{work}/prefill-kv-events"
    prefill_extra = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                       "endpoint": events})] if policy == "kv_aware" else []
    servers = [
        _vllm_server(folder, model_name, ports[0], _vllm_env(args, "0", spin=spin, side_channel=free_port()),
                     work / "prefill.log", "--kv-transfer-config", kv, *prefill_extra, compile_=args.vllm_compile),
        _vllm_server(folder, model_name, ports[1], _vllm_env(args, "1", spin=spin, side_channel=free_port()),
                     work / "decode.log", "--kv-transfer-config", kv, compile_=args.vllm_compile),
    ]
    cmd = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(router_port), "--vllm-pd-disaggregation",
           "--prefill", f"http://127.0.0.1:{ports[0]}", "--decode", f"http://127.0.0.1:{ports[1]}",
           "--policy", policy, "--request-timeout-secs", str(int(args.request_timeout_s))]
    if policy == "kv_aware":
        cmd += ["--pd-kv-events", f"http://127.0.0.1:{ports[0]}={events}"]
    try:
        _wait_http(ports, servers)
    except BaseException:
        _stop_all(servers)
        raise
    with (work / "router.log").open("wb") as out:
        router = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    procs = [router, *servers]
    return _ready(Target(f"vllm-router:{policy}", router_port, lambda: _stop_all(procs)), [router_port], procs)


def _ready(target: Target, ports: list[int], procs: list[subprocess.Popen]) -> Target:
    try:
        _wait_http(ports, procs)
    except BaseException:
        target.stop()
        raise
    return target


def _wait_http(ports: list[int], procs: list[subprocess.Popen], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(ports)
    while pending:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server exited before it was ready ({[p.args[:3] for p in procs]})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ports {pending} not serving after {timeout_s} s")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{pending[0]}/v1/models", timeout=2).read()
            pending.pop(0)
        except OSError:
            time.sleep(1.0)


def _stop_all(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
