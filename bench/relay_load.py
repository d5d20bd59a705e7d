"""The client side of ``bench relay``: many concurrent token streams against one address, counted over a window.

Each of ``concurrency`` streams asks for ``max_tokens`` tokens, reads them all, and asks again, until the window
ends; their first requests are shorter, spread over 1 .. ``max_tokens``, so the streams never start (and route)
in step. Tokens and messages are counted as they arrive; the processes named in ``pids`` have their CPU time read
(``psutil``: user + system, every thread) at both ends of the window, so a report can say how many tokens each
core-second of the router carried. The streams spread over several channels, each its own connection (a local
subchannel pool): one HTTP/2 connection would serialize every stream on one socket, and ``SO_REUSEPORT`` hands
each *connection* to one router process.

Three paths share this code: ``direct`` (``Worker/Decode`` on the worker), ``router`` (``Generation/Generate``
through the router) and ``http`` (``POST /v1/completions`` with ``stream: true`` through the router's OpenAI
front).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import psutil

from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc

PROMPT = list(range(10, 42))  # 32 token ids of the tiny vocabulary: a local prefill on the (synthetic) worker
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


@dataclass(frozen=True, slots=True, kw_only=True)
class Point:
    """One window's counts: ``cpu_s`` per named process (the client is ``client``)."""

    path: str
    concurrency: int
    tokens: int
    messages: int
    requests: int
    seconds: float
    cpu_s: Mapping[str, float]
    loadavg_1m: float = 0.0  # the machine's 1-minute load average when the window began

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def cores(self, name: str) -> float:
        """How many cores ``name`` kept busy on average over the window."""
        return self.cpu_s.get(name, 0.0) / self.seconds

    @property
    def other_cores(self) -> float:
        """Cores busy with anything but the named processes (other tenants of this machine) over the window."""
        ours = sum(v for k, v in self.cpu_s.items() if k != "machine")
        return max(0.0, self.cpu_s.get("machine", 0.0) - ours) / self.seconds

    def tokens_per_core_s(self, name: str) -> float | None:
        """Tokens carried per CPU-second of ``name``: its capacity per core, whatever else shared the machine."""
        cpu_s = self.cpu_s.get(name, 0.0)
        return self.tokens / cpu_s if cpu_s > 0 else None


class _Counts:
    def __init__(self) -> None:
        self.tokens = self.messages = self.requests = 0


Stream = Callable[[int, _Counts, int], Awaitable[None]]  # one request of (stream index, counts, max_tokens)


def _cpu_s(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of each named process, and of the whole machine (``machine``: all but idle and iowait)."""
    out = {}
    for name, pid in pids.items():
        times = psutil.Process(pid).cpu_times()
        out[name] = times.user + times.system
    total = psutil.cpu_times()
    out["machine"] = sum(total) - total.idle - getattr(total, "iowait", 0.0)
    return out


async def measure(stream: Stream, concurrency: int, *, path: str, pids: Mapping[str, int], max_tokens: int,
                  warmup_s: float, duration_s: float, windows: int = 1) -> list[Point]:
    """Run ``concurrency`` streams; count what arrives in ``windows`` consecutive windows of ``duration_s`` after
    ``warmup_s``."""
    counts, stop = _Counts(), asyncio.Event()

    async def loop(index: int) -> None:
        await stream(index, counts, 1 + index * max_tokens // concurrency)  # staggered
        while not stop.is_set():
            await stream(index, counts, max_tokens)

    def snapshot() -> tuple[int, int, int, dict[str, float], float]:
        return counts.tokens, counts.messages, counts.requests, _cpu_s(named), time.perf_counter()

    named, points = {**pids, "client": psutil.Process().pid}, []
    tasks = [asyncio.create_task(loop(i)) for i in range(concurrency)]
    try:
        await asyncio.sleep(warmup_s)
        for _ in range(windows):
            load, (tokens0, messages0, requests0, cpu0, t0) = os.getloadavg()[0], snapshot()
            await asyncio.sleep(duration_s)
            tokens1, messages1, requests1, cpu1, t1 = snapshot()
            points.append(Point(path=path, concurrency=concurrency, tokens=tokens1 - tokens0,
                                messages=messages1 - messages0, requests=requests1 - requests0, seconds=t1 - t0,
                                cpu_s={k: cpu1[k] - cpu0[k] for k in cpu1}, loadavg_1m=load))
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return points


class GrpcStreams:
    """``direct`` or ``router`` streams over ``num_channels`` connections to ``address``."""

    def __init__(self, address: str, *, direct: bool, num_channels: int) -> None:
        self._channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(num_channels)]
        self._direct, self._ids = direct, itertools.count()

    async def __call__(self, index: int, counts: _Counts, max_tokens: int) -> None:
        channel = self._channels[index % len(self._channels)]
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=1)
        if self._direct:
            request = pb.DecodeRequest(request_id=f"relay-{next(self._ids)}", token_ids=PROMPT, sampling=sampling,
                                       prompt_len=len(PROMPT))
            call = pb_grpc.WorkerStub(channel).Decode(request)
        else:
            call = pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling))
        async for response in call:
            counts.tokens += len(response.token_ids)
            counts.messages += 1
        counts.requests += 1

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self._channels))


class HttpStreams:
    """``http`` streams: ``/v1/completions`` with ``stream: true``, one connection per stream (HTTP/1.1).

    SSE chunks carry text, not token ids: a stream's tokens are counted as its text grows, from ``text_lengths``
    (the length of the worker's first k tokens' text, for every k), and set exact by the usage of its last chunk."""

    def __init__(self, address: str, *, text_lengths: Sequence[int]) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        self._url, self._lengths = f"http://{address}/v1/completions", text_lengths
        self._body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "stream": True,
                      "stream_options": {"include_usage": True}}

    async def __call__(self, index: int, counts: _Counts, max_tokens: int) -> None:
        chars = counted = 0
        async with self._session.post(self._url, json={**self._body, "max_tokens": max_tokens}) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                counts.messages += 1
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    now = chunk["usage"]["completion_tokens"]
                else:
                    chars += len(chunk["choices"][0]["text"])
                    now = bisect.bisect_right(self._lengths, chars) - 1
                counts.tokens += now - counted
                counted = now
        counts.requests += 1

    async def close(self) -> None:
        await self._session.close()
