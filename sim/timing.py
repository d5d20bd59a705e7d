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
its batch. Pure: no I/O.
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
    """Steps priced from measured curves (``baton admin profile``): each chunk at the profiled prefill tokens/s
    of a prompt as long as its context + new tokens, plus the profiled ITL at the step's decode batch."""

    def __init__(self, prefill: PrefillProfile, decode: DecodeProfile) -> None:
        self.prefill, self.decode = prefill, decode

    def _parts(self, decode_seqs: int, chunks: Sequence[Chunk]) -> tuple[float, float]:
        prefill_s = sum(c.new / interpolate(self.prefill.prompt_lens, self.prefill.tokens_per_s, c.context + c.new)
                        for c in chunks)
        decode_s = interpolate(self.decode.batch_sizes, self.decode.itl_s, decode_seqs) if decode_seqs else 0.0
        return prefill_s, decode_s

    def step_s(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> float:
        return sum(self._parts(decode_seqs, chunks))

    def explain(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> dict[str, float | str]:
        prefill_s, decode_s = self._parts(decode_seqs, chunks)
        return {"prefill_curve_s": prefill_s, "decode_curve_s": decode_s, "step_s": prefill_s + decode_s}


def profiles_of(model: TimeModel, *, prompt_lens: Sequence[int], batch_sizes: Sequence[int], context: int,
                kv_tokens: int | None) -> tuple[PrefillProfile, DecodeProfile]:
    """What ``baton admin profile`` would measure on a modelled worker: prefill tokens/s per prompt length (one
    prompt alone, nothing cached) and ITL per batch size at ``context`` tokens each (the planner's inputs)."""
    rates = tuple(n / model.step_s(0, 0, [Chunk(n, 0)]) for n in prompt_lens)
    itls = tuple(model.step_s(b, b * context) for b in batch_sizes)
    return (PrefillProfile(prompt_lens=tuple(prompt_lens), tokens_per_s=rates),
            DecodeProfile(batch_sizes=tuple(batch_sizes), itl_s=itls, kv_tokens_per_worker=kv_tokens))
