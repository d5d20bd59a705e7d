"""Our client: the slice sent open-loop over Baton's gRPC ``Generate``, exact token ids."""

from __future__ import annotations

import asyncio
import sys
import time

from bench.trace_replay.outcomes import Outcome, store_tokens_of
from bench.trace_replay.slice import ReplayRequest

WARMUP_HASH_BASE = 1 << 40  # hash ids for warm-up prompts: far from any trace's ids, so they share nothing


async def replay_grpc(address: str, requests: list[ReplayRequest], *, vocab_size: int, request_timeout_s: float,
                      max_run_s: float, warmup: int = 2, label: str = "") -> tuple[list[Outcome], float]:
    """Send every request at its arrival offset (open loop), exact token ids; per request what the router
    reported. Requests still running ``max_run_s`` after the start are cancelled (failed, ``run bound``)."""
    import grpc

    from proto import baton_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await _warm_up(stub, warmup, vocab_size, request_timeout_s)
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(_send(stub, r, start, request_timeout_s)) for r in requests]
        progress = _Progress(label, len(tasks))
        for task in tasks:
            task.add_done_callback(progress.update)
        done, pending = await asyncio.wait(tasks, timeout=max_run_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return _collect(requests, tasks, done, start, max_run_s)


async def _warm_up(stub, warmup: int, vocab_size: int, request_timeout_s: float) -> None:
    """Outside the clock: prompts that share nothing with the trace."""
    from bench.client import greedy_request, stream_generate
    from workload.trace import block_token_ids

    for i in range(warmup):
        prompt = block_token_ids(WARMUP_HASH_BASE + i, 48, vocab_size).tolist()
        await stream_generate(stub, greedy_request(prompt, 2), request_timeout_s)


async def _send(stub, r: ReplayRequest, start: float, request_timeout_s: float) -> tuple[Outcome, float]:
    """One request at its arrival offset from ``start``: its outcome and when its last token came."""
    import grpc

    from bench.client import greedy_request, stream_generate

    await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
    try:
        stream = await stream_generate(stub, greedy_request(r.prompt, r.max_tokens), request_timeout_s)
    except grpc.aio.AioRpcError as exc:
        return Outcome(index=r.index, ok=False, prompt_tokens=len(r.prompt), error=exc.code().name), 0.0
    last, times = stream.last, stream.token_times_s
    if not times:
        return Outcome(index=r.index, ok=False, prompt_tokens=len(r.prompt), error="no tokens"), 0.0
    t = last.timings
    return Outcome(index=r.index, ok=True, prompt_tokens=last.usage.prompt_tokens or len(r.prompt),
                   cached_tokens=last.usage.cached_prompt_tokens, output_tokens=len(times),
                   ttft_s=times[0] - stream.sent_s, e2e_s=times[-1] - stream.sent_s,
                   route_kind=t.route_kind, prefill_worker=t.prefill_worker, decode_worker=t.decode_worker,
                   store_tokens=store_tokens_of(t.route_reason), queue_ms=t.queue_ms,
                   prefill_ms=t.prefill_ms, transfer_ms=t.transfer_ms), times[-1]


def _collect(requests: list[ReplayRequest], tasks: list[asyncio.Future], done: set[asyncio.Future], start: float,
             max_run_s: float) -> tuple[list[Outcome], float]:
    """Every request's outcome in the slice's order (``run bound`` for one that did not finish in time) and the
    run's duration: from the start to the last token, or to the bound when a request hit it."""
    outcomes, end = [], start
    for r, task in zip(requests, tasks):
        if task in done and not task.cancelled() and task.exception() is None:
            outcome, finished = task.result()
            end = max(end, finished)
        else:
            outcome = Outcome(index=r.index, ok=False, prompt_tokens=len(r.prompt), error="run bound")
            end = start + max_run_s
        outcomes.append(outcome)
    return outcomes, end - start


class _Progress:
    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.start = label, total, 0, time.perf_counter()
        self.every = max(1, total // 10)

    def update(self, _task) -> None:
        self.done += 1
        if self.done % self.every == 0 or self.done == self.total:
            print(f"[{self.label}] {self.done}/{self.total} done, {time.perf_counter() - self.start:.0f} s",
                  file=sys.stderr, flush=True)


async def probe(address: str, prompts: list[list[int]], *, max_tokens: int = 2,
                request_timeout_s: float = 60.0) -> list[dict]:
    """Requests sent one at a time (nothing else in flight): per request the client's TTFT and what the router's
    timings say of it (route, the computing worker's queue + compute, the KV pull). The simulator's calibration
    times the router's own share and the pull with these (``bench/sim_check.py``)."""
    import grpc

    from bench.client import greedy_request, stream_generate
    from proto import baton_pb2_grpc as pb_grpc

    out = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for prompt in prompts:
            stream = await stream_generate(stub, greedy_request(prompt, max_tokens), request_timeout_s)
            t = stream.last.timings
            out.append({"prompt_tokens": len(prompt), "ttft_s": stream.token_times_s[0] - stream.sent_s,
                        "route_kind": t.route_kind, "prefill_ms": t.prefill_ms, "transfer_ms": t.transfer_ms,
                        "transfer_bytes": t.transfer_bytes})
    return out
