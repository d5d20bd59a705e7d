"""A real, private ``redis-server`` for tests: a free localhost port, a temp folder, no persistence.

    server = RedisServer.start()          # or: with RedisServer.start() as server:
    client = redis.asyncio.from_url(server.url)
    server.restart()                      # stop, then start again on the same port
    server.stop()                         # SIGTERM by PID, SIGKILL if it lingers
    RedisServer.start(password="pw")      # requirepass: url is redis://:pw@127.0.0.1:PORT/0
    RedisServer.start(tls=RedisTls(cert, key, ca))   # TLS only (no plaintext port): url is rediss://...

``redis_server_binary()`` finds the binary (``$BATON_REDIS_SERVER``, ``$PATH``, Debian's and Homebrew's
usual places); ``require_redis_server()`` skips the calling test with the install hint when there is none.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from kv_transfer.ports import free_port  # noqa: F401 - the port chooser (outside the ephemeral range), imported from here

INSTALL_HINT = "redis-server not found: run scripts/ensure-redis.sh (Debian: apt-get install -y redis-server)"
_CANDIDATES = ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server",
               "/opt/homebrew/bin/redis-server")


def redis_server_binary() -> str | None:
    """Path of a ``redis-server`` executable, or None."""
    explicit = os.environ.get("BATON_REDIS_SERVER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("redis-server")
    if found:
        return found
    return next((c for c in _CANDIDATES if os.access(c, os.X_OK)), None)


def require_redis_server() -> str:
    """The binary's path, or skip the calling pytest test with a clear reason."""
    binary = redis_server_binary()
    if binary is None:
        from tests.required import skip_unless

        skip_unless("redis", INSTALL_HINT)
    return binary




@dataclass(frozen=True)
class RedisTls:
    """Serve TLS only, with this certificate; clients need not present one (``--tls-auth-clients no``)."""

    cert: Path
    key: Path
    ca: Path


def _ping(port: int, timeout_s: float = 0.2, *, password: str | None = None, tls: RedisTls | None = None) -> bool:
    auth = b"" if password is None else f"AUTH {password}\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as raw:
            sock = raw if tls is None else ssl.create_default_context(cafile=str(tls.ca)).wrap_socket(
                raw, server_hostname="127.0.0.1")
            sock.sendall(auth + b"PING\r\n")
            reply = b""
            while b"PONG" not in reply and len(reply) < 256 and (chunk := sock.recv(64)):
                reply += chunk
            return b"+PONG" in reply
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` child process (not daemonized, so its PID is ours to stop)."""

    def __init__(self, binary: str, port: int, folder: Path, *, owns_folder: bool, password: str | None = None,
                 tls: RedisTls | None = None) -> None:
        self.binary, self.port, self.folder = binary, port, folder
        self.password, self.tls = password, tls
        self._owns_folder = owns_folder
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = "" if self.password is None else f":{quote(self.password, safe='')}@"
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(str(self.tls.ca))}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @classmethod
    def start(
        cls, *, binary: str | None = None, port: int | None = None, startup_timeout_s: float = 10.0,
        password: str | None = None, tls: RedisTls | None = None,
    ) -> RedisServer:
        """Start on ``port`` (a free one when None; retried on a lost port race) and wait for PING.

        ``password``: ``--requirepass``; ``tls``: serve TLS only on ``port``."""
        binary = binary or redis_server_binary()
        if binary is None:
            raise FileNotFoundError(INSTALL_HINT)
        folder = Path(tempfile.mkdtemp(prefix="baton-redis-"))
        for attempt in range(3):
            server = cls(binary, port or free_port(), folder, owns_folder=True, password=password, tls=tls)
            try:
                server._launch(startup_timeout_s)
                return server
            except RuntimeError:
                server._kill()
                if port is not None or attempt == 2:
                    shutil.rmtree(folder, ignore_errors=True)
                    raise
        raise AssertionError("unreachable")

    def _launch(self, startup_timeout_s: float) -> None:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--dir", str(self.folder), "--logfile", str(self.folder / "redis.log"),
        ]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.tls is not None:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                         "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                         "--tls-auth-clients", "no"]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if _ping(self.port, password=self.password, tls=self.tls):
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}: {self.log_tail()}")

    def log_tail(self, num_lines: int = 5) -> str:
        try:
            return " | ".join((self.folder / "redis.log").read_text().splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def stop(self, *, remove_folder: bool = True) -> None:
        """SIGTERM by PID, wait up to 5 s, then SIGKILL; removes the temp folder unless asked not to."""
        self._kill()
        if remove_folder and self._owns_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _kill(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._proc = None

    def restart(self, *, startup_timeout_s: float = 10.0) -> None:
        """Stop, then start again on the same port (data is lost: there is no persistence)."""
        self._kill()
        self._launch(startup_timeout_s)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
