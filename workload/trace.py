"""Mooncake-format request traces: read, scale, and turn into token ids (shared by the simulator and replays).

One JSON object per line (Mooncake's FAST'25 release, ``kvcache-ai/Mooncake`` ``FAST25-release/traces/``)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival in milliseconds from the trace's start; ``hash_ids`` name the prompt's
512-token blocks (the last one may be partial) such that equal ids at the same position are the same prefix.
No text is published: ``prompt_token_ids`` generates each block's tokens from its id alone (a counter-based
hash, no RNG state), so two requests that share ids share exactly those tokens, and a prefix cache keyed by
token blocks sees the trace's sharing.

Scaling to a smaller machine: ``length_scale`` divides every length, so one trace block becomes
``512 / length_scale`` tokens (32 makes it one 16-token KV block); ``time_scale`` multiplies the arrival times
(0.5 doubles the request rate). Figures made from a scaled trace say which factors they used. Pure: no I/O
but ``load_trace``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces
FIRST_TOKEN_ID = 4  # generated ids stay clear of the special tokens (workload/synthetic.py does the same)
_MASK64 = (1 << 64) - 1


class TraceError(ValueError):
    """A trace line that is not a Mooncake request (says which line and why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Scale:
    """How a trace is shrunk (or stretched) to a machine: lengths divided, arrival times multiplied."""

    length_scale: int = 1  # divides input and output lengths; must divide TRACE_BLOCK_TOKENS
    time_scale: float = 1.0  # multiplies arrival times (< 1: a higher request rate)

    def __post_init__(self) -> None:
        if self.length_scale < 1 or TRACE_BLOCK_TOKENS % self.length_scale:
            raise ValueError(f"length_scale must divide {TRACE_BLOCK_TOKENS}, got {self.length_scale}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be a positive number, got {self.time_scale}")

    @property
    def block_tokens(self) -> int:
        """Tokens per trace block after scaling."""
        return TRACE_BLOCK_TOKENS // self.length_scale

    def arrival_s(self, request: TraceRequest) -> float:
        return request.timestamp_ms * 1e-3 * self.time_scale

    def input_tokens(self, request: TraceRequest) -> int:
        """ceil, so the scaled prompt still spans exactly ``len(hash_ids)`` blocks."""
        return -(-request.input_length // self.length_scale)

    def output_tokens(self, request: TraceRequest) -> int:
        return max(1, -(-request.output_length // self.length_scale))


def parse_request(line: str, where: str = "trace") -> TraceRequest:
    try:
        doc = json.loads(line)
        request = TraceRequest(timestamp_ms=int(doc["timestamp"]), input_length=int(doc["input_length"]),
                               output_length=int(doc["output_length"]),
                               hash_ids=tuple(int(x) for x in doc["hash_ids"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"{where}: not a Mooncake trace request ({exc})") from exc
    if request.timestamp_ms < 0 or request.input_length < 1 or request.output_length < 0:
        raise TraceError(f"{where}: timestamp, input_length, output_length must be >= 0, >= 1, >= 0")
    expected = -(-request.input_length // TRACE_BLOCK_TOKENS)
    if len(request.hash_ids) != expected:
        raise TraceError(f"{where}: {request.input_length} input tokens need {expected} hash ids of "
                         f"{TRACE_BLOCK_TOKENS} tokens, got {len(request.hash_ids)}")
    return request


def parse_trace(lines: Iterable[str], *, name: str = "trace", limit: int | None = None) -> list[TraceRequest]:
    """Requests in arrival order (a trace out of order is sorted, stably); blank lines are skipped."""
    out: list[TraceRequest] = []
    for number, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if line.strip():
            out.append(parse_request(line, f"{name}:{number}"))
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def load_trace(path: Path, *, limit: int | None = None) -> list[TraceRequest]:
    with open(path, encoding="utf-8") as lines:
        return parse_trace(lines, name=str(path), limit=limit)


def block_token_ids(hash_id: int, num_tokens: int, vocab_size: int) -> np.ndarray:
    """The tokens of trace block ``hash_id`` (its first ``num_tokens``): ``splitmix64(hash_id, position)``
    reduced into ``[FIRST_TOKEN_ID, vocab_size)``. Deterministic on every platform; a partial block is a
    prefix of the full one."""
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
    with np.errstate(over="ignore"):
        x = (np.uint64((hash_id * 0x1_0000_0001) & _MASK64)
             + np.arange(num_tokens, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab_size - FIRST_TOKEN_ID)).astype(np.int64) + FIRST_TOKEN_ID  # [num_tokens]


def block_spans(request: TraceRequest, scale: Scale) -> list[tuple[int, int]]:
    """(hash id, tokens of it in the scaled prompt) per block: full blocks, then the partial last one."""
    total, size = scale.input_tokens(request), scale.block_tokens
    return [(hash_id, min(size, total - i * size)) for i, hash_id in enumerate(request.hash_ids)]


def prompt_token_ids(request: TraceRequest, scale: Scale, vocab_size: int) -> list[int]:
    """The scaled prompt's token ids, block by block."""
    parts = [block_token_ids(hash_id, n, vocab_size) for hash_id, n in block_spans(request, scale)]
    return np.concatenate(parts).tolist() if parts else []
