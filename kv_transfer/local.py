"""``local://name``: the same-process transport (tests, aggregated mode) — a strided numpy copy per run.

Servers register in a ``LocalRegistry``, an in-process name service; ``DEFAULT_REGISTRY`` is the one
``make_server("local", ...)`` and ``connect("local://...")`` share. Pass your own to keep components apart.
With ``TransportConfig.checksum`` on the client, the server hashes the source blocks before copying and the
client verifies what landed, as over a wire (a copy cannot corrupt, but the source may change under it).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np

from kv_transfer import checksum
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.transport import KVClient, Locator, Pull, Resolver, TransportConfig, check_read


class LocalRegistry:
    """Local servers by URI."""

    def __init__(self) -> None:
        self._servers: dict[str, LocalServer] = {}

    def register(self, uri: str, server: LocalServer) -> None:
        if uri in self._servers:
            raise KVTransferError(f"a local KV server already serves {uri}")
        self._servers[uri] = server

    def unregister(self, uri: str) -> None:
        self._servers.pop(uri, None)

    def lookup(self, uri: str) -> LocalServer:
        server = self._servers.get(uri)
        if server is None:
            raise KVTransferError(f"no local KV server at {uri}")
        return server


DEFAULT_REGISTRY = LocalRegistry()


class LocalServer:
    """Serves reads of leased blocks of ``buffer`` to ``LocalClient``s of the same registry."""

    def __init__(
        self,
        *,
        buffer: KVBuffer,
        resolve: Resolver,
        config: TransportConfig | None = None,
        registry: LocalRegistry | None = None,
        name: str | None = None,
        locate: Locator | None = None,
    ) -> None:
        self.buffer = buffer
        self.resolve = resolve
        self.locate = locate
        self.registry = registry or DEFAULT_REGISTRY
        self.name = name or secrets.token_hex(6)
        self.uri: str | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Register as ``local://{name}`` (``host`` and ``port`` do not apply)."""
        if self.uri is None:
            uri = f"local://{self.name}"
            self.registry.register(uri, self)
            self.uri = uri
        return self.uri

    async def stop(self) -> None:
        if self.uri is not None:
            self.registry.unregister(self.uri)
            self.uri = None

    def read_into(
        self,
        layout: KVLayout,
        lease_id: str,
        src_ids: Sequence[int],
        dst: KVBuffer,
        dst_ids: Sequence[int],
        *,
        with_checksums: bool = False,
    ) -> np.ndarray | None:
        """Copy leased blocks into ``dst``; everything is checked before the first byte is copied.
        Returns the source blocks' checksums, computed before the copy, when asked (else None)."""
        self.buffer.layout.check_compatible(layout)
        if self.locate is not None:
            src_ids = self.locate(lease_id, src_ids)
        check_read(self.buffer, self.resolve, lease_id, src_ids)
        sums = checksum.block_checksums(self.buffer, src_ids) if with_checksums else None
        dst.copy_blocks_from(self.buffer, src_ids, dst_ids)
        check_read(self.buffer, self.resolve, lease_id, src_ids)  # the lease held for the whole copy
        return sums


class LocalClient(KVClient):
    """Pulls from the ``LocalServer``s of its registry: one copy, in this process."""

    def __init__(self, config: TransportConfig | None = None, registry: LocalRegistry | None = None) -> None:
        super().__init__(config)
        self.registry = registry or DEFAULT_REGISTRY

    async def _pull(self, request: Pull) -> None:
        server = self.registry.lookup(request.uri)
        sums = server.read_into(request.layout, request.lease_id, request.src_ids, request.dst_buffer, request.dst_ids,
                                with_checksums=self.config.checksum)
        if sums is not None:
            checksum.verify(request.dst_buffer, request.dst_ids, sums)
