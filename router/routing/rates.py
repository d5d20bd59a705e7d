"""Online estimates of the rates the cost model prices with (DESIGN.md "Routing").

Pure logic: exponential moving averages fed from the timings the router already receives
(``PrefillResponse.timings.prefill_ms`` with the prompt's computed tokens, the decode worker's first
``transfer_bytes`` / ``transfer_ms``, decode tokens/s at the end). Until a worker has been measured, the
prefill rate it reports with its heartbeat (``WorkerLoad.prefill_tokens_per_s``) is used, and before
that a default. For decode steps the worker's report (``decode_step_s`` at ``decode_batch_size``) comes
first: the engine times its steps exactly, the router's view of a stream adds network jitter. A measurement older than ``stale_after_s`` (injected clock) stops counting.

Decode step time is modelled as ``base_s + per_seq_s * batch_size + per_kv_block_s * kv_blocks`` (the
batch's KV in use: attention reads all of it each step), fitted by EWMA least squares on (batch size, KV
blocks, step seconds) samples; a coefficient whose input barely varied keeps its default.

A fixed per-request overhead per route kind (RPC hops, tokenizing, handing work to the engine thread)
is learned as each measured TTFT minus the time the computing worker reported for the prompt (its queue
and compute): on a CPU with a tiny model it dominates (~20 ms measured vs ~1 ms of compute), on a GPU
with long prompts it is noise. It is what makes "remote vs local" honest on either. Measured values,
not the model's own predictions, so an error in a predicted rate is never learned as "overhead".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.workers import WorkerLoad


@dataclass(frozen=True, slots=True, kw_only=True)
class RatesConfig:
    prefill_tokens_per_s: float = 10_000.0  # a prefill worker's rate until measured or reported
    decode_prefill_factor: float = 0.5  # a decode worker's prefill rate relative to that (chunks share steps)
    decode_step_base_s: float = 0.010  # one decode step at batch size 0, until measured
    decode_step_per_seq_s: float = 0.0005  # added per running sequence
    decode_step_per_kv_block_s: float = 2e-6  # added per KV block the batch holds (attention reads it)
    remote_overhead_s: float = 0.005  # fixed cost of a remote prefill (two RPCs + the pull's setup), until learned
    local_overhead_s: float = 0.002  # fixed cost of a local prefill, until learned
    link_gb_per_s: float = 10.0  # P -> D KV pull bandwidth until measured
    # A pull this many times faster or slower than its pair's estimate, of at least ``link_change_min_bytes`` (a
    # small pull's rate is mostly its round trips), means the link itself changed (reshaped, congested, rerouted):
    # the sample replaces the estimate. Moved by ``alpha`` alone, the estimate of a link that became 10x slower
    # was still 3x too fast after 5 pulls, and the router kept pulling over it (docs/benchmarks.md, the link study).
    link_change_factor: float = 2.0
    link_change_min_bytes: int = 1 << 20
    alpha: float = 0.2  # EWMA weight of a new sample
    # a prefill of fewer computed tokens teaches no rate: its time is mostly the step's fixed cost
    # (launch, sampling, the engine hand-off), and tokens / time would price every prompt far too slow
    min_prefill_sample_tokens: int = 64
    stale_after_s: float | None = 600.0  # measurements older than this fall back to reports / defaults

    def __post_init__(self) -> None:
        positive = ("prefill_tokens_per_s", "decode_prefill_factor", "decode_step_base_s", "link_gb_per_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"RatesConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("decode_step_per_seq_s", "decode_step_per_kv_block_s", "remote_overhead_s", "local_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RatesConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"RatesConfig.alpha must be in (0, 1], got {self.alpha}")
        if not self.link_change_factor > 1:
            raise ValueError(f"RatesConfig.link_change_factor must be > 1, got {self.link_change_factor}")


class Ewma:
    """An exponential moving average; the first sample sets it."""

    __slots__ = ("alpha", "value", "updated_s")

    def __init__(self, alpha: float) -> None:
        self.alpha, self.value, self.updated_s = alpha, 0.0, float("-inf")

    def add(self, sample: float, now_s: float) -> None:
        first = self.updated_s == float("-inf")
        self.value = sample if first else self.value + self.alpha * (sample - self.value)
        self.updated_s = now_s

    def reset(self, sample: float, now_s: float) -> None:
        """Start over from ``sample`` (what was averaged no longer describes the thing measured)."""
        self.value, self.updated_s = sample, now_s


class StepFit:
    """``step_s = base_s + per_seq_s * batch + per_kv_block_s * kv_blocks`` by EWMA least squares."""

    __slots__ = ("_m", "default_per_seq_s", "default_per_kv_block_s")
    _NAMES = ("b", "k", "y", "bb", "kk", "bk", "by", "ky")

    def __init__(self, alpha: float, default_per_seq_s: float, default_per_kv_block_s: float = 0.0) -> None:
        self._m = {name: Ewma(alpha) for name in self._NAMES}  # first and second moments
        self.default_per_seq_s, self.default_per_kv_block_s = default_per_seq_s, default_per_kv_block_s

    def add(self, batch: int, step_s: float, now_s: float, kv_blocks: int = 0) -> None:
        b, k, y = float(batch), float(kv_blocks), step_s
        for name, sample in zip(self._NAMES, (b, k, y, b * b, k * k, b * k, b * y, k * y)):
            self._m[name].add(sample, now_s)

    @property
    def updated_s(self) -> float:
        return self._m["y"].updated_s

    def line(self) -> tuple[float, float, float]:
        """(base_s, per_seq_s, per_kv_block_s); a slope whose input barely varied (or that comes out
        negative) keeps its default, and the others are refitted around it."""
        m = {name: e.value for name, e in self._m.items()}
        var_b, var_k = m["bb"] - m["b"] ** 2, m["kk"] - m["k"] ** 2
        cov_bk, cov_by, cov_ky = m["bk"] - m["b"] * m["k"], m["by"] - m["b"] * m["y"], m["ky"] - m["k"] * m["y"]
        per_seq, per_block = self.default_per_seq_s, self.default_per_kv_block_s
        fit_b, fit_k = var_b > 0.25, var_k > 0.25
        det = var_b * var_k - cov_bk * cov_bk
        both = fit_b and fit_k and det > 1e-9 * var_b * var_k
        if both and (s := (cov_by * var_k - cov_ky * cov_bk) / det) >= 0 \
                and (k := (cov_ky * var_b - cov_by * cov_bk) / det) >= 0:
            per_seq, per_block = s, k
        elif fit_b:  # one slope at a time, the other at its default
            per_seq = max((cov_by - per_block * cov_bk) / var_b, 0.0)
        elif fit_k:
            per_block = max((cov_ky - per_seq * cov_bk) / var_k, 0.0)
        base = max(m["y"] - per_seq * m["b"] - per_block * m["k"], 0.0)
        return base, per_seq, per_block


class Rates:
    """Per-worker prefill rate and decode step line, per-pair link bandwidth; learned online."""

    def __init__(self, config: RatesConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or RatesConfig()
        self._clock = clock
        self._prefill: dict[str, Ewma] = {}  # prefill workers' measured rates
        self._local_prefill: dict[str, Ewma] = {}  # decode workers' (a prompt's chunks share steps with decodes)
        self._steps: dict[str, StepFit] = {}
        self._links: dict[tuple[str, str], Ewma] = {}
        self._kv_bytes_per_token = Ewma(self.config.alpha)
        self._overhead: dict[str, Ewma] = {}
        self._reported_base: dict[str, tuple[float, float]] = {}  # worker -> (its reported step base, when)
        self._reported_slope: dict[str, tuple[float, float]] = {}  # worker -> (its reported per-seq slope, when)

    # ---- updates, from measured timings -------------------------------------------------------
    def observe_prefill(self, worker_id: str, num_tokens: int, prefill_ms: float, *,
                        on_decode: bool = False) -> None:
        """A prefill of ``num_tokens`` computed (uncached) tokens took ``prefill_ms`` (``on_decode``: a decode
        worker's local prefill)."""
        if num_tokens >= max(self.config.min_prefill_sample_tokens, 1) and prefill_ms > 0:
            table = self._local_prefill if on_decode else self._prefill
            self._ewma(table, worker_id).add(num_tokens / (prefill_ms * 1e-3), self._clock())

    def observe_transfer(self, prefill_id: str, decode_id: str, num_bytes: int, transfer_ms: float,
                         num_tokens: int | None = None) -> None:
        """D pulled ``num_bytes`` (``num_tokens`` tokens' KV) from P in ``transfer_ms``."""
        if num_bytes <= 0 or transfer_ms <= 0:
            return
        now_s, gb_per_s = self._clock(), num_bytes / (transfer_ms * 1e-3) / 1e9
        link = self._ewma(self._links, (prefill_id, decode_id))
        if self._link_changed(link, gb_per_s, num_bytes):
            link.reset(gb_per_s, now_s)
        else:
            link.add(gb_per_s, now_s)
        if num_tokens:
            self._kv_bytes_per_token.add(num_bytes / num_tokens, now_s)

    def _link_changed(self, link: Ewma, gb_per_s: float, num_bytes: int) -> bool:
        """Start the pair's estimate over from this pull: its first, after it went stale, or a changed link."""
        c = self.config
        if not self._fresh(link.updated_s) or link.value <= 0:
            return True
        return num_bytes >= c.link_change_min_bytes and max(gb_per_s / link.value, link.value / gb_per_s) \
            > c.link_change_factor

    def observe_decode_step(self, worker_id: str, batch_size: int, step_s: float, kv_blocks: int = 0) -> None:
        """One decode step of ``batch_size`` sequences holding ``kv_blocks`` KV blocks took ``step_s``."""
        if step_s > 0 and batch_size >= 0 and kv_blocks >= 0:
            if worker_id not in self._steps:
                c = self.config
                self._steps[worker_id] = StepFit(c.alpha, c.decode_step_per_seq_s, c.decode_step_per_kv_block_s)
            self._steps[worker_id].add(batch_size, step_s, self._clock(), kv_blocks)

    def observe_decode(self, worker_id: str, batch_size: int, tokens_per_s: float, kv_blocks: int = 0) -> None:
        """A request decoded at ``tokens_per_s`` on a worker running ``batch_size`` sequences."""
        if tokens_per_s > 0:
            self.observe_decode_step(worker_id, batch_size, 1.0 / tokens_per_s, kv_blocks)

    def observe_ttft(self, kind: str, measured_s: float, prefill_s: float) -> None:
        """A ``kind`` ("remote"/"local") request's first token came ``measured_s`` after routing began, of
        which the worker that computed the prompt spent ``prefill_s`` (its queue and compute, measured):
        the rest is the route kind's fixed overhead."""
        if measured_s > 0 and prefill_s > 0:
            residual = min(max(measured_s - prefill_s, 0.0), 1.0)  # one outlier cannot swamp it
            self._ewma(self._overhead, kind).add(residual, self._clock())

    # ---- estimates ----------------------------------------------------------------------------
    def prefill_tokens_per_s(self, worker_id: str, load: WorkerLoad | None, *, on_decode: bool = False) -> float:
        """Measured, else reported, else the measured peers' mean (a decode worker: its measured decode peers',
        else the prefill workers' times ``decode_prefill_factor``), else the default. Peers first: the same
        model on the same kind of machine, where a default can be 10x off (a CPU) and would make an
        unmeasured worker look fast beside a measured one."""
        table = self._local_prefill if on_decode else self._prefill
        measured = table.get(worker_id)
        if measured is not None and self._fresh(measured.updated_s):
            return measured.value
        if load is not None and load.prefill_tokens_per_s:
            return load.prefill_tokens_per_s
        if peers := self._fresh_mean(table):
            return peers
        factor = self.config.decode_prefill_factor if on_decode else 1.0
        if on_decode and (prefill_peers := self._fresh_mean(self._prefill)):
            return prefill_peers * factor
        return self.config.prefill_tokens_per_s * factor

    def _fresh_mean(self, table: dict[str, Ewma]) -> float | None:
        values = [e.value for e in table.values() if self._fresh(e.updated_s)]
        return sum(values) / len(values) if values else None

    def decode_step_s(self, worker_id: str, load: WorkerLoad | None, batch_size: int, kv_blocks: int = 0,
                      *, total_blocks: int | None = None) -> float:
        """Predicted seconds of one decode step on the worker with ``batch_size`` running sequences
        holding ``kv_blocks`` KV blocks (``total_blocks``: the worker's, to read its reported usage).

        Sources, in order: the engine's own measured step (reported with the heartbeat: exact, and the
        same clock on every worker), moved to this batch and KV use along the slopes; for a worker that
        has not decoded yet, the mean of its peers' reports (a homogeneous pool: priced like its peers,
        never at a default that could keep it idle, and from the same source as they are); then the line
        this router fitted from the streams it relayed (workers that report nothing), its peers' fitted
        mean, and the configured default."""
        fit = self._steps.get(worker_id)
        fitted = fit is not None and self._fresh(fit.updated_s)
        per_seq_s, per_block_s = self.config.decode_step_per_seq_s, self.config.decode_step_per_kv_block_s
        if fitted:
            _, per_seq_s, per_block_s = fit.line()
        if load is not None and load.decode_step_s:
            if load.decode_step_per_seq_s is not None:  # the engine's own fit of its batch slope
                per_seq_s = load.decode_step_per_seq_s
                self._reported_slope[worker_id] = (per_seq_s, self._clock())
            measured_at = load.running if load.decode_batch_size is None else load.decode_batch_size
            used = max(total_blocks - load.free_blocks, 0) if total_blocks is not None else 0
            base_s = max(load.decode_step_s - per_seq_s * measured_at - per_block_s * used, 0.0)
            self._reported_base[worker_id] = (base_s, self._clock())
        elif reported := [b for b, at in self._reported_base.values() if self._fresh(at)]:
            base_s = sum(reported) / len(reported)
            if slopes := [k for k, at in self._reported_slope.values() if self._fresh(at)]:
                per_seq_s = sum(slopes) / len(slopes)
        elif fitted:
            base_s = fit.line()[0]
        elif peers := [f.line() for f in self._steps.values() if self._fresh(f.updated_s)]:
            base_s, per_seq_s, per_block_s = (sum(column) / len(peers) for column in zip(*peers))
        else:
            base_s = self.config.decode_step_base_s
        return base_s + per_seq_s * batch_size + per_block_s * kv_blocks

    def overhead_s(self, kind: str) -> float:
        """The fixed per-request cost of a ``kind`` route: learned; before that, the other kind's learned
        value shifted by the configured difference (both kinds share most of it: the router's own work,
        tokenizing, the engine hand-off); before either, the configured default."""
        defaults = {"remote": self.config.remote_overhead_s, "local": self.config.local_overhead_s}
        learned = self._overhead.get(kind)
        if learned is not None and self._fresh(learned.updated_s):
            return learned.value
        other = "local" if kind == "remote" else "remote"
        learned_other = self._overhead.get(other)
        if learned_other is not None and self._fresh(learned_other.updated_s):
            return max(learned_other.value + defaults.get(kind, 0.0) - defaults[other], 0.0)
        return defaults.get(kind, self.config.local_overhead_s)

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
