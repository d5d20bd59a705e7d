"""Same-host memory access for ``cma://`` (``kv_transfer/cma.py``): ``process_vm_readv(2)`` (whether it works
here, what its errors mean, reads resumed across partial copies), the host and pid-namespace identity a server
advertises. The rows of ``(address, length)`` it reads are ``kv_transfer/rows.py``'s.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import socket
import sys

import numpy as np

from kv_transfer.errors import KVTransferError

IOV_MAX = 1024  # iovecs per side per process_vm_readv call (the kernel's UIO_MAXIOV)
PTRACE_HINT = ("check /proc/sys/kernel/yama/ptrace_scope (1 allows only descendants: set it to 0, or give the "
               "puller CAP_SYS_PTRACE), that both workers run as the same user, and that no seccomp profile "
               "blocks process_vm_readv")


# --- process_vm_readv -----------------------------------------------------------------------------


@functools.cache
def readv_fn():
    """libc's ``process_vm_readv``; raises OSError/AttributeError where there is none."""
    if not sys.platform.startswith("linux"):
        raise OSError("process_vm_readv is Linux-only")
    fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


@functools.cache
def unavailable_reason() -> str | None:
    """None when this process can use process_vm_readv (checked by reading its own memory), else why not."""
    if not sys.platform.startswith("linux"):
        return f"cma:// needs Linux (process_vm_readv); this is {sys.platform}"
    try:
        fn = readv_fn()
    except (OSError, AttributeError) as exc:
        return f"cma:// needs process_vm_readv, which this libc lacks ({exc})"
    src, dst = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
    local = np.array([[dst.ctypes.data, 8]], np.uint64)
    remote = np.array([[src.ctypes.data, 8]], np.uint64)
    if fn(os.getpid(), local.ctypes.data, 1, remote.ctypes.data, 1, 0) != 8 or not np.array_equal(src, dst):
        err = ctypes.get_errno()
        return f"process_vm_readv does not work here: {os.strerror(err) if err else 'short read'}"
    return None


def explain(err: int, pid: int, uri: str) -> KVTransferError:
    what = f"cma:// read from KV server {uri} (pid {pid}) failed: {errno.errorcode.get(err, err)} {os.strerror(err)}"
    if err == errno.EPERM:
        return KVTransferError(f"{what}: not permitted to read that process's memory; {PTRACE_HINT}")
    if err == errno.ESRCH:
        return KVTransferError(f"{what}: no such process here (it exited, or it runs in another host or pid "
                               "namespace: use tcp:// between them)")
    if err == errno.ENOSYS:
        return KVTransferError(f"{what}: this kernel has no process_vm_readv")
    if err == errno.EFAULT:
        return KVTransferError(f"{what}: the server's blocks are no longer mapped (it exited mid-read?)")
    return KVTransferError(what)


def readv(pid: int, local: np.ndarray, remote: np.ndarray, uri: str, keep: object = None) -> int:
    """Copy every byte of ``remote`` (rows of (address, length) in pid) into ``local`` (same lengths, row by
    row) with process_vm_readv, IOV_MAX rows a call, resuming partial reads; returns the bytes read.
    ``keep``: the object owning ``local``'s memory, held while a worker thread may still be writing it."""
    fn, done, i, n = readv_fn(), 0, 0, len(local)
    while i < n:
        j = min(i + IOV_MAX, n)
        got = fn(pid, local[i:].ctypes.data, j - i, remote[i:].ctypes.data, j - i, 0)
        if got < 0:
            raise explain(ctypes.get_errno(), pid, uri)
        if got == 0:
            raise KVTransferError(f"cma:// read from KV server {uri} (pid {pid}) made no progress")
        done += got
        while got:  # consume ``got`` bytes from row i on; a partially read row is resumed where it stopped
            length = int(local[i, 1])
            if got >= length:
                got -= length
                i += 1
            else:
                local[i, 0] += np.uint64(got)
                local[i, 1] -= np.uint64(got)
                remote[i, 0] += np.uint64(got)
                remote[i, 1] -= np.uint64(got)
                got = 0
    return done


# --- host identity --------------------------------------------------------------------------------


@functools.cache
def boot_id() -> bytes:
    """16 bytes that differ between hosts (and boots): the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return socket.gethostname().encode()[:16].ljust(16, b"\0")


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
