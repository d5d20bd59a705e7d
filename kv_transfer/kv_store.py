"""A client of the shared KV store tier: Mooncake Store (DESIGN.md "KV tiers"; docs/architecture.md "Store tier").
No torch: it sees one registered host buffer of block slots as numpy bytes.

``--kv-store mooncake://MASTER_HOST:RPC_PORT?metadata=HOST:PORT`` names a ``mooncake_master`` (its RPC port)
and the HTTP metadata server the store's transfer engines meet at (``metadata=`` takes ``HOST:PORT`` or a full
``http://HOST:PORT/metadata`` URL). Optional query fields: ``host`` (the address this client advertises to
the store's other processes; default 127.0.0.1, so every byte stays on loopback) and ``timeout_s`` (the
longest any one store call is awaited; default 5).

One object per block: the key is the block hash in hex (the model fingerprint, block size and cache salt are
folded into it), the value is the block's bytes in wire order (layer 0's K and V, then layer 1's, ...: one slot
of the buffer) followed by a little-endian u64 xxh3-64 over the block hash and those bytes. Block hashes name
tokens, not bytes, so every read is verified: a value that is short, long, or fails its checksum (flipped bytes,
another key's bytes) is not used.

Every call runs on a thread of the client's own (``BoundedThread``) and is awaited at most ``timeout_s``: a
master that is down or hung, or a store client that stopped answering, costs a caller one deadline at most, and
while a call is stuck past its deadline the next ones on its thread are refused at once. Two threads: reads (a
request's admission waits for them) and the rest (writes, the index audit's lookups, removes, setup and close),
so a slow write never holds an admission back. The buffer is registered once, at start.

Mooncake's data calls release the GIL while they wait; ``setup`` and ``close`` do not (measured: a setup against
an absent master held the whole process for 90 s, 20 attempts; a close with the master stopped, 9 s). So
``start`` first checks, in Python and bounded, that the master's port takes connections and the metadata server
answers, and only then sets up (one retry at most); ``close`` is skipped when the last call failed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import numpy as np
import xxhash

from kv_transfer.bounded_thread import BoundedThread
from kv_transfer.errors import KVTransferError

logger = logging.getLogger(__name__)

CHECKSUM_BYTES = 8
STORE_SCHEME = "mooncake"
# Per-key results of a read
FETCHED, MISSING, CORRUPT, FAILED = "fetched", "missing", "corrupt", "failed"
_MISSING_CODE = -704  # Mooncake's OBJECT_NOT_FOUND
_LOCAL_BUFFER_BYTES = 1 << 20  # Mooncake's own staging for calls without a registered buffer (none are made)


class StoreError(KVTransferError):
    """The store refused a call or could not be reached (the caller recomputes or drops the write)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """Where the store is and how long one call may take."""

    master_address: str  # HOST:RPC_PORT of mooncake_master
    metadata_url: str  # http://HOST:PORT/metadata
    local_host: str = "127.0.0.1"  # the address this client's transfer engine advertises
    timeout_s: float = 5.0

    @property
    def uri(self) -> str:
        meta = urlsplit(self.metadata_url).netloc
        return f"{STORE_SCHEME}://{self.master_address}?metadata={meta}"


def parse_store_uri(uri: str) -> StoreConfig:
    """``mooncake://HOST:PORT?metadata=HOST:PORT[&host=ADDR][&timeout_s=S]``; ValueError naming what is wrong."""
    parts = urlsplit(uri)
    if parts.scheme != STORE_SCHEME:
        raise ValueError(f"--kv-store must be {STORE_SCHEME}://HOST:RPC_PORT?metadata=HOST:PORT, got {uri!r}")
    if not parts.hostname or parts.port is None:
        raise ValueError(f"--kv-store {uri!r}: the master's HOST:RPC_PORT is missing")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"metadata", "host", "timeout_s"}
    if unknown:
        raise ValueError(f"--kv-store {uri!r}: unknown field(s) {sorted(unknown)} (known: metadata, host, timeout_s)")
    meta = query.get("metadata")
    if not meta:
        raise ValueError(f"--kv-store {uri!r}: metadata=HOST:PORT (the HTTP metadata server) is missing")
    metadata_url = meta if meta.startswith("http://") else f"http://{meta}/metadata"
    timeout_s = float(query.get("timeout_s", 5.0))
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"--kv-store {uri!r}: timeout_s must be a positive number of seconds")
    return StoreConfig(master_address=f"{parts.hostname}:{parts.port}", metadata_url=metadata_url,
                       local_host=query.get("host", "127.0.0.1"), timeout_s=timeout_s)


def key_of(block_hash: bytes) -> str:
    return block_hash.hex()


def seal(block_hash: bytes, slot: np.ndarray, block_bytes: int) -> None:
    """Write the checksum of ``slot[:block_bytes]`` (under ``block_hash``) after the block's bytes."""
    slot[block_bytes : block_bytes + CHECKSUM_BYTES] = np.frombuffer(_digest(block_hash, slot[:block_bytes]), np.uint8)


def intact(block_hash: bytes, slot: np.ndarray, block_bytes: int) -> bool:
    """Whether ``slot`` holds ``block_hash``'s value: its bytes and their checksum agree."""
    return bytes(slot[block_bytes : block_bytes + CHECKSUM_BYTES]) == _digest(block_hash, slot[:block_bytes])


def _digest(block_hash: bytes, data: np.ndarray) -> bytes:
    h = xxhash.xxh3_64()
    h.update(block_hash)
    h.update(data)
    return h.intdigest().to_bytes(CHECKSUM_BYTES, "little")


class BlockStore:
    """Blocks in and out of the store through ``buffer`` (``[num_slots, stride]`` uint8, C-contiguous): slot
    ``i`` holds one value, ``block_bytes`` + the checksum. Asyncio side; one store thread does the calls."""

    def __init__(self, config: StoreConfig, buffer: np.ndarray, block_bytes: int) -> None:
        if buffer.ndim != 2 or buffer.dtype != np.uint8 or not buffer.flags.c_contiguous:
            raise ValueError("BlockStore: the buffer must be C-contiguous uint8 [num_slots, stride]")
        if buffer.shape[1] < block_bytes + CHECKSUM_BYTES:
            raise ValueError(f"BlockStore: slots of {buffer.shape[1]} bytes cannot hold {block_bytes} + checksum")
        self.config = config
        self.buffer = buffer
        self.block_bytes = block_bytes
        self.value_bytes = block_bytes + CHECKSUM_BYTES
        self._reads = BoundedThread("kv-store-read")  # what a request's admission waits for
        self._writes = BoundedThread("kv-store-write")  # the rest: writes, audits, removes, setup, close
        self._store = None  # the Mooncake client, once started
        self._healthy = True  # the last call succeeded (close only a healthy client: close holds the GIL)

    async def start(self) -> None:
        """Connect and register the buffer (checks first, then one deadline, twice the per-call one: setup meets
        the metadata server and the master); KVTransferError when the store cannot be reached."""
        _native_defaults(self.config)
        await probe(self.config)
        self._store = await self._call(self._writes, self._connect, 2 * self.config.timeout_s)

    def _connect(self):
        from mooncake.store import MooncakeDistributedStore  # the native library, loaded on the store thread

        store = MooncakeDistributedStore()
        c = self.config
        code = store.setup(c.local_host, c.metadata_url, 0, _LOCAL_BUFFER_BYTES, "tcp", "", c.master_address)
        if code != 0:
            raise StoreError(f"mooncake setup failed ({code}): master {c.master_address}, metadata {c.metadata_url}")
        code = store.register_buffer(self.buffer.ctypes.data, self.buffer.nbytes)
        if code != 0:
            store.close()
            raise StoreError(f"mooncake register_buffer of {self.buffer.nbytes} bytes failed ({code})")
        return store

    async def put(self, hashes: Sequence[bytes], slots: Sequence[int], *,
                  ended: Callable[[], None] | None = None) -> list[bool]:
        """Write each slot's block (sealed here, on the store thread) under its hash; per block, whether the store
        holds it now (an existing key counts). ``ended``: see ``BoundedThread.call`` (the slots are in use
        until then)."""
        def run() -> list[bool]:
            for block_hash, slot in zip(hashes, slots, strict=True):
                seal(block_hash, self.buffer[slot], self.block_bytes)
            codes = self._native().batch_put_from([key_of(h) for h in hashes], self._ptrs(slots),
                                                  [self.value_bytes] * len(slots))
            return [code == 0 for code in codes]

        return await self._call(self._writes, run, self.config.timeout_s, ended=ended)

    async def get(self, hashes: Sequence[bytes], slots: Sequence[int], *,
                  ended: Callable[[], None] | None = None) -> list[str]:
        """Read each hash's value into its slot and verify it; per block FETCHED, MISSING, CORRUPT or FAILED."""
        def run() -> list[str]:
            codes = self._native().batch_get_into([key_of(h) for h in hashes], self._ptrs(slots),
                                                  [self.buffer.shape[1]] * len(slots))
            return [self._verdict(h, s, code) for h, s, code in zip(hashes, slots, codes, strict=True)]

        return await self._call(self._reads, run, self.config.timeout_s, ended=ended)

    def _verdict(self, block_hash: bytes, slot: int, code: int) -> str:
        if code == _MISSING_CODE:
            return MISSING
        if code < 0:
            return FAILED
        if code != self.value_bytes or not intact(block_hash, self.buffer[slot], self.block_bytes):
            return CORRUPT
        return FETCHED

    async def exists(self, hashes: Sequence[bytes], *, background: bool = False) -> list[bool]:
        """Per hash, whether the store holds it (an error answer counts as not); ``background`` (the index audit):
        on the writes' thread, out of the admissions' way."""
        codes = await self._call(self._writes if background else self._reads,
                                 lambda: self._native().batch_is_exist([key_of(h) for h in hashes]),
                                 self.config.timeout_s)
        return [code == 1 for code in codes]

    async def remove(self, hashes: Sequence[bytes]) -> int:
        """Drop values that failed their checksum (``force``: a reader's lease on them must not keep them);
        how many went."""
        codes = await self._call(
            self._writes, lambda: self._native().batch_remove([key_of(h) for h in hashes], True),
            self.config.timeout_s)
        return sum(code == 0 for code in codes)

    @property
    def num_stuck(self) -> int:
        """How many of the client's threads are running a call past its deadline (0 or 1 each)."""
        return sum(1 for thread in (self._reads, self._writes) if thread.stuck_s)

    async def close(self) -> None:
        """Close the client, if it is healthy (bounded; a hung store leaves the daemon thread behind)."""
        if self._store is not None:
            store, self._store = self._store, None
            if not self._healthy:
                logger.warning("store client left open: its last call failed, and a close would hold the process")
            else:
                try:
                    await self._writes.call(store.close, 4 * self.config.timeout_s)
                except KVTransferError as exc:
                    logger.warning("closing the store client: %s", exc)
        self._reads.close()
        self._writes.close()

    async def _call(self, thread: BoundedThread, fn, timeout_s: float, *,
                    ended: Callable[[], None] | None = None):
        try:
            result = await thread.call(fn, timeout_s, ended=ended)
        except KVTransferError:
            self._healthy = False
            raise
        self._healthy = True
        return result

    def _native(self):
        if self._store is None:
            raise StoreError("the store client is not connected")
        return self._store

    def _ptrs(self, slots: Sequence[int]) -> list[int]:
        base, stride = self.buffer.ctypes.data, self.buffer.shape[1]
        return [base + int(slot) * stride for slot in slots]


async def probe(config: StoreConfig) -> None:
    """The master's RPC port takes a connection and the metadata server answers HTTP, each within the deadline
    (StoreError otherwise): checked before the native setup, which would hold the process while it retries."""
    host, port = config.master_address.rsplit(":", 1)
    meta = urlsplit(config.metadata_url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), config.timeout_s)
        writer.close()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(meta.hostname, meta.port or 80),
                                                config.timeout_s)
        try:
            writer.write(f"GET {meta.path}?key=baton-probe HTTP/1.0\r\nHost: {meta.netloc}\r\n\r\n".encode())
            status = await asyncio.wait_for(reader.readline(), config.timeout_s)
        finally:
            writer.close()
    except (OSError, asyncio.TimeoutError, ValueError) as exc:
        raise StoreError(f"the store at {config.uri} does not answer ({exc!r})") from None
    if not status.startswith(b"HTTP/"):
        raise StoreError(f"the metadata server {config.metadata_url} did not answer HTTP ({status[:40]!r})")


def _native_defaults(config: StoreConfig) -> None:
    """Mooncake reads these from the environment when a client is set up: advertise ``local_host`` (else it
    advertises the first LAN address), and let its own RPC and transfer timeouts end near ours so a stuck call
    frees the store thread soon after its deadline. Set only where the operator has not."""
    millis = str(int(config.timeout_s * 1000))
    for name, value in (("MC_TCP_BIND_ADDRESS", config.local_host), ("MC_RPC_TIMEOUT_MS", millis),
                        ("MC_RPC_CONNECT_TIMEOUT_MS", millis),
                        ("MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, math.ceil(config.timeout_s)))),
                        ("MC_STORE_CLIENT_SETUP_RETRIES", "2"),
                        ("GLOG_minloglevel", "1")):
        os.environ.setdefault(name, value)
