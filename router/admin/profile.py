"""``baton admin profile``: measure a running worker, in place, for the planner.

Why through the workers' own gRPC API (not an in-process engine with ``--model``): an operator wants the
curves of the hardware, model, engine flags and transport actually deployed, without loading a model into
the CLI. The CLI finds the worker through the router's Admin ``ListWorkers`` and sends it synthetic token
ids, each request with a fresh ``cache_salt`` so no prefix cache is hit, and releases every transfer lease
at once. Profile a drained or idle worker: live traffic on it inflates the numbers.

- prefill: tokens/s vs prompt length, from the wall time of ``Prefill`` (a prefill worker) or of the first
  token of a ``Decode`` (a decode worker, prefilling locally), the median of ``repeats`` after one warm-up;
- decode: inter-token latency vs batch size at each context length: ``batch`` concurrent ``Decode`` streams;
  the ITL is each stream's mean gap between tokens once every stream has its first token (prefills finished),
  the median over streams (``steady_itl_s`` says why not the median single gap).
  ITL is made non-decreasing in batch size (running max) as the planner requires; noise can break it.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileConfig:
    prompt_lens: tuple[int, ...] = (32, 64, 128, 256, 512)
    repeats: int = 3
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    context_lens: tuple[int, ...] = (64, 256)
    decode_tokens: int = 16  # output tokens per stream at each decode point
    timeout_s: float = 60.0  # per request


@dataclass(frozen=True, slots=True, kw_only=True)
class Model:
    """What the router says about the served model (``Generation/ModelInfo``)."""

    vocab_size: int
    max_model_len: int
    block_size: int


def fits(config: ProfileConfig, model: Model, kv_tokens: int | None) -> ProfileConfig:
    """The grid without the points this model / worker cannot hold (prompt too long, KV too small)."""
    limit = model.max_model_len - 1
    prompts = tuple(n for n in config.prompt_lens if n <= limit)
    contexts = tuple(c for c in config.context_lens if c + config.decode_tokens <= model.max_model_len)
    cap = None if kv_tokens is None or not contexts else kv_tokens // (max(contexts) + config.decode_tokens + 1)
    batches = tuple(b for b in config.batch_sizes if cap is None or b <= cap)
    return ProfileConfig(prompt_lens=prompts, repeats=config.repeats, batch_sizes=batches, context_lens=contexts,
                         decode_tokens=config.decode_tokens, timeout_s=config.timeout_s)


class WorkerProfiler:
    """Times one worker through its ``baton.v1.Worker`` stub (synchronous gRPC)."""

    def __init__(self, stub: pb_grpc.WorkerStub, role: str, model: Model, config: ProfileConfig,
                 progress: Progress, *, seed: int = 0) -> None:
        self.stub, self.role, self.model, self.config = stub, role, model, config
        self.progress = progress
        self._random = random.Random(seed)

    def prefill_curve(self) -> pb.PrefillCurve:
        lens, rates = [], []
        self._prefill_s(self.config.prompt_lens[0])  # warm-up
        for i, n in enumerate(self.config.prompt_lens, 1):
            seconds = statistics.median(self._prefill_s(n) for _ in range(self.config.repeats))
            lens.append(n)
            rates.append(n / seconds)
            self.progress(f"prefill [{i}/{len(self.config.prompt_lens)}] {n} tokens: {n / seconds:,.0f} tok/s "
                          f"({seconds * 1e3:.1f} ms)")
        return pb.PrefillCurve(prompt_lens=lens, tokens_per_s=rates)

    def decode_curve(self, kv_tokens: int | None) -> pb.DecodeCurve:
        grid: list[float] = []
        points = [(c, b) for c in self.config.context_lens for b in self.config.batch_sizes]
        self._decode_itl_s(self.config.context_lens[0], 1)  # warm-up
        for i, (context, batch) in enumerate(points, 1):
            itl_s = self._decode_itl_s(context, batch)
            grid.append(itl_s * 1e3)
            self.progress(f"decode [{i}/{len(points)}] batch {batch} at context {context}: ITL {itl_s * 1e3:.2f} ms")
        width = len(self.config.batch_sizes)
        rows = [monotone(grid[r * width:(r + 1) * width]) for r in range(len(self.config.context_lens))]
        curve = pb.DecodeCurve(batch_sizes=self.config.batch_sizes, itl_ms=rows[-1],
                               context_lens=self.config.context_lens, itl_ms_grid=[x for row in rows for x in row])
        if kv_tokens is not None:
            curve.kv_tokens_per_worker = kv_tokens
        return curve

    # ---- one measurement -------------------------------------------------------------------
    def _prefill_s(self, num_tokens: int) -> float:
        tokens, salt = self._tokens(num_tokens), uuid.uuid4().hex
        params = pb.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        started = time.perf_counter()
        if self.role == "prefill":
            request = pb.PrefillRequest(request_id=f"profile-{salt}", token_ids=tokens, sampling=params,
                                        cache_salt=salt)
            reply = self.stub.Prefill(request, timeout=self.config.timeout_s)
            seconds = time.perf_counter() - started
            if reply.HasField("handle") and reply.handle.lease_id:
                self.stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=reply.handle.lease_id), timeout=10)
            return seconds
        for _ in self._decode_stream(tokens, salt, params):
            return time.perf_counter() - started
        raise RuntimeError("the worker ended the stream without a token")

    def _decode_itl_s(self, context: int, batch: int) -> float:
        arrivals: list[list[float]] = [[] for _ in range(batch)]
        errors: list[BaseException] = []
        params = pb.SamplingParams(temperature=0.0, max_tokens=self.config.decode_tokens + 1, ignore_eos=True)
        prompts = [self._tokens(context) for _ in range(batch)]

        def run(i: int) -> None:
            try:
                for reply in self._decode_stream(prompts[i], uuid.uuid4().hex, params):
                    arrivals[i].extend([time.perf_counter()] * len(reply.token_ids))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(batch)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.config.timeout_s)
        if errors:
            raise errors[0]
        return steady_itl_s(arrivals)

    def _decode_stream(self, tokens: list[int], salt: str, params: pb.SamplingParams):
        request = pb.DecodeRequest(request_id=f"profile-{salt}", token_ids=tokens, sampling=params, cache_salt=salt,
                                   prompt_len=len(tokens))
        return self.stub.Decode(request, timeout=self.config.timeout_s)

    def _tokens(self, n: int) -> list[int]:
        high = max(11, self.model.vocab_size - 1)
        return [self._random.randrange(10, high) for _ in range(n)]


def steady_itl_s(arrivals: list[list[float]]) -> float:
    """Inter-token latency once every stream has its first token: per stream, the time from its first token in
    that window to its last over the tokens between (the mean gap), the median over streams.

    Why not the median of single gaps: on a busy machine the worker's event loop falls behind its engine thread and
    flushes several tokens at once, so most single gaps are microseconds (0.03 ms was measured at a 1 ms step) and
    their median says nothing of the step; a stream's span over its tokens counts every step whatever the bunching.
    """
    if any(not times for times in arrivals):
        raise RuntimeError("a profiling stream returned no tokens")
    start = max(times[0] for times in arrivals)
    spans = [_mean_gap_s([t for t in times if t >= start]) for times in arrivals]
    spans = [s for s in spans if s is not None] or [s for times in arrivals if (s := _mean_gap_s(times)) is not None]
    if not spans:
        raise RuntimeError("profiling streams returned too few separate tokens to time")
    return statistics.median(spans)


def _mean_gap_s(times: list[float]) -> float | None:
    """(last - first) / gaps, None when the tokens span no time."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)


def monotone(values: list[float]) -> list[float]:
    """Running maximum: ITL never decreases with batch size."""
    out, top = [], 0.0
    for value in values:
        top = max(top, value)
        out.append(top)
    return out
