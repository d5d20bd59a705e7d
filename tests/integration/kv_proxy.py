"""A TCP proxy for fault injection on the KV data plane: a prefill worker advertises the proxy
(``--kv-advertise-uri``) and decode workers pull through it; the test sets what it does to each pull.

    pass     forward both ways untouched
    delay    hold the server's answer ``delay_s`` (shorter than the puller's I/O timeout), then forward
    stall    forward HELLO_OK, the DATA header and a little data, then stop forwarding for ``stall_s``
             and close (longer than the puller's I/O timeout: the pull fails)
    corrupt  flip one byte in the middle of the raw KV bytes (a checksumming puller catches it)

A connection is served in the mode set when it was accepted; since KV clients keep connections alive
between pulls (``kv_transfer/conn_pool.py``), setting ``mode`` drops every open connection, so the next pull
reconnects and meets the new mode.

It knows just enough of ``kv_transfer/tcp.py``'s framing (12-byte header ``<4sBBHI``: magic, version, kind,
code, payload length; DATA's payload is the u64 byte count of the raw KV that follows) to find the raw
bytes. Plain threads and blocking sockets with timeouts; ``stop`` closes every socket it opened.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter

HEADER = struct.Struct("<4sBBHI")
DATA_KIND = 4
MODES = ("pass", "delay", "stall", "corrupt")
STALL_AFTER_BYTES = 1024  # raw KV bytes forwarded before a stall


class KVProxy:
    def __init__(self, target_port: int, *, listen_port: int = 0, delay_s: float = 0.5, stall_s: float = 4.0) -> None:
        self.target = ("127.0.0.1", target_port)
        self._mode = "pass"
        self.delay_s, self.stall_s = delay_s, stall_s
        self.pulls: Counter[str] = Counter()  # connections served, by the mode they were served in
        self._listener = socket.create_server(("127.0.0.1", listen_port))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-proxy", daemon=True)
        self._thread.start()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self._mode = mode
        with self._lock:  # pooled client connections were accepted in the old mode
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @property
    def uri(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                _close(sock)
            self._sockets.clear()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._serve, args=(client, self.mode), daemon=True).start()

    def _serve(self, client: socket.socket, mode: str) -> None:
        self.pulls[mode] += 1
        try:
            server = socket.create_connection(self.target, timeout=5)
        except OSError:
            _close(client)
            return
        for sock in (client, server):
            sock.settimeout(15)
        with self._lock:
            self._sockets.update((client, server))
        upstream = threading.Thread(target=_pump, args=(client, server), daemon=True)
        upstream.start()
        try:
            self._answer(server, client, mode)
        except OSError:
            pass
        finally:
            for sock in (client, server):
                _close(sock)
            upstream.join(5)
            with self._lock:
                self._sockets.difference_update((client, server))

    def _answer(self, server: socket.socket, client: socket.socket, mode: str) -> None:
        """Server -> client, with the fault of ``mode``."""
        if mode == "delay":
            time.sleep(self.delay_s)
        if mode not in ("stall", "corrupt"):
            _pump(server, client)
            return
        hello = _forward_frame(server, client)
        data = _forward_frame(server, client) if hello is not None else None
        if data is None or data[0] != DATA_KIND:
            _pump(server, client)
            return
        (num_bytes,) = struct.unpack("<Q", data[1])
        if mode == "stall":
            _forward_exactly(server, client, min(STALL_AFTER_BYTES, num_bytes))
            self._stopped.wait(self.stall_s)
            return
        half = num_bytes // 2
        _forward_exactly(server, client, half)
        byte = _recv_exactly(server, 1)
        client.sendall(bytes([byte[0] ^ 0xFF]))
        _pump(server, client)


def _forward_frame(src: socket.socket, dst: socket.socket) -> tuple[int, bytes] | None:
    header = _recv_exactly(src, HEADER.size)
    if len(header) < HEADER.size:
        return None
    _, _, kind, _, length = HEADER.unpack(header)
    payload = _recv_exactly(src, length)
    dst.sendall(header + payload)
    return kind, payload


def _forward_exactly(src: socket.socket, dst: socket.socket, num_bytes: int) -> None:
    while num_bytes > 0:
        chunk = src.recv(min(num_bytes, 1 << 16))
        if not chunk:
            return
        dst.sendall(chunk)
        num_bytes -= len(chunk)


def _recv_exactly(src: socket.socket, num_bytes: int) -> bytes:
    out = bytearray()
    while len(out) < num_bytes:
        chunk = src.recv(num_bytes - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(1 << 16):
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
