"""A worker's profiled curves as the planner takes them (pure): prefill tokens/s per prompt length, decode ITL per
batch size (``baton admin profile`` measures both), and the piecewise-linear reading of them."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from engine.errors import InvalidRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillProfile:
    """Prefill throughput of one worker (tokens/s) at each profiled prompt length (increasing)."""

    prompt_lens: tuple[int, ...]
    tokens_per_s: tuple[float, ...]

    def __post_init__(self) -> None:
        _check_curve("prefill", self.prompt_lens, self.tokens_per_s)

    def service_time_s(self, isl: float) -> float:
        return isl / interpolate(self.prompt_lens, self.tokens_per_s, isl)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeProfile:
    """Inter-token latency (s) of one worker at each profiled batch size (increasing)."""

    batch_sizes: tuple[int, ...]
    itl_s: tuple[float, ...]
    kv_tokens_per_worker: int | None = None  # caps the batch at kv_tokens / (isl + osl) when known

    def __post_init__(self) -> None:
        _check_curve("decode", self.batch_sizes, self.itl_s)
        if any(nxt < cur for cur, nxt in zip(self.itl_s, self.itl_s[1:])):
            raise InvalidRequest("decode profile: itl must not decrease with batch size")


def itl_row_at_context(context_lens: tuple[int, ...], grid: tuple[float, ...], num_batches: int,
                      context: float) -> tuple[float, ...]:
    """One ITL per batch size at ``context`` tokens from a [context x batch] grid (linear, flat beyond)."""
    if not context_lens or len(grid) != len(context_lens) * num_batches:
        raise InvalidRequest(f"decode profile: itl grid needs {len(context_lens)} x {num_batches} values, "
                             f"got {len(grid)}")
    if any(b <= a for a, b in zip(context_lens, context_lens[1:])):
        raise InvalidRequest(f"decode profile: context lengths must increase, got {list(context_lens)}")
    columns = [tuple(grid[r * num_batches + j] for r in range(len(context_lens))) for j in range(num_batches)]
    return tuple(interpolate(context_lens, column, context) for column in columns)


def interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear y(x), flat beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def _check_curve(name: str, xs: tuple[int, ...], ys: tuple[float, ...]) -> None:
    if not xs or len(xs) != len(ys):
        raise InvalidRequest(f"{name} profile: need matching, non-empty points, got {len(xs)} and {len(ys)}")
    if any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] <= 0:
        raise InvalidRequest(f"{name} profile: x values must be positive and increasing, got {list(xs)}")
    if any(not (y > 0 and math.isfinite(y)) for y in ys):
        raise InvalidRequest(f"{name} profile: values must be positive and finite, got {list(ys)}")
