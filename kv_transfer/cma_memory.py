"""Same-host memory access for ``cma://`` (``kv_transfer/cma.py``): ``process_vm_readv(2)`` (whether it works
here, what its errors mean, reads resumed across partial copies), the host and pid-namespace identity a server
advertises, and the rows of ``(address, length)`` both sides compute: the server's iovecs of its blocks, the
client's pairing of them with its destination blocks, and rows cut to a batch size.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import socket
import sys
from collections.abc import Sequence

import numpy as np

from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, block_runs, paired_runs

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


# --- rows of (address, length) -------------------------------------------------------------------


def buffer_iovecs(buffer: KVBuffer, block_ids: Sequence[int]) -> np.ndarray:
    """uint64 [layers x runs, 2]: (address, length) of ``block_ids`` in ``buffer``, per layer per run of
    consecutive ids, in wire order (what a server hands out)."""
    seg, num_blocks = buffer.segment_bytes, buffer.num_blocks
    runs = np.array(block_runs(block_ids), np.uint64).reshape(-1, 2)
    base = buffer.array.ctypes.data
    layers = np.arange(buffer.layout.num_layers, dtype=np.uint64)[:, None]
    out = np.empty((len(layers), len(runs), 2), np.uint64)
    out[:, :, 0] = np.uint64(base) + (layers * np.uint64(num_blocks) + runs[None, :, 0]) * np.uint64(seg)
    out[:, :, 1] = runs[None, :, 1] * np.uint64(seg)
    return out.reshape(-1, 2)


def pair_rows(dst: KVBuffer, src_ids: list[int], dst_ids: list[int], remote: np.ndarray,
              uri: str) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) uint64 [n, 2] rows of equal lengths: one per layer per paired run of ``src_ids`` ->
    ``dst_ids``; remote addresses come from the server's iovecs (one per layer per run of ``src_ids``)."""
    seg, layers = dst.segment_bytes, dst.layout.num_layers
    runs = block_runs(src_ids)
    if remote.shape != (layers * len(runs), 2):
        raise KVTransferError(f"KV server {uri} sent {len(remote)} iovecs, expected {layers * len(runs)}")
    if not np.array_equal(remote[:, 1].reshape(layers, -1),
                          np.tile(np.array([c * seg for _, c in runs], np.uint64), (layers, 1))):
        raise KVTransferError(f"KV server {uri} sent iovecs of the wrong lengths")
    # source block -> (index of its run, offset in the run)
    where = {}
    for r, (first, count) in enumerate(runs):
        for k in range(count):
            where[first + k] = (r, k * seg)
    pairs = paired_runs(src_ids, dst_ids)
    remote_rows = remote.reshape(layers, len(runs), 2)
    local = np.empty((layers, len(pairs), 2), np.uint64)
    out_remote = np.empty((layers, len(pairs), 2), np.uint64)
    base, num_blocks = dst.array.ctypes.data, dst.num_blocks
    lyr = np.arange(layers, dtype=np.uint64)
    for p, (s, d, count) in enumerate(pairs):
        r, offset = where[s]
        out_remote[:, p, 0] = remote_rows[:, r, 0] + np.uint64(offset)
        local[:, p, 0] = np.uint64(base) + (lyr * np.uint64(num_blocks) + np.uint64(d)) * np.uint64(seg)
        local[:, p, 1] = out_remote[:, p, 1] = np.uint64(count * seg)
    return local.reshape(-1, 2), out_remote.reshape(-1, 2)


def split_rows(local: np.ndarray, remote: np.ndarray, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The same rows, those longer than ``max_bytes`` cut into pieces of at most ``max_bytes``."""
    lengths = local[:, 1].astype(np.int64)
    if (lengths <= max_bytes).all():
        return local.copy(), remote.copy()
    pieces = np.maximum(1, -(-lengths // max_bytes))
    row = np.repeat(np.arange(len(local)), pieces)
    k = np.arange(len(row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece index within its row
    offset = (k * max_bytes).astype(np.uint64)
    length = np.minimum(lengths[row] - k * max_bytes, max_bytes).astype(np.uint64)
    new_local = np.stack([local[row, 0] + offset, length], axis=1)
    new_remote = np.stack([remote[row, 0] + offset, length], axis=1)
    return new_local, new_remote
