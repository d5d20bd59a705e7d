"""The engine's own speed, measured on its steps and reported with the worker's heartbeat.

The router prices every route with a prefill rate and a decode step time per worker (``router/routing/rates.py``).
It learns them from the timings it sees, but a new worker, or one the router has not used yet, would be
priced at a guess; so each engine keeps exponential moving averages of what its steps actually took and
the worker reports them (``WorkerLoad.prefill_tokens_per_s`` / ``decode_step_s``):

- a step that computed at least ``min_prefill_tokens`` prompt tokens is a prefill sample (with a small
  chunk budget that is the chunked rate, which is what local prefill on a decode worker gets):
  ``prompt tokens / step seconds`` (decodes riding along make it a slight under-estimate, as they should:
  the rate is what a new prompt will get);
- any other step with running decodes is a decode sample: its seconds, at the batch size it ran; the
  engine also fits ``step = base + per_seq x batch`` over those samples (EWMA moments), so the router
  learns how much one more sequence slows this worker's steps -- on a CPU that slope is most of the step.

One ``perf_counter`` pair and a pass over the step's sequences per step (the same pass the scheduler
already makes); nothing per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.outputs import SchedulerOutput


@dataclass(slots=True)
class StepRates:
    alpha: float = 0.1
    min_prefill_tokens: int = 8  # fewer: a decode step that happens to carry a few prompt tokens
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    decode_batch_size: float | None = None  # the mean batch the decode step time was measured at
    decode_step_per_seq_s: float | None = None  # fitted slope of step time over batch size (None: too little spread)
    _bb: float | None = None  # EWMA of batch^2 ...
    _by: float | None = None  # ... and of batch x step seconds

    def observe(self, output: SchedulerOutput, seconds: float) -> None:
        if seconds <= 0:
            return
        decodes = sum(1 for s in output.seqs if s.num_new_tokens == 1 and s.start >= s.request.num_prompt_tokens)
        prompt_tokens = output.num_batched_tokens - decodes
        if prompt_tokens >= self.min_prefill_tokens:
            self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s, prompt_tokens / seconds)
        elif decodes and not prompt_tokens:
            self.decode_step_s = self._ewma(self.decode_step_s, seconds)
            self.decode_batch_size = self._ewma(self.decode_batch_size, float(decodes))
            self._bb = self._ewma(self._bb, float(decodes * decodes))
            self._by = self._ewma(self._by, decodes * seconds)
            var = self._bb - self.decode_batch_size ** 2
            if var > 0.25:  # batch sizes varied enough to tell the slope
                slope = (self._by - self.decode_batch_size * self.decode_step_s) / var
                self.decode_step_per_seq_s = max(slope, 0.0)

    def seed(self, prefill_tokens_per_s: float, decode_step_s: float) -> None:
        """Start-up figures (``Engine.calibrate``: one prefill, one decode step at batch size 1), counted
        as first samples: the steps that follow move them."""
        if self.prefill_tokens_per_s is None and prefill_tokens_per_s > 0:
            self.prefill_tokens_per_s = prefill_tokens_per_s
        if self.decode_step_s is None and decode_step_s > 0:
            self.decode_step_s, self.decode_batch_size = decode_step_s, 1.0
            self._bb, self._by = 1.0, decode_step_s

    def _ewma(self, value: float | None, sample: float) -> float:
        return sample if value is None else value + self.alpha * (sample - value)
