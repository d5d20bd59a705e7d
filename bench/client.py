"""Clients for the benchmarks: one greedy streaming request with per-token arrival times — gRPC ``Generate`` or
the OpenAI ``/v1/completions`` stream (SSE) — and an open-loop sender that fires planned requests at their
offsets and records TTFT / ITL / E2E per request.

Over gRPC each token is stamped when the message carrying it arrives. Over HTTP each SSE chunk with text is
stamped once (the router sends one chunk per response it relays); the output token count comes from the
stream's final ``usage``. A response whose tokens decode to no text yet (a partial UTF-8 sequence) sends no
chunk, so its tokens arrive with the next one: HTTP then shows one longer gap where gRPC shows two (vLLM's
``benchmark_serving`` counts chunks alike).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from proto import tls

PROTOCOLS = ("grpc", "http")


@dataclass(frozen=True, slots=True)
class Stream:
    sent_s: float  # perf_counter() when the call was made
    token_times_s: list[float]  # perf_counter() at which each output token arrived
    last: pb.GenerateResponse  # the final message (usage, timings, finish reason)


def greedy_request(prompt: list[int] | str, max_tokens: int) -> pb.GenerateRequest:
    """Greedy, ``ignore_eos`` (so every request yields exactly ``max_tokens``); token ids or text."""
    params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=1)
    if isinstance(prompt, str):
        return pb.GenerateRequest(prompt=prompt, sampling=params)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)


async def stream_generate(stub, request: pb.GenerateRequest, timeout_s: float | None = None) -> Stream:
    """Send ``request`` and drain the stream, stamping each token as its message arrives."""
    sent = time.perf_counter()
    times: list[float] = []
    last = pb.GenerateResponse()
    async for resp in stub.Generate(request, timeout=timeout_s):
        now = time.perf_counter()
        times += [now] * len(resp.token_ids)
        last = resp
    return Stream(sent_s=sent, token_times_s=times, last=last)


@dataclass(frozen=True, slots=True)
class Planned:
    arrival_s: float | None  # offset from the start; None = draw one from the arrival process
    prompt: list[int] | str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    itl_s: tuple[float, ...]
    error: str = ""
    route_kind: str = ""  # remote | local, as the router reports it (gRPC only; the SSE stream does not say)
    route: dict | None = None  # the router's timings of the decision (gRPC only): reason, predicted vs queue/prefill


def route_of(timings) -> dict:
    """What the router said of a request's route (its gRPC ``Timings``), to explain a measured latency."""
    return {"reason": timings.route_reason, "prefill_worker": timings.prefill_worker,
            "decode_worker": timings.decode_worker, "predicted_ttft_ms": round(timings.predicted_ttft_ms, 2),
            "queue_ms": round(timings.queue_ms, 2), "prefill_ms": round(timings.prefill_ms, 2),
            "transfer_ms": round(timings.transfer_ms, 2)}


def _measured(sent_s: float, times: list[float], prompt_tokens: int, output_tokens: int,
              route_kind: str = "", route: dict | None = None) -> Result:
    if not times:
        raise RuntimeError("no tokens")
    return Result(ok=True, prompt_tokens=prompt_tokens, output_tokens=output_tokens, ttft_s=times[0] - sent_s,
                  e2e_s=times[-1] - sent_s, itl_s=tuple(b - a for a, b in zip(times, times[1:])),
                  route_kind=route_kind, route=route)


def _failed(prompt_tokens: int, error: str) -> Result:
    return Result(ok=False, prompt_tokens=prompt_tokens, output_tokens=0, ttft_s=0.0, e2e_s=0.0, itl_s=(),
                  error=error)


# ---- OpenAI HTTP (SSE) --------------------------------------------------------------------------
class StreamError(RuntimeError):
    """The HTTP front answered an error status, or ended the stream with an error event."""


def completion_body(prompt: list[int] | str, max_tokens: int) -> dict:
    """The HTTP twin of ``greedy_request``: greedy, ``ignore_eos``, streamed, usage in the last chunk."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "seed": 1,
            "stream": True, "stream_options": {"include_usage": True}}


@dataclass(frozen=True, slots=True)
class SseStream:
    sent_s: float
    chunk_times_s: list[float]  # perf_counter() of each chunk that carried output
    usage: dict  # the last chunk's usage ({} if none came)


async def stream_completion(session, url: str, body: dict, timeout_s: float | None = None) -> SseStream:
    """POST ``body`` to ``url`` (``.../v1/completions``) and read the SSE stream, stamping each text chunk."""
    import aiohttp

    sent, times, usage = time.perf_counter(), [], {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(url, json=body, timeout=timeout) as http:
        if http.status != 200:
            raise StreamError(f"HTTP {http.status}: {(await http.text())[:200]}")
        async for raw in http.content:
            now, line = time.perf_counter(), raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise StreamError(f"stream error: {chunk['error'].get('message', chunk['error'])}")
            usage = chunk.get("usage") or usage
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("text") or (choice.get("finish_reason") and not times):
                times.append(now)
    return SseStream(sent_s=sent, chunk_times_s=times, usage=usage)


def http_base(router: str) -> str:
    """``HOST:PORT`` or a URL -> ``http://HOST:PORT`` (no trailing slash)."""
    return (router if "://" in router else f"http://{router}").rstrip("/")


async def http_model_card(router: str) -> dict:
    """The served model's card from ``GET /v1/models`` (id, max_model_len)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{http_base(router)}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as http:
            http.raise_for_status()
            return (await http.json())["data"][0]


# ---- open-loop sender ---------------------------------------------------------------------------
class Progress:
    """One line on stderr, rewritten as requests finish."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self.start_s = time.perf_counter()

    def update(self, result: Result) -> None:
        self.done += 1
        self.failed += not result.ok
        bar = "#" * (20 * self.done // self.total)
        print(f"\r[{self.label}] [{bar:<20}] {self.done}/{self.total} done, {self.failed} failed, "
              f"{time.perf_counter() - self.start_s:.1f} s", end="\n" if self.done == self.total else "",
              file=sys.stderr, flush=True)


Call = Callable[[Planned], Awaitable[Result]]


async def _send(call: Call, req: Planned, at_s: float, progress: Progress) -> tuple[Result, float]:
    """One request at ``at_s`` (perf_counter); its result and when it ended."""
    await asyncio.sleep(max(0.0, at_s - time.perf_counter()))
    result = await call(req)
    progress.update(result)
    return result, time.perf_counter()


def _grpc_call(stub, timeout_s: float) -> Call:
    async def call(req: Planned) -> Result:
        prompt_tokens = 0 if isinstance(req.prompt, str) else len(req.prompt)
        try:
            stream = await stream_generate(stub, greedy_request(req.prompt, req.max_tokens), timeout_s)
            times = stream.token_times_s
            timings = stream.last.timings
            return _measured(stream.sent_s, times, stream.last.usage.prompt_tokens or prompt_tokens, len(times),
                             timings.route_kind, route_of(timings))
        except grpc.aio.AioRpcError as e:
            return _failed(prompt_tokens, e.code().name)
        except RuntimeError as e:
            return _failed(prompt_tokens, str(e))
    return call


def _http_call(session, url: str, timeout_s: float) -> Call:
    import aiohttp

    async def call(req: Planned) -> Result:
        prompt_tokens = 0 if isinstance(req.prompt, str) else len(req.prompt)
        try:
            stream = await stream_completion(session, url, completion_body(req.prompt, req.max_tokens), timeout_s)
            times = stream.chunk_times_s
            return _measured(stream.sent_s, times, stream.usage.get("prompt_tokens") or prompt_tokens,
                             stream.usage.get("completion_tokens") or len(times))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, RuntimeError) as e:
            return _failed(prompt_tokens, f"{type(e).__name__}: {e}")
    return call


async def model_info(router: str, tls_config: tls.TlsConfig | None = None) -> pb.ModelInfoResponse:
    async with tls.aio_channel(router, tls_config) as channel:
        return await pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30)


async def _fire(call: Call, planned: list[Planned], offsets_s: list[float], label: str,
                warmup: int) -> tuple[list[Result], float]:
    for _ in range(warmup):  # not counted: warm the path before the clock starts
        if not (await call(Planned(None, [4] * 8, 2))).ok:
            raise RuntimeError(f"[{label}] a warmup request failed")
    progress = Progress(label, len(planned))
    start_s = progress.start_s = time.perf_counter()
    pairs = await asyncio.gather(*(_send(call, p, start_s + t, progress) for p, t in zip(planned, offsets_s)))
    return [r for r, _ in pairs], max(end for _, end in pairs) - start_s


async def run_once(router: str, planned: list[Planned], offsets_s: list[float], label: str,
                   timeout_s: float, warmup: int, protocol: str = "grpc",
                   tls_config: tls.TlsConfig | None = None) -> tuple[list[Result], float]:
    """Send every request at its offset; the results (in plan order) and the duration to the last finish.
    ``router`` is the gRPC ``HOST:PORT`` or, with ``protocol="http"``, the OpenAI front's."""
    if protocol == "http":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue requests in the client
        async with aiohttp.ClientSession(connector=connector) as session:
            call = _http_call(session, f"{http_base(router)}/v1/completions", timeout_s)
            return await _fire(call, planned, offsets_s, label, warmup)
    async with tls.aio_channel(router, tls_config) as channel:
        return await _fire(_grpc_call(pb_grpc.GenerationStub(channel), timeout_s), planned, offsets_s, label, warmup)
