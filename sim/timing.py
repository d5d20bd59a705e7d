"""How long one engine step takes on a modelled worker: a roofline, or measured curves (the calibration hook).

A step computes some prompt chunks (``new`` tokens each, over ``context`` tokens already in the KV cache) and
one token for each of ``decode_seqs`` running sequences holding ``decode_context`` KV tokens in all. On a
roofline the step takes ``max(compute_s, memory_s) + overhead_s``:

    flops    = 2 * P_layers * (decode_seqs + sum new)                      (the layers' matmuls per token)
             + 4 * L * H * d * (decode_context + sum new * (context + (new + 1) / 2))   (QK^T and PV, causal)
             + 2 * vocab * hidden * (decode_seqs + sampled chunks)          (the LM head, sampled rows only)
    bytes    = weight_bytes (every weight read once per step)
             + kv_bytes_per_token * (decode_context + decode_seqs + sum (context + new))   (KV read and written)
    compute_s = flops / (peak FLOP/s * tp * efficiency.compute); memory_s = bytes / (HBM B/s * tp * efficiency.memory)

Prefill is compute-bound (FLOPs), decode memory-bound (weights + KV bytes); the roofline says which per step.
``Efficiency`` holds the knobs a calibration fits (MFU, achieved bandwidth, per-step overhead). Alternatively
``CurveTimeModel`` interpolates the curves ``baton admin profile`` measures (the planner's ``PrefillProfile`` /
``DecodeProfile``): a prompt chunk at the profiled tokens/s of its length, a decode step at the profiled ITL of
its batch, a step's fixed cost paid once (fitted from the prefill curve). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.admin.planner import DecodeProfile, PrefillProfile, interpolate
from sim.hardware import GpuSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class Chunk:
    """Prompt tokens computed in one step: ``new`` of them after ``context`` already cached; ``samples``: the
    prompt's last chunk (its first output token is sampled, so it pays one LM-head row)."""

    new: int
    context: int
    samples: bool = True


class TimeModel(Protocol):
    def step_s(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> float: ...

    def explain(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> dict[str, float | str]:
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    compute: float = 0.6  # achieved / peak tensor FLOP/s (MFU) of a prefill-sized step
    memory: float = 0.8  # achieved / peak HBM bandwidth
    step_overhead_s: float = 0.001  # per step: scheduling, launches, sampling's host sync

    def __post_init__(self) -> None:
        if not (0 < self.compute <= 1 and 0 < self.memory <= 1 and self.step_overhead_s >= 0):
            raise ValueError(f"Efficiency: compute and memory in (0, 1], step_overhead_s >= 0: {self}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTerms:
    flops: float
    compute_s: float
    num_bytes: float
    memory_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


class Roofline:
    """The roofline above for ``tp`` GPUs of ``gpu`` serving ``model``."""

    def __init__(self, gpu: GpuSpec, model: ModelSpec, *, tp: int = 1, kv_bytes_per_token: float,
                 efficiency: Efficiency = Efficiency()) -> None:
        self.gpu, self.model, self.tp, self.efficiency = gpu, model, tp, efficiency
        self.kv_bytes_per_token = kv_bytes_per_token
        self.flops_per_s = gpu.bf16_tflops * 1e12 * tp * efficiency.compute
        self.bytes_per_s = gpu.hbm_tb_per_s * 1e12 * tp * efficiency.memory
        m = model
        self._linear_flops = 2.0 * m.num_layers * m.layer_params  # per token through the layers
        self._attention_flops = 4.0 * m.num_layers * m.num_heads * m.head_dim  # per (query, key) pair
        self._head_flops = 2.0 * m.lm_head_params  # per sampled row
        self._weight_bytes = float((m.num_layers * m.layer_params + m.lm_head_params) * m.dtype_bytes)

    def terms(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> StepTerms:
        new = sum(c.new for c in chunks)
        pairs = decode_context + sum(c.new * (c.context + (c.new + 1) / 2) for c in chunks)
        sampled = decode_seqs + sum(c.samples for c in chunks)
        flops = self._linear_flops * (decode_seqs + new) + self._attention_flops * pairs + self._head_flops * sampled
        kv_tokens = decode_context + decode_seqs + sum(c.context + c.new for c in chunks)
        num_bytes = self._weight_bytes + self.kv_bytes_per_token * kv_tokens
        return StepTerms(flops=flops, compute_s=flops / self.flops_per_s, num_bytes=num_bytes,
                         memory_s=num_bytes / self.bytes_per_s, overhead_s=self.efficiency.step_overhead_s)

    def step_s(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> float:
        return self.terms(decode_seqs, decode_context, chunks).total_s

    def explain(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> dict[str, float | str]:
        t = self.terms(decode_seqs, decode_context, chunks)
        return {"flops": t.flops, "compute_s": t.compute_s, "bytes": t.num_bytes, "memory_s": t.memory_s,
                "overhead_s": t.overhead_s, "bound": t.bound, "step_s": t.total_s}


class CurveTimeModel:
    """Steps priced from measured curves (``baton admin profile``): each chunk at the profiled prefill time of a
    prompt as long as its context + new tokens (its share: new / (context + new)), plus the profiled ITL at the
    step's decode batch.

    Each profiled point is a step of its own, so it holds one step's fixed cost (scheduling, the forward's launch,
    sampling's sync; on CPU a few ms of Python). ``overhead_s`` is that cost: taken out of every chunk's share and
    paid once per step (in a step with a decode batch the ITL already holds it), so a step of several prompts does
    not pay it once per prompt. ``fit_step_overhead_s`` fits it from the prefill curve; 0 prices each chunk at its
    curve's rate as is."""

    def __init__(self, prefill: PrefillProfile, decode: DecodeProfile, *, overhead_s: float = 0.0) -> None:
        if overhead_s < 0:
            raise ValueError(f"overhead_s must be >= 0, got {overhead_s}")
        self.prefill, self.decode, self.overhead_s = prefill, decode, overhead_s

    def _parts(self, decode_seqs: int, chunks: Sequence[Chunk]) -> tuple[float, float, float]:
        prefill_s = 0.0
        for c in chunks:
            n = c.context + c.new
            alone_s = n / interpolate(self.prefill.prompt_lens, self.prefill.tokens_per_s, n)
            prefill_s += max(alone_s - self.overhead_s, 0.0) * c.new / n
        decode_s = interpolate(self.decode.batch_sizes, self.decode.itl_s, decode_seqs) if decode_seqs else 0.0
        overhead_s = self.overhead_s if chunks and not decode_seqs else 0.0
        return prefill_s, decode_s, overhead_s

    def step_s(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> float:
        return sum(self._parts(decode_seqs, chunks))

    def explain(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> dict[str, float | str]:
        prefill_s, decode_s, overhead_s = self._parts(decode_seqs, chunks)
        return {"prefill_curve_s": prefill_s, "decode_curve_s": decode_s, "overhead_s": overhead_s,
                "step_s": prefill_s + decode_s + overhead_s}


def fit_step_overhead_s(prefill: PrefillProfile) -> float:
    """The fixed cost of a prefill step: the intercept of ``t(n) = a + b n + c n^2`` fitted to the curve's points
    (``t = n / tokens_per_s``; least squares on relative error, so the short prompts, where the intercept shows,
    weigh as much as the long ones), kept within [0, the shortest point's time]. Fewer than 3 points: 0."""
    lens = [float(n) for n in prefill.prompt_lens]
    if len(lens) < 3:
        return 0.0
    times = [n / r for n, r in zip(lens, prefill.tokens_per_s)]
    rows = [[1.0 / t, n / t, n * n / t] for n, t in zip(lens, times)]  # each row / t: relative error
    a = _least_squares(rows, [1.0] * len(rows))[0]
    return min(max(a, 0.0), min(times))


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """x minimizing |A x - y| through the normal equations (3 unknowns, solved by Cramer's rule)."""
    k = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    det = _det3(ata)
    if abs(det) < 1e-300:
        return [0.0] * k
    return [_det3([[aty[r] if c == i else ata[r][c] for c in range(k)] for r in range(k)]) / det for i in range(k)]


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def profiles_of(model: TimeModel, *, prompt_lens: Sequence[int], batch_sizes: Sequence[int], context: int,
                kv_tokens: int | None) -> tuple[PrefillProfile, DecodeProfile]:
    """What ``baton admin profile`` would measure on a modelled worker: prefill tokens/s per prompt length (one
    prompt alone, nothing cached) and ITL per batch size at ``context`` tokens each (the planner's inputs)."""
    rates = tuple(n / model.step_s(0, 0, [Chunk(n, 0)]) for n in prompt_lens)
    itls = tuple(model.step_s(b, b * context) for b in batch_sizes)
    return (PrefillProfile(prompt_lens=tuple(prompt_lens), tokens_per_s=rates),
            DecodeProfile(batch_sizes=tuple(batch_sizes), itl_s=itls, kv_tokens_per_worker=kv_tokens))
