"""``baton up --kv-store`` (no URI): it starts a Mooncake Store on loopback beside Redis, the router and the workers;
the workers (``--kv-store-write through``) write what they compute to the store (the index lists the store's
blocks); the store's processes and the workers listen on loopback only, but for the Mooncake transfer engines'
own two listeners per process, which Mooncake 0.3.13 binds to all interfaces whatever it is told (they advertise
127.0.0.1: no byte leaves loopback); the router's store hint end to end: a prompt written to the store, evicted from
the decode worker's small pool (32 blocks) by other prompts, asked again: the router tells the worker how many
blocks the store holds, the worker reads them without asking the store and the output equals the offline engine's;
Ctrl-C stops every process, the store's too. (The router's own listeners follow its ``--host``, 0.0.0.0 by default:
not the store's business.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis

from bench.engines import descendants
from engine import LLM, SamplingParams
from kv_transfer.hashing import hash_blocks, root_hash
from kv_transfer.layout import KVLayout
from kv_transfer.redis_index import KVIndex
from kv_transfer.registry import Registry, connect
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import ROOT, free_port, interrupt
from tests.integration.test_metrics import scrape
from tests.integration.test_scaling import _alive, decode_workers, generate, prefill_workers, wait_for
from tests.redis_server import require_redis_server
from tests.oracle import Output, assert_same, streamed
from tests.required import import_or_skip
from tests.tiny_model import shared_tiny

import_or_skip("mooncake", "mooncake", "the store tier needs mooncake-transfer-engine-non-cuda")
LOOPBACK = ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]")
TRANSFER_ENGINE_LISTENERS = 2  # a Mooncake client's handshake and data ports, bound to all interfaces
BLOCK = 4
NUM_BLOCKS = 32  # every worker's pool: three 60-token prompts (18 blocks each with their output) evict a fourth
MAX_TOKENS = 10
PROMPT = [(13 * j + 7) % 300 + 3 for j in range(60)]  # 14 reusable blocks; 60 tokens: under the router's
FILLERS = [[(5 + 7 * i + 3 * j) % 300 + 3 for j in range(60)] for i in (11, 12, 13)]  # threshold, so D computes


def _descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``: pid -> its command's first words."""
    out = {}
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            out[child] = (Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")[:200]).decode()
    return out


def _listeners(pids: set[int]) -> dict[int, list[str]]:
    """pid -> the local addresses its TCP sockets listen on (``ss -ltnpH``)."""
    out: dict[int, list[str]] = {}
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
        local = line.split()[3]
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                out.setdefault(pid, []).append(local)
    return out


def _serving(address: str) -> bool:
    try:
        return prefill_workers(address) == ["prefill-0"] and decode_workers(address) == ["decode-0"]
    except grpc.RpcError:
        return False


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    require_redis_server()
    model_dir = shared_tiny(tmp_path_factory)
    port, log_dir = free_port(), tmp_path_factory.mktemp("up")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    metrics_port = free_port()  # the router's; the workers take the next two
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--model", str(model_dir), "--port", str(port),
           "--metrics-port", str(metrics_port), "--http-port", "0", "--log-dir", str(log_dir), "--kv-store",
           "--kv-store-memory", "64 MB", "--kv-store-write", "through", "--calibrate-tokens", "0",
           "--block-size", str(BLOCK), "--num-blocks", str(NUM_BLOCKS)]
    with (log_dir / "up.out").open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    address = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: _serving(address), 90, proc, log_dir)
        yield address, proc, log_dir, metrics_port
    finally:
        interrupt(proc)


def test_up_starts_a_store_the_workers_write_through_to(platform):
    address, proc, log_dir, metrics_port = platform
    said = (log_dir / "up.out").read_text()
    assert re.search(r"kv store +mooncake://127\.0\.0\.1:\d+\?metadata=127\.0\.0\.1:\d+", said), said
    redis_url = re.search(r"redis +(redis://\S+)", said).group(1)
    for i in range(3):
        generate(address, [(5 + 7 * i + j) % 300 + 3 for j in range(40)])  # whichever worker computes it writes
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: client.hlen("baton:kv-of:store") >= 27, 30, proc, log_dir)  # 3 x 9 blocks of 4 tokens
    assert (log_dir / "store-client.log").exists() and (log_dir / "store-master.log").exists()
    # every request came with the router's count of the store's blocks: no worker asked the store what it holds
    asked = [v for port in (metrics_port + 1, metrics_port + 2) for k, v in scrape(port).items()
             if k.startswith("baton:kv_store_lookups_total") and 'source="store"' in k]
    assert sum(asked) == 0, asked


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[tuple[int, ...], tuple[list[int], list[float]]]:
    """The offline engine's greedy tokens and each one's log-probability, per prompt."""
    llm = LLM(str(shared_tiny(tmp_path_factory)), num_blocks=512, block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompts = [PROMPT, *FILLERS]
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return {tuple(p): (o.token_ids, [chosen for chosen, _ in o.logprobs]) for p, o in zip(prompts, outputs)}


def _generate(address: str, prompt: list[int], expected) -> pb.GenerateResponse:
    """The last response of a greedy request, once its tokens and log-probabilities equal the offline engine's."""
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)
    responses = list(pb_grpc.GenerationStub(grpc.insecure_channel(address)).Generate(request, timeout=60))
    assert_same(streamed(responses), Output(*expected[tuple(prompt)]), f"{len(prompt)}-token prompt")
    return responses[-1]


def _index(redis_url: str, prompt: list[int]):
    """The index's tiers for ``prompt``'s full blocks (each worker's leading blocks, the store's)."""
    async def lookup():
        client = connect(redis_url)
        try:
            (info, _), *_ = await Registry(client, "baton").list_workers()
            root = root_hash(KVLayout.from_json(info.layout_json).model_fingerprint, BLOCK, "")
            hashes = hash_blocks(prompt[: (len(prompt) - 1) // BLOCK * BLOCK], BLOCK, root)
            return await KVIndex(client, "baton").lookup_tiers(hashes)
        finally:
            await client.aclose()

    return asyncio.run(lookup())


def _worker_counters(metrics_port: int) -> dict[str, float]:
    """Both workers' store counters, summed: blocks fetched, and lookups by who said what the store holds."""
    samples = [(k, v) for port in (metrics_port + 1, metrics_port + 2) for k, v in scrape(port).items()]
    return {
        "fetched": sum(v for k, v in samples if k.startswith("baton:kv_store_blocks_fetched_total{")),
        "hinted": sum(v for k, v in samples if k.startswith("baton:kv_store_lookups_total{") and 'source="index"' in k),
        "asked": sum(v for k, v in samples if k.startswith("baton:kv_store_lookups_total{") and 'source="store"' in k),
    }


def test_the_routers_store_hint_brings_back_an_evicted_prefix(platform, expected):
    address, proc, log_dir, metrics_port = platform
    redis_url = re.search(r"redis +(redis://\S+)", (log_dir / "up.out").read_text()).group(1)
    assert _generate(address, PROMPT, expected).usage.cached_prompt_tokens == 0
    wait_for(lambda: _index(redis_url, PROMPT).store == 14, 30, proc, log_dir)  # written through
    for filler in FILLERS:
        _generate(address, filler, expected)
    wait_for(lambda: not _index(redis_url, PROMPT).gpu_or_cpu, 30, proc, log_dir)  # no worker holds any of it
    before = _worker_counters(metrics_port)
    last = _generate(address, PROMPT, expected)
    assert last.usage.cached_prompt_tokens == 56, last
    assert "fetched 56 prefix tokens from the store" in last.timings.route_reason, last.timings
    wait_for(lambda: _worker_counters(metrics_port)["fetched"] - before["fetched"] >= 14, 10, proc, log_dir)
    after = _worker_counters(metrics_port)
    # read on the router's word (one hinted lookup), not the store's: no batch_is_exist call
    assert {k: after[k] - before[k] for k in after} == {"fetched": 14, "hinted": 1, "asked": 0}


def _store_processes(processes: dict[int, str]) -> list[int]:
    return [pid for pid, cmd in processes.items() if "mooncake_" in cmd or "mooncake.http_metadata_server" in cmd]


def test_the_store_and_the_workers_listen_on_loopback_but_the_transfer_engines_own(platform):
    _, proc, _, _ = platform
    processes = _descendants(proc.pid)
    workers = [pid for pid, cmd in processes.items() if "deploy.cli prefill" in cmd or "deploy.cli decode" in cmd]
    listeners = _listeners(set(_store_processes(processes) + workers))
    assert any("mooncake_master" in processes[pid] for pid in listeners)
    assert any("http_metadata_server" in processes[pid] for pid in listeners)
    for pid, addrs in listeners.items():
        wildcard = [a for a in addrs if not a.startswith(LOOPBACK)]
        engine = "mooncake_client" in processes[pid] or pid in workers  # a Mooncake client: a transfer engine
        assert len(wildcard) <= (TRANSFER_ENGINE_LISTENERS if engine else 0), f"{processes[pid]}: {addrs}"
        assert len(addrs) > len(wildcard), f"{processes[pid]} serves nothing on loopback: {addrs}"


def test_ctrl_c_stops_the_store_too(tmp_path_factory, platform):
    _, proc, _, _ = platform
    processes = _descendants(proc.pid)
    store = _store_processes(processes)
    assert len(store) == 3, processes
    interrupt(proc)
    assert proc.returncode == 0
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in store) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in store if _alive(pid)]
