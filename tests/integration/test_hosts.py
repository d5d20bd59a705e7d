"""Baton across hosts (issue 21): each component on a host of its own — a network and PID namespace, joined by a
bridge in a namespace of its own, each host's egress shaped to 1 Gbit/s (tests/hosts.py) — started with the
ordinary CLI (tests/hosts_cluster.py). Greedy output through router -> P (host b) -> D (host c) equals the
offline engine, tokens and their logprobs (tests/oracle.py), with the KV really moved; ``--kv-transport auto`` pulls over cma only between workers of one
host and over tcp across hosts (the handshake refuses cma, the pair falls through and says so once); a worker
whose address a peer cannot reach costs a request seconds, not a 20-30 s hang, and is named in the reports.

Hosts: redis, router, b (p0, and d1 bound to 0.0.0.0), c (d0), e (p1), f (p2), client (the test's way in)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proto import baton_pb2 as pb
from tests.hosts import ROOT, Network, remove_stale, unavailable_reason
from tests.hosts_cluster import HostsCluster
from tests.integration.test_e2e import MAX_TOKENS, PROMPTS, expected_outputs, model_dir  # noqa: F401
from tests.oracle import Output, assert_same, reference, streamed
from tests.required import unavailable

WHY_NOT = unavailable("root", unavailable_reason())
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
AUTO = ("--kv-transport", "auto", "--calibrate-tokens", "0")
# prompts no test sent before (a cached prompt is prefilled locally: nothing to move), long enough to go remote
FRESH = [[(11 * i + 5 * j) % 2900 + 40 for j in range(60 + 7 * i)] for i in range(9)]


@pytest.fixture(scope="module")
def fresh(model_dir) -> list[Output]:  # noqa: F811
    return reference(model_dir, FRESH, MAX_TOKENS)


def generate_output(cluster: HostsCluster, prompt: list[int], max_tokens: int,
                    timeout_s: float = 60.0) -> tuple[Output, pb.GenerateResponse]:
    """Greedy ``prompt`` through the router with each token's logprob: (tokens and logprobs, the last response)."""
    responses = list(cluster.stream(prompt, max_tokens, timeout_s, logprobs=0))
    return streamed(responses), responses[-1]


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):  # noqa: F811
    log_dir = tmp_path_factory.mktemp("hosts-logs")
    with Network.create(["redis", "router", "b", "c", "e", "f", "client"], rate="1gbit") as net:
        cluster = HostsCluster(net, model_dir, log_dir, client="client")
        try:
            cluster.start_redis("redis")
            cluster.start_worker("prefill", "p0", host="b", extra=AUTO)
            cluster.start_worker("decode", "d0", host="c", extra=AUTO)
            cluster.start_worker("decode", "d1", host="b", extra=AUTO, bind="0.0.0.0")
            cluster.start_worker("prefill", "p1", host="e", extra=AUTO)
            cluster.start_worker("prefill", "p2", host="f", extra=AUTO)
            cluster.wait_for_workers({"p0", "d0", "d1", "p1", "p2"})
            cluster.start_router("router", "--disagg-threshold-tokens", "8", "--policy", "least_loaded")
            yield cluster
        finally:
            cluster.close()


def counter(metrics: str, name: str, **labels: str) -> float:
    """A Prometheus counter's value in a /metrics text (0 when the series is absent)."""
    for line in metrics.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_hosts_are_isolated_and_their_links_shaped(tmp_path) -> None:
    probe = ("import os, socket, sys, time\n"
             "print('pid', os.getpid(), os.stat('/proc/self/ns/pid').st_ino, [n for _, n in socket.if_nameindex()])\n"
             "try:\n    socket.create_connection(('10.214.0.1', 9), timeout=2)\nexcept OSError as e:\n"
             "    print('off-machine', e.errno)\n"
             "for addr, n in ((sys.argv[1], 4 << 20), (sys.argv[2], 1 << 20)):\n"
             "    s = socket.create_connection((addr, 5001)); t = time.perf_counter(); s.sendall(b'x' * n)\n"
             "    s.shutdown(socket.SHUT_WR); s.recv(1); print('rate', addr, n * 8 / (time.perf_counter() - t))\n")
    sink = ("import socket\ns = socket.create_server(('0.0.0.0', 5001))\nprint('listening', flush=True)\n"
            "c, _ = s.accept()\nwhile c.recv(1 << 16): pass\nc.close()\n")
    with Network.create(["a", "b", "c"]) as net:
        net.shape("a", "100mbit", per_peer={"c": "20mbit"})
        sinks = [net[h].spawn(f"sink-{h}", [sys.executable, "-c", sink], tmp_path) for h in ("b", "c")]
        for sink_proc in sinks:  # until each sink listens (the probe connects to both)
            wait_for(lambda p=sink_proc: "listening" in p.log() or not p.alive(), f"{sink_proc.name} listening")
            assert sink_proc.alive(), sink_proc.log()
        b, c = net["b"].address, net["c"].address
        sender = net["a"].spawn("probe", [sys.executable, "-c", probe, b, c], tmp_path)
        assert sender.popen.wait(60) == 0, sender.log()
        out = sender.log()
        assert all(s.popen.wait(10) == 0 for s in sinks)
    _, pid, pidns, interfaces = re.search(r"pid (\d+) (\d+) (\[.*\])", out).group(0).split(" ", 3)
    assert int(pid) < 10 and int(pidns) != os.stat("/proc/self/ns/pid").st_ino  # its own pid namespace
    assert interfaces == "['lo', 'eth0']"  # none of the machine's interfaces
    assert "off-machine 101" in out  # ENETUNREACH: no route leaves the bridge
    rates = {addr: float(rate) for addr, rate in re.findall(r"rate (\S+) (\S+)", out)}
    assert rates[b] < 1.5 * 100e6 and rates[c] < 1.5 * 20e6, rates  # ~2e10 unshaped


def test_a_crashed_runs_hosts_die_with_it_and_their_namespaces_go_with_the_next_run(tmp_path) -> None:
    crash = ("import os, sys\nfrom pathlib import Path\nfrom tests.hosts import Network\n"
             "net = Network.create(['a'])\nproc = net['a'].spawn('sleeper', ['sleep', '600'], Path(sys.argv[1]))\n"
             "print(net.prefix, proc.pid, flush=True)\nos._exit(3)\n")
    run = subprocess.run([sys.executable, "-c", crash, str(tmp_path)], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert run.returncode == 3, run.stderr
    prefix, pid = run.stdout.split()
    wait_for_exit(int(pid))  # the crashed run's host process: killed with its PID namespace
    removed = remove_stale()
    assert sorted(removed) == [f"{prefix}-a", f"{prefix}-br"]
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if n.startswith(prefix)]


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def wait_for_exit(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":  # exited (reaped by no one)
                return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"process {pid} outlived the run that started it"
        time.sleep(0.05)


def test_greedy_output_across_hosts_equals_the_offline_engine(cluster, expected_outputs) -> None:  # noqa: F811
    cluster.only("p0", "d0")
    kinds = set()
    for i, prompt in enumerate(PROMPTS):
        output, last = generate_output(cluster, prompt, MAX_TOKENS)
        t = last.timings
        assert_same(output, expected_outputs[i], f"prompt {i} ({len(prompt)} tokens) via {t.route_kind}")
        kinds.add(t.route_kind)
        if t.route_kind == "remote":  # the KV moved, over the 1 Gbit/s link (a recompute gives the same tokens)
            assert (t.prefill_worker, t.decode_worker, t.transport) == ("p0", "d0", "tcp"), t
            assert t.transfer_bytes > 0 and t.transfer_blocks > 0 and not t.local_fallback, t
    assert kinds == {"local", "remote"}
    metrics = cluster.metrics("d0")
    assert counter(metrics, "baton:kv_pull_fallbacks_total") == 0
    assert counter(metrics, "baton:kv_transfers_total", transport="tcp") > 0
    cluster.assert_pools_full()


def test_auto_pulls_over_cma_on_one_host_and_over_tcp_across_hosts(cluster, fresh) -> None:
    workers = {info.worker_id: info for info in asyncio.run(cluster.registered())}
    b = cluster.net["b"].address
    assert workers["d1"].grpc_address.startswith(f"{b}:")  # bound to 0.0.0.0: registered the address toward Redis
    for n, (decode, transport) in enumerate((("d1", "cma"), ("d0", "tcp"), ("d0", "tcp"))):
        cluster.only("p0", decode)
        for i in (2 * n, 2 * n + 1):
            output, last = generate_output(cluster, FRESH[i], MAX_TOKENS)
            t = last.timings
            assert_same(output, fresh[i], f"fresh prompt {i} to {decode}")
            assert (t.route_kind, t.decode_worker, t.transport) == ("remote", decode, transport), t
            assert t.transfer_bytes > 0 and not t.local_fallback, t
    d0, d1 = cluster.metrics("d0"), cluster.metrics("d1")
    # d0 <- p0: cma refused at the pair's first handshake (another pid namespace), counted and logged once
    assert counter(d0, "baton:kv_transport_fallthroughs_total", transport="cma", reason="pid_namespace") == 1
    assert counter(d1, "baton:kv_transport_fallthroughs_total") == 0
    assert cluster.workers["d0"].log(200_000).count("KV transport cma cannot work with p0 (pid_namespace)") == 1
    cluster.assert_pools_full()


def test_a_peer_that_cannot_reach_a_workers_address_costs_seconds_and_is_named(cluster, fresh) -> None:
    net, e = cluster.net, cluster.net["e"].address
    cluster.only("p1", "d0")
    try:
        net["c"].blackhole(e)  # d0 cannot reach p1 (a firewall dropping): p1's KV times out, then fails at once
        reasons = []
        for i in (6, 7):
            output, last = generate_output(cluster, FRESH[i], MAX_TOKENS, timeout_s=15)
            assert_same(output, fresh[i], f"fresh prompt {i} recomputed")
            assert last.timings.local_fallback, last.timings
            reasons.append(last.timings.route_reason)
        assert re.search(rf"cannot connect to KV server \w+://{e}:50062", reasons[0]), reasons
        assert "--host" in reasons[0], reasons  # what to check
        assert "s ago" in reasons[1], reasons  # remembered: not another connect timeout
        assert counter(cluster.metrics("d0"), "baton:kv_pull_fallbacks_total", reason="peer_unreachable") == 2
        f = net["f"].address
        net["router"].blackhole(f)  # the router cannot reach p2 (never could): gRPC gives up in 2 s, not 20
        cluster.only("p2", "d0")
        output, last = generate_output(cluster, FRESH[8], MAX_TOKENS, timeout_s=10)
        assert_same(output, fresh[8], "fresh prompt 8 local")
        assert last.timings.route_kind == "local", last.timings
        assert f"prefill on worker_id=p2 failed" in cluster.router.log(20_000) and f"{f}:50061" in cluster.router.log()
    finally:
        net["c"].unblackhole(e)
        net["router"].unblackhole(net["f"].address)
    cluster.assert_pools_full()
