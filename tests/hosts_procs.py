"""Processes and commands for ``tests/hosts.py``: ``ip``/``tc`` runs, a host's PID namespace (its init), processes
started inside a host and stopped by their pid on the machine, and the removal of a crashed run's namespaces."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "bth"  # every namespace of the harness: bth-<creating pid>-<n>-<host>


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


# Run first in every process the harness starts: SIGKILL it when the process that started it dies (no orphans after
# a crash). A wrapper that execs, not a preexec_fn: forking a process with gRPC's threads running and then running
# Python in the child before exec can hang in gRPC's fork handlers (seen: "epoll_wait error: Bad file descriptor"
# and no exec); without a preexec_fn, subprocess spawns without running any.
DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL", "--")


def _start_init(netns: str) -> tuple[subprocess.Popen, int]:
    """A PID namespace for a host: ``unshare`` and the pid of its child, the namespace's pid 1: ``cat`` reading a
    pipe only this process writes to. When this process dies, however it dies, the pipe closes, ``cat`` exits and
    the kernel kills every process of the namespace (a namespace's pid 1 ignores a parent-death SIGKILL, so
    ``--kill-child`` alone would leave it and its host's processes running)."""
    init = subprocess.Popen([*DIE_WITH_PARENT, "ip", "netns", "exec", netns, "unshare", "--pid", "--fork",
                             "--mount-proc", "cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return init, _child_pid(init.pid)


def _child_pid(pid: int, timeout_s: float = 5.0) -> int:
    """The first child of ``pid`` (``nsenter``/``unshare`` fork the process that enters the namespaces)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise RuntimeError(f"process {pid} started no child in {timeout_s} s")


@dataclass
class HostProc:
    """A process started inside a host; ``pid`` is its pid on the machine (signals go there)."""

    name: str
    popen: subprocess.Popen  # nsenter: it exits with the process's status
    pid: int
    log_path: Path
    address: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited in ``timeout_s``."""
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(5)


def stop_all(procs: Sequence[HostProc], timeout_s: float = 10.0) -> None:
    """SIGTERM every process at once, then wait; SIGKILL those still running after ``timeout_s``."""
    for proc in procs:
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.popen.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.signal(signal.SIGKILL)


def remove_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (a crashed or killed run), killing what ran in them."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for name in (line.split()[0] for line in listed if line.strip()):
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-.+", name)
        if match is None or _alive(int(match.group(1))):
            continue
        for pid in _ip("netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
