"""gRPC clients for the benchmarks: one greedy streaming Generate with per-token arrival times, and an open-loop
sender that fires planned requests at their offsets and records TTFT / ITL / E2E per request."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import grpc

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc


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


async def _send(stub, req: Planned, at_s: float, timeout_s: float, progress: Progress) -> tuple[Result, float]:
    """One request at ``at_s`` (perf_counter); its result and when it ended."""
    await asyncio.sleep(max(0.0, at_s - time.perf_counter()))
    prompt_tokens = 0 if isinstance(req.prompt, str) else len(req.prompt)
    try:
        stream = await stream_generate(stub, greedy_request(req.prompt, req.max_tokens), timeout_s)
        times = stream.token_times_s
        if not times:
            raise RuntimeError("no tokens")
        result = Result(ok=True, prompt_tokens=stream.last.usage.prompt_tokens or prompt_tokens,
                        output_tokens=len(times), ttft_s=times[0] - stream.sent_s, e2e_s=times[-1] - stream.sent_s,
                        itl_s=tuple(b - a for a, b in zip(times, times[1:])))
    except (grpc.aio.AioRpcError, RuntimeError) as e:
        error = e.code().name if isinstance(e, grpc.aio.AioRpcError) else str(e)
        result = Result(ok=False, prompt_tokens=prompt_tokens, output_tokens=0, ttft_s=0.0, e2e_s=0.0, itl_s=(),
                        error=error)
    progress.update(result)
    return result, time.perf_counter()


async def model_info(router: str) -> pb.ModelInfoResponse:
    async with grpc.aio.insecure_channel(router) as channel:
        return await pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30)


async def run_once(router: str, planned: list[Planned], offsets_s: list[float], label: str,
                   timeout_s: float, warmup: int) -> tuple[list[Result], float]:
    """Send every request at its offset; the results (in plan order) and the duration to the last finish."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for _ in range(warmup):  # not counted: warm the path before the clock starts
            await stream_generate(stub, greedy_request([4] * 8, 2), timeout_s)
        progress = Progress(label, len(planned))
        start_s = progress.start_s = time.perf_counter()
        pairs = await asyncio.gather(*(_send(stub, p, start_s + t, timeout_s, progress)
                                       for p, t in zip(planned, offsets_s)))
    return [r for r, _ in pairs], max(end for _, end in pairs) - start_s
