"""What a modelled worker reports of its own speed with each heartbeat: the figures ``engine/step_rates.py``
keeps on a real engine (its input is the real scheduler's step, so it is mirrored here, not called):
EWMAs of prompt tokens per second over steps that computed prompt tokens, of decode step seconds and batch size
over decode-only steps, and the fitted slope of step time over batch size. ``seed`` is ``Engine.calibrate``:
one prefill and one decode step before the worker registers. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.workers import WorkerLoad


@dataclass(slots=True)
class SelfReport:
    alpha: float = 0.1
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    decode_batch_size: float | None = None
    decode_step_per_seq_s: float | None = None
    _bb: float | None = None
    _by: float | None = None

    def seed(self, prefill_tokens_per_s: float, decode_step_s: float) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_step_s, self.decode_batch_size = decode_step_s, 1.0
        self._bb, self._by = 1.0, decode_step_s

    def prefill_step(self, prompt_tokens: int, step_s: float) -> None:
        if prompt_tokens > 0 and step_s > 0:
            self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s, prompt_tokens / step_s, 1)

    def decode_steps(self, batch: int, step_s: float, steps: int) -> None:
        """``steps`` decode-only steps of ``batch`` sequences, each ``step_s`` long (as many EWMA updates)."""
        if batch < 1 or steps < 1 or step_s <= 0:
            return
        self.decode_step_s = self._ewma(self.decode_step_s, step_s, steps)
        self.decode_batch_size = self._ewma(self.decode_batch_size, float(batch), steps)
        self._bb = self._ewma(self._bb, float(batch * batch), steps)
        self._by = self._ewma(self._by, batch * step_s, steps)
        var = self._bb - self.decode_batch_size ** 2
        if var > 0.25:
            self.decode_step_per_seq_s = max((self._by - self.decode_batch_size * self.decode_step_s) / var, 0.0)

    def load(self, *, running: int, waiting: int, free_blocks: int, queued_prefill_tokens: int) -> WorkerLoad:
        return WorkerLoad(running=running, waiting=waiting, free_blocks=free_blocks,
                          queued_prefill_tokens=max(queued_prefill_tokens, 0),
                          prefill_tokens_per_s=self.prefill_tokens_per_s, decode_step_s=self.decode_step_s,
                          decode_batch_size=self.decode_batch_size, decode_step_per_seq_s=self.decode_step_per_seq_s)

    def _ewma(self, value: float | None, sample: float, times: int) -> float:
        """``times`` updates with the same sample at once."""
        if value is None:
            return sample
        return value + (1.0 - (1.0 - self.alpha) ** times) * (sample - value)
