"""Run on a host of ``tests/hosts.py`` (a network namespace) to let the test process, which stays in the machine's own
namespace, reach the hosts: each line ``PATH=HOST:PORT`` read from stdin makes it listen on the unix socket PATH
(a file: the machine's processes can open it) and forward every connection to HOST:PORT from inside this host;
it answers ``ok PATH`` once listening. gRPC dials ``unix:PATH``, redis-py ``unix://PATH``. It exits when stdin
closes.

    printf '/tmp/x/router.sock=10.213.0.2:50051\n' | python -m tests.hosts_forward
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        pass


async def _forward(host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5.0)
    except (OSError, TimeoutError):
        writer.close()
        return
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    for w in (writer, up_writer):
        with contextlib.suppress(OSError, RuntimeError):
            w.close()


async def main() -> None:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    servers = []
    while line := (await stdin.readline()).decode().strip():
        path, target = line.split("=", 1)
        host, port = target.rsplit(":", 1)
        servers.append(await asyncio.start_unix_server(functools.partial(_forward, host, int(port)), path))
        print(f"ok {path}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
