"""Online estimates of the rates the cost model prices with (DESIGN.md "Routing").

Pure logic: exponential moving averages fed from the timings the router already receives
(``PrefillResponse.timings.prefill_ms`` with the prompt's computed tokens, the decode worker's first
``transfer_bytes`` / ``transfer_ms``, decode tokens/s at the end). Until a worker has been measured, the
figure it reports with its heartbeat (``WorkerLoad.prefill_tokens_per_s`` / ``decode_step_s``) is used,
and before that a default. A measurement older than ``stale_after_s`` (injected clock) stops counting.

Decode step time is modelled as ``base_s + per_seq_s * batch_size``, fitted by EWMA least squares on
(batch size, step seconds) pairs; with too little spread in batch sizes the default slope is kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.registry import WorkerLoad


@dataclass(frozen=True, slots=True, kw_only=True)
class RatesConfig:
    prefill_tokens_per_s: float = 10_000.0  # a prefill worker's rate until measured or reported
    decode_prefill_factor: float = 0.5  # a decode worker's prefill rate relative to that (chunks share steps)
    decode_step_base_s: float = 0.010  # one decode step at batch size 0, until measured
    decode_step_per_seq_s: float = 0.0005  # added per running sequence
    link_gb_per_s: float = 10.0  # P -> D KV pull bandwidth until measured
    alpha: float = 0.2  # EWMA weight of a new sample
    stale_after_s: float | None = 600.0  # measurements older than this fall back to reports / defaults

    def __post_init__(self) -> None:
        positive = ("prefill_tokens_per_s", "decode_prefill_factor", "decode_step_base_s", "link_gb_per_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"RatesConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.decode_step_per_seq_s < 0:
            raise ValueError(f"RatesConfig.decode_step_per_seq_s must be >= 0, got {self.decode_step_per_seq_s}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"RatesConfig.alpha must be in (0, 1], got {self.alpha}")


class Ewma:
    """An exponential moving average; the first sample sets it."""

    __slots__ = ("alpha", "value", "updated_s")

    def __init__(self, alpha: float) -> None:
        self.alpha, self.value, self.updated_s = alpha, 0.0, float("-inf")

    def add(self, sample: float, now_s: float) -> None:
        first = self.updated_s == float("-inf")
        self.value = sample if first else self.value + self.alpha * (sample - self.value)
        self.updated_s = now_s


class StepFit:
    """``step_s = base_s + per_seq_s * batch`` by EWMA least squares over (batch, step_s) samples."""

    __slots__ = ("_x", "_y", "_xx", "_xy", "default_per_seq_s")

    def __init__(self, alpha: float, default_per_seq_s: float) -> None:
        self._x, self._y, self._xx, self._xy = (Ewma(alpha) for _ in range(4))
        self.default_per_seq_s = default_per_seq_s

    def add(self, batch: int, step_s: float, now_s: float) -> None:
        for moment, sample in ((self._x, batch), (self._y, step_s), (self._xx, batch * batch),
                               (self._xy, batch * step_s)):
            moment.add(float(sample), now_s)

    @property
    def updated_s(self) -> float:
        return self._y.updated_s

    def line(self) -> tuple[float, float]:
        """(base_s, per_seq_s); the default slope while batch sizes barely varied, never a negative one."""
        mean_x, mean_y = self._x.value, self._y.value
        var_x = self._xx.value - mean_x * mean_x
        slope = (self._xy.value - mean_x * mean_y) / var_x if var_x > 0.25 else self.default_per_seq_s
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope


class Rates:
    """Per-worker prefill rate and decode step line, per-pair link bandwidth; learned online."""

    def __init__(self, config: RatesConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or RatesConfig()
        self._clock = clock
        self._prefill: dict[str, Ewma] = {}
        self._steps: dict[str, StepFit] = {}
        self._links: dict[tuple[str, str], Ewma] = {}
        self._kv_bytes_per_token = Ewma(self.config.alpha)

    # ---- updates, from measured timings -------------------------------------------------------
    def observe_prefill(self, worker_id: str, num_tokens: int, prefill_ms: float) -> None:
        """A prefill of ``num_tokens`` computed (uncached) tokens took ``prefill_ms``."""
        if num_tokens > 0 and prefill_ms > 0:
            self._ewma(self._prefill, worker_id).add(num_tokens / (prefill_ms * 1e-3), self._clock())

    def observe_transfer(self, prefill_id: str, decode_id: str, num_bytes: int, transfer_ms: float,
                         num_tokens: int | None = None) -> None:
        """D pulled ``num_bytes`` (``num_tokens`` tokens' KV) from P in ``transfer_ms``."""
        if num_bytes <= 0 or transfer_ms <= 0:
            return
        now_s = self._clock()
        self._ewma(self._links, (prefill_id, decode_id)).add(num_bytes / (transfer_ms * 1e-3) / 1e9, now_s)
        if num_tokens:
            self._kv_bytes_per_token.add(num_bytes / num_tokens, now_s)

    def observe_decode_step(self, worker_id: str, batch_size: int, step_s: float) -> None:
        if step_s > 0 and batch_size >= 0:
            fit = self._steps.setdefault(worker_id, StepFit(self.config.alpha, self.config.decode_step_per_seq_s))
            fit.add(batch_size, step_s, self._clock())

    def observe_decode(self, worker_id: str, batch_size: int, tokens_per_s: float) -> None:
        """A request decoded at ``tokens_per_s`` on a worker running ``batch_size`` sequences."""
        if tokens_per_s > 0:
            self.observe_decode_step(worker_id, batch_size, 1.0 / tokens_per_s)

    # ---- estimates ----------------------------------------------------------------------------
    def prefill_tokens_per_s(self, worker_id: str, load: WorkerLoad | None, *, on_decode: bool = False) -> float:
        measured = self._prefill.get(worker_id)
        if measured is not None and self._fresh(measured.updated_s):
            return measured.value
        if load is not None and load.prefill_tokens_per_s:
            return load.prefill_tokens_per_s
        factor = self.config.decode_prefill_factor if on_decode else 1.0
        return self.config.prefill_tokens_per_s * factor

    def decode_step_s(self, worker_id: str, load: WorkerLoad | None, batch_size: int) -> float:
        """Predicted seconds of one decode step on the worker with ``batch_size`` running sequences."""
        fit = self._steps.get(worker_id)
        if fit is not None and self._fresh(fit.updated_s):
            base_s, per_seq_s = fit.line()
            return base_s + per_seq_s * batch_size
        per_seq_s = self.config.decode_step_per_seq_s
        if load is not None and load.decode_step_s:  # reported at the worker's current batch size
            base_s = max(load.decode_step_s - per_seq_s * load.running, 0.0)
            return base_s + per_seq_s * batch_size
        return self.config.decode_step_base_s + per_seq_s * batch_size

    def link_gb_per_s(self, prefill_id: str, decode_id: str) -> float:
        measured = self._links.get((prefill_id, decode_id))
        if measured is not None and self._fresh(measured.updated_s):
            return measured.value
        return self.config.link_gb_per_s

    def kv_bytes_per_token(self, default: float) -> float:
        """Measured KV bytes per transferred token, else ``default`` (from the worker's layout)."""
        measured = self._kv_bytes_per_token
        return measured.value if self._fresh(measured.updated_s) else default

    def _fresh(self, updated_s: float) -> bool:
        if updated_s == float("-inf"):
            return False
        stale = self.config.stale_after_s
        return stale is None or self._clock() - updated_s <= stale

    def _ewma(self, table: dict, key: object) -> Ewma:
        if key not in table:
            table[key] = Ewma(self.config.alpha)
        return table[key]
