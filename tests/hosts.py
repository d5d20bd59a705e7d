"""Several "hosts" on one machine (issue 21), for tests and ``python -m bench.hosts``.

Each host is a network namespace (its own loopback, one address on a bridge) and a PID namespace (its
processes' pids mean nothing on another host, so same-host shortcuts such as cma's ``process_vm_readv``
cannot reach across, as between two pods or two machines). The bridge lives in a namespace of its own with no
uplink: nothing a host sends can leave the machine, and the machine's own interfaces and routes are never
touched. Links are shaped with ``tc htb`` on each host's egress: one rate for all it sends, and optionally
one rate per destination host (a ``u32`` filter on the destination address).

    with Network.create(["redis", "p0", "d0"], rate="1gbit") as net:
        proc = net["p0"].spawn("p0", [sys.executable, "-m", "deploy.cli", "prefill", "--host", net["p0"].address,
                                      ...], log_dir)
        net.shape("p0", "100mbit", per_peer={"d0": "10mbit"})
        net["p0"].set_link(up=False)   # the host's cable pulled
        net["p0"].kill_all()           # every process of the host SIGKILLed at once (its PID namespace's init)

Every namespace is named ``bth-<creating pid>-<n>-<host>``; ``close()`` (or leaving the ``with``) stops every
process (SIGTERM, then SIGKILL) and deletes every namespace, also when a test fails. A crashed run's leftovers
(namespaces whose creating pid is gone) are removed by the next ``Network.create``. Needs root, ``ip``, ``tc``,
``unshare``, ``nsenter``, ``setpriv`` and ``ss`` (``unavailable_reason()`` says what is missing).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.hosts_procs import (  # noqa: F401 - HostProc and stop_all are part of this module's interface
    DIE_WITH_PARENT, PREFIX, ROOT, HostProc, _child_pid, _ip, _run, _start_init, remove_stale, stop_all,
)

SUBNET = "10.213.0"  # private, and only ever inside the namespaces (no route to it exists outside them)
_counter = itertools.count()


def unavailable_reason() -> str | None:
    """None when hosts can be made here, else why not (not root, a tool missing, ``ip netns`` refused)."""
    if os.geteuid() != 0:
        return "network and PID namespaces need root (run the multi-host tests as root)"
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter", "setpriv", "ss") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian: iproute2, util-linux)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    netns: str
    address: str
    init: subprocess.Popen  # `unshare --pid --fork cat`: the PID namespace's holder (hosts_procs._start_init)
    init_pid: int  # its child, pid 1 of the host's PID namespace
    procs: list[HostProc] = field(default_factory=list)

    def spawn(self, name: str, argv: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None, *,
              pipe: bool = False) -> HostProc:
        """Start ``argv`` inside this host (its network, mount and PID namespaces), output to ``log_dir/name.log``
        (``pipe``: stdin and stdout are text pipes to the caller, stderr goes to the log)."""
        log_path = log_dir / f"{name}.log"
        # --wd: entering a mount namespace moves the process to its root (/), and `python -m tests.…` needs the
        # repository as its working directory (the package `tests` is not installed)
        enter = [*DIE_WITH_PARENT, "nsenter", "--target", str(self.init_pid), "--net", "--mount", "--pid",
                 f"--wd={ROOT}", "--"]
        with log_path.open("wb") as log:
            streams = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) if pipe else dict(stdout=log)
            popen = subprocess.Popen([*enter, *argv], stderr=log if pipe else subprocess.STDOUT, cwd=ROOT,
                                     env=dict(env if env is not None else os.environ), **streams)
        try:
            proc = HostProc(name, popen, _child_pid(popen.pid), log_path)
        except RuntimeError:
            popen.kill()
            popen.wait()
            raise RuntimeError(f"{name} did not start on host {self.name}:\n{log_path.read_text(errors='replace')}")
        self.procs.append(proc)
        return proc

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """A short command in this host's network namespace (e.g. ``tc``, ``ip``)."""
        return _run(["ip", "netns", "exec", self.netns, *argv], check=check)

    def set_link(self, *, up: bool) -> None:
        """Bring the host's one interface down (a pulled cable: nothing in or out) or back up."""
        _ip("-n", self.netns, "link", "set", "eth0", "up" if up else "down")

    def blackhole(self, address: str) -> None:
        """From this host, frames to ``address`` go to a MAC no host has and vanish (a firewall dropping them:
        connections time out, nothing refuses)."""
        _ip("-n", self.netns, "neigh", "replace", address, "lladdr", "02:00:00:00:00:01", "dev", "eth0",
            "nud", "permanent")

    def unblackhole(self, address: str) -> None:
        _ip("-n", self.netns, "neigh", "del", address, "dev", "eth0", check=False)

    def kill_all(self) -> None:
        """SIGKILL every process of the host at once: the kernel kills a PID namespace's processes with its
        init. The host keeps its network; ``spawn`` fails afterwards until ``reboot``."""
        if self.init.poll() is None:
            os.kill(self.init_pid, signal.SIGKILL)
            self.init.wait(10)
        if self.init.stdin is not None:
            self.init.stdin.close()
        for proc in self.procs:
            proc.popen.wait(10)

    def reboot(self) -> None:
        """``kill_all``, then a fresh PID namespace to ``spawn`` in (the network stays as it was)."""
        self.kill_all()
        self.procs.clear()
        self.init, self.init_pid = _start_init(self.netns)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every process (SIGTERM; SIGKILL after ``timeout_s``), then the PID namespace and the netns."""
        stop_all(self.procs, timeout_s)
        self.kill_all()
        _ip("netns", "del", self.netns, check=False)


class Network:
    """Hosts joined by one bridge (``create``); ``close()`` removes everything it made."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.bridge_netns = f"{prefix}-br"
        self.hosts: dict[str, Host] = {}

    @classmethod
    def create(cls, names: Iterable[str], *, rate: str | None = None) -> Network:
        """Hosts ``names`` (addresses SUBNET.1, .2, ... in order), each one's egress shaped at ``rate``
        (tc's units, e.g. "1gbit", "100mbit"; None: unshaped)."""
        remove_stale()
        net = cls(f"{PREFIX}-{os.getpid()}-{next(_counter)}")
        try:
            _ip("netns", "add", net.bridge_netns)
            net._bridge("link", "add", "br0", "type", "bridge")
            net._bridge("link", "set", "br0", "up")
            for i, name in enumerate(names):
                net._add_host(name, f"{SUBNET}.{i + 1}", i)
                if rate is not None:
                    net.shape(name, rate)
        except BaseException:
            net.close()
            raise
        return net

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _bridge(self, *args: str) -> None:
        _ip("-n", self.bridge_netns, *args)

    def _add_host(self, name: str, address: str, index: int) -> None:
        netns, port = f"{self.prefix}-{name}", f"p{index}"
        _ip("netns", "add", netns)
        # made inside the bridge's namespace, the peer straight into the host's: the machine's own never sees either
        self._bridge("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        self._bridge("link", "set", port, "master", "br0", "up")
        for args in (("link", "set", "lo", "up"), ("addr", "add", f"{address}/24", "dev", "eth0"),
                     ("link", "set", "eth0", "up")):
            _ip("-n", netns, *args)
        self.hosts[name] = Host(name, netns, address, *_start_init(netns))

    def shape(self, name: str, rate: str | None, per_peer: Mapping[str, str] | None = None) -> None:
        """Shape host ``name``'s egress: ``rate`` for all it sends (None: unlimited), ``per_peer`` host name ->
        rate for what it sends to that host (instead of ``rate``). Replaces the host's earlier shaping."""
        host = self.hosts[name]
        host.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if rate is None and not per_peer:
            return
        tc = ("tc", "-n", host.netns)
        _run([*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"])
        _run([*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", *_htb_rate(rate or "100gbit")])
        for i, (peer, peer_rate) in enumerate(sorted((per_peer or {}).items())):
            classid = f"1:{10 + i}"
            _run([*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", classid, *_htb_rate(peer_rate)])
            _run([*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                  "match", "ip", "dst", f"{self.hosts[peer].address}/32", "flowid", classid])

    def close(self, grace_s: float = 3.0) -> None:
        """SIGTERM every host's processes at once, SIGKILL what still runs after ``grace_s``; delete the namespaces."""
        stop_all([proc for host in self.hosts.values() for proc in host.procs], grace_s)
        for host in reversed(list(self.hosts.values())):
            host.close()
        self.hosts.clear()
        _ip("netns", "del", self.bridge_netns, check=False)


_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}


def rate_bits(rate: str) -> float:
    """``tc``'s rate spelling (``1gbit``, ``100mbit``) in bits per second; ValueError for anything else."""
    for unit, scale in _UNITS.items():
        if rate.lower().endswith(unit):
            try:
                return float(rate[: -len(unit)]) * scale
            except ValueError:
                break
    raise ValueError(f"rate {rate!r}: use tc's units, e.g. 10gbit, 1gbit, 100mbit")


def _htb_rate(rate: str) -> list[str]:
    # The burst a class may send at line rate: 200 us of its rate (at least 8 KiB). A larger one lets a whole small
    # pull through unshaped (256 KiB passed a 100 Mbit/s class at 2.9 Gbit/s with a 256 KiB burst); this keeps
    # 256 KiB and 4 MiB transfers within ~10% of the rate from 100 Mbit/s to 1 Gbit/s (measured).
    burst = f"{max(8192, int(rate_bits(rate) / 8 * 200e-6))}b"
    return ["htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst]
