"""Authenticated reads on the KV data plane: an HMAC over each read request, with no extra round trip.

A worker started with a data-plane secret (``--kv-secret-file`` / ``$BATON_KV_SECRET``; the same on every
worker of a deployment) serves reads only to peers that prove they hold it. Each read request (tcp
``READ``, nccl ``N_READ``, ucx read) carries a trailer::

    u64 unix_ms | 16-byte random nonce | 32-byte HMAC-SHA256(secret, DOMAIN | kind | unix_ms | nonce | request)

and sets the ``READ_AUTH`` flag. The serving side checks, before any KV byte moves: the flag is set, the
clock skew is within ``window_s``, the nonce was not seen within the window (a captured request cannot
be replayed), and the MAC (``hmac.compare_digest``). Any failure is the same refusal, ``unauthenticated``,
whatever was wrong, so a probing peer learns nothing. Lease ids already are unguessable capabilities;
the secret makes a sniffed lease id useless too. The bytes themselves are not encrypted: run the data
plane on a private network (or use the optional per-block checksums for integrity; see
docs/operations.md, Security).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

from kv_transfer.errors import KVTransferError

DOMAIN = b"baton-kv-read-v1"
TRAILER = struct.Struct("<Q16s32s")
MIN_SECRET_BYTES = 16
ENV_SECRET = "BATON_KV_SECRET"


class Unauthenticated(KVTransferError):
    """A read request without valid data-plane credentials."""


def load_secret(path: str | None = None, environ: dict[str, str] | None = None) -> bytes | None:
    """The data-plane secret: the file's bytes (surrounding whitespace stripped), else ``$BATON_KV_SECRET``,
    else None (reads are not authenticated). Raises ValueError when it is too short to be a key."""
    environ = os.environ if environ is None else environ
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"--kv-secret-file {path}: {exc.strerror or exc}") from exc
    elif environ.get(ENV_SECRET):
        secret = environ[ENV_SECRET].strip().encode()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the KV data-plane secret must be at least {MIN_SECRET_BYTES} bytes "
                         "(e.g. `openssl rand -hex 32`)")
    return secret


class ReadAuth:
    """Signs read requests (pulling side) and verifies them (serving side) with one shared secret."""

    def __init__(self, secret: bytes, *, window_s: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"secret shorter than {MIN_SECRET_BYTES} bytes")
        self._secret, self.window_s, self._clock = secret, window_s, clock
        self._seen: dict[bytes, float] = {}  # nonce -> when it may be forgotten (unix seconds)

    def _mac(self, kind: int, unix_ms: int, nonce: bytes, request: bytes) -> bytes:
        message = b"".join((DOMAIN, struct.pack("<BQ", kind, unix_ms), nonce, request))
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def sign(self, kind: int, request: bytes) -> bytes:
        """The trailer to append to ``request`` (a read of frame kind ``kind``)."""
        unix_ms, nonce = int(self._clock() * 1000), os.urandom(16)
        return TRAILER.pack(unix_ms, nonce, self._mac(kind, unix_ms, nonce, request))

    def verify(self, kind: int, request: bytes, trailer: bytes) -> None:
        """Raise ``Unauthenticated`` unless ``trailer`` is a fresh, unreplayed MAC of ``request``."""
        if len(trailer) != TRAILER.size:
            raise Unauthenticated("unauthenticated")
        unix_ms, nonce, mac = TRAILER.unpack(trailer)
        now = self._clock()
        if abs(now - unix_ms / 1000) > self.window_s:
            raise Unauthenticated("unauthenticated")
        if not hmac.compare_digest(mac, self._mac(kind, unix_ms, nonce, request)):
            raise Unauthenticated("unauthenticated")
        self._forget_expired(now)
        if nonce in self._seen:
            raise Unauthenticated("unauthenticated")
        self._seen[nonce] = now + 2 * self.window_s

    def _forget_expired(self, now: float) -> None:
        if len(self._seen) > 1024:
            self._seen = {n: until for n, until in self._seen.items() if until > now}


def split_trailer(payload: bytes, authenticated: bool) -> tuple[bytes, bytes | None]:
    """(request, trailer) of a read payload whose ``READ_AUTH`` flag is ``authenticated``."""
    if not authenticated:
        return payload, None
    if len(payload) < TRAILER.size:
        raise KVTransferError("malformed READ: authentication trailer cut short")
    return payload[: -TRAILER.size], payload[-TRAILER.size :]


def check(auth: ReadAuth | None, kind: int, request: bytes, trailer: bytes | None) -> None:
    """The serving side's rule: with a secret configured, every read must carry a valid trailer."""
    if auth is None:
        return
    if trailer is None:
        raise Unauthenticated("unauthenticated")
    auth.verify(kind, request, trailer)
