"""Profiles for ``baton admin plan`` from the rates the workers measured at start, when no profile is stored.

Every worker times one prefill and one decode step before it registers (``Engine.calibrate``) and reports
the figures with its heartbeat (``WorkerLoad``). That is one point per curve, not a curve: the prefill rate is
taken as flat over prompt lengths, and decode ITL as ``base + per_seq x batch`` where the engine has seen
several batch sizes (``decode_step_per_seq_s``), else as flat up to the KV pool's limit. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer.workers import WorkerLoad
from router.admin.planner import DecodeProfile, PrefillProfile, Term

_LONGEST_PROMPT = 1 << 20
_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_NOTE = "no stored profile: the workers' start-up calibration (`baton admin profile` measures real curves)"


@dataclass(frozen=True, slots=True)
class Calibrated:
    prefill: PrefillProfile | None
    decode: DecodeProfile | None
    terms: tuple[Term, ...]


def from_calibration(loads: Sequence[tuple[str, WorkerLoad]], kv_tokens_per_decode_worker: int | None) -> Calibrated:
    """From (role, load) of the live workers: prefill workers' rates (decode workers' when there are none)."""
    prefill_rates = _rates(loads, "prefill") or _rates(loads, "decode")
    steps = [load for role, load in loads if role == "decode" and load.decode_step_s]
    prefill = _prefill(prefill_rates)
    decode = _decode(steps, kv_tokens_per_decode_worker)
    terms = []
    if prefill is not None:
        terms.append(Term(pool="prefill", name="calibrated rate", value=prefill.tokens_per_s[0], unit="tok/s",
                          note=f"mean of {len(prefill_rates)} workers; {_NOTE}"))
    if decode is not None:
        terms.append(Term(pool="decode", name="calibrated ITL at batch 1", value=decode.itl_s[0] * 1e3, unit="ms",
                          note=f"mean of {len(steps)} workers; {_NOTE}"))
    return Calibrated(prefill, decode, tuple(terms))


def _rates(loads: Sequence[tuple[str, WorkerLoad]], role: str) -> list[float]:
    return [load.prefill_tokens_per_s for r, load in loads if r == role and load.prefill_tokens_per_s]


def _prefill(rates: list[float]) -> PrefillProfile | None:
    if not rates:
        return None
    rate = sum(rates) / len(rates)
    return PrefillProfile(prompt_lens=(1, _LONGEST_PROMPT), tokens_per_s=(rate, rate))


def _decode(steps: list[WorkerLoad], kv_tokens: int | None) -> DecodeProfile | None:
    if not steps:
        return None
    per_seq = sum(max(load.decode_step_per_seq_s or 0.0, 0.0) for load in steps) / len(steps)
    base = sum(load.decode_step_s - per_seq * (load.decode_batch_size or 1.0) for load in steps) / len(steps)
    base = max(base, per_seq, 1e-6)  # a step never costs less than one sequence's share
    return DecodeProfile(batch_sizes=_BATCHES, itl_s=tuple(base + per_seq * batch for batch in _BATCHES),
                         kv_tokens_per_worker=kv_tokens)
