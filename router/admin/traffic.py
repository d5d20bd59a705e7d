"""What the router served lately, from its own Prometheus histograms, and the planner's correction factors.

The smallest honest mechanism: the router already records every finished request's TTFT, inter-token gaps,
prompt and output tokens in cumulative histograms (``router.metrics``). ``TrafficRecorder`` keeps
timestamped copies of them (one every ``period_s``, taken when asked) and a window is the difference between
now and the newest copy at least ``window_s`` old — or the router's start, when it is younger; the window
reports the span it actually covers. Percentiles interpolate inside buckets the way PromQL's
``histogram_quantile`` does, so they match the dashboards (and share their bucket resolution).

The rate is the requests that *arrived* in the window (``baton:requests_received_total``, counted before the
admission limit: a refused request is demand too), not the ones that finished: under overload fewer finish than
arrive, which is exactly when the planner must not read less traffic.

The prefill pool's own traffic (``Window.remote``, the planner's ``Traffic.remote``) comes from two more series:
the prompt tokens of each request prefilled on a prefill worker (``baton:remote_prefill_prompt_tokens``: its count
the remote requests, its buckets their mix) and the tokens of those the prefill worker found cached
(``baton:remote_prefill_cached_tokens_total``). Its rate is the arrival rate times the remote share of the requests
that finished in the window (the remote count over the span when arrivals are not counted). A registry without
them (an older router): ``remote`` is None and the planner prices every request at full length, as before.

The window also gives the prompt lengths' spread (``isl_mix``: each non-empty bucket of the prompt-token
histogram at its geometric middle, scaled so the mix's mean is the exact mean), which the planner's queue model
needs (a mix of long and short prompts waits longer than prompts all of the mean length).

Corrections (measured / predicted, ``1.0`` when there is too little data): prefill compares the measured
TTFT p90 with the queue model's prediction (the router's dispatch) for the current prefill pool at the prefill
pool's observed rate, prompt mix and cached share, the same traffic the planner then sizes for; decode
compares the measured ITL p90 with the profile's ITL at the batch each decode worker runs by Little's law
(``rate * osl * measured ITL p50 / workers``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from router.admin import planner
from router.admin.queueing import Dispatch

MIN_REQUESTS = 5  # fewer finished requests in the window: no correction
MIN_GAPS = 20  # fewer inter-token gaps: no decode correction
ARRIVALS = "baton:requests_received"  # the counter's family name (prometheus_client drops "_total")
REMOTE_CACHED = "baton:remote_prefill_cached_tokens"  # likewise
_SERIES = {"ttft": "baton:time_to_first_token_seconds", "itl": "baton:inter_token_latency_seconds",
           "isl": "baton:request_prompt_tokens", "osl": "baton:request_generation_tokens",
           "remote_isl": "baton:remote_prefill_prompt_tokens"}


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative Prometheus histogram: upper bounds (the last is inf) and cumulative counts."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float  # sum of observations

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def minus(self, old: Histogram) -> Histogram:
        if old.bounds != self.bounds:
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.cumulative, old.cumulative)),
                         self.total - old.total)

    def quantile(self, q: float) -> float | None:
        """PromQL ``histogram_quantile``: linear inside the bucket; the last finite bound past it."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = bound, cumulative
        return lower


@dataclass(frozen=True, slots=True)
class Snapshot:
    at_s: float
    series: dict[str, Histogram]  # keys of _SERIES (no bounds: the registry has no such series)
    arrived: float | None = None  # requests taken in so far (``baton:requests_received_total``; None: no counter)
    remote_cached: float | None = None  # cached tokens of remote prefills so far (None: no counter)


@dataclass(frozen=True, slots=True, kw_only=True)
class Percentiles:
    count: int
    p50_s: float
    p90_s: float
    p99_s: float
    mean_s: float | None = None  # the histogram's exact mean (sum / count)


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    span_s: float
    num_requests: int
    rate_per_s: float
    mean_isl: float | None
    mean_osl: float | None
    ttft: Percentiles | None
    itl: Percentiles | None
    isl_mix: tuple[tuple[float, float], ...] = ()  # (prompt tokens, share of requests): the planner's Traffic.isl_mix
    num_arrived: int | None = None  # requests taken in during the window (``rate_per_s`` is theirs); None: unknown
    remote: planner.RemotePrefill | None = None  # the prefill pool's traffic; None: the registry does not measure it
    num_remote: int | None = None  # requests prefilled on a prefill worker in the window; None: not measured


def read_histograms(registry) -> dict[str, Histogram]:
    """The request histograms of a ``prometheus_client`` registry (empty ones, without bounds, when absent)."""
    rows: dict[str, list[tuple[float, float]]] = {key: [] for key in _SERIES}
    sums: dict[str, float] = {key: 0.0 for key in _SERIES}
    names = {name: key for key, name in _SERIES.items()}
    for family in registry.collect():
        key = names.get(family.name)
        for sample in family.samples if key else ():
            if sample.name.endswith("_bucket"):
                rows[key].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                sums[key] = sample.value
    return {key: Histogram(tuple(b for b, _ in sorted(r)), tuple(c for _, c in sorted(r)), sums[key])
            for key, r in rows.items()}


def read_counter(registry, name: str) -> float | None:
    """The counter ``name`` (its family name, without ``_total``) of a ``prometheus_client`` registry (None when it
    has none)."""
    for family in registry.collect():
        if family.name == name:
            return sum(s.value for s in family.samples if s.name == name + "_total")
    return None


def read_snapshot(registry, at_s: float) -> Snapshot:
    return Snapshot(at_s, read_histograms(registry), read_counter(registry, ARRIVALS),
                    read_counter(registry, REMOTE_CACHED))


def window_between(new: Snapshot, old: Snapshot) -> Window:
    """The requests that finished in the window give the means and percentiles; the rate is the requests that
    arrived in it (under overload fewer finish than arrive, and the planner must size for what arrives); a
    registry without the arrivals counter: the finished ones."""
    delta = {key: new.series[key].minus(old.series[key]) for key in _SERIES}
    span_s = max(new.at_s - old.at_s, 1e-9)
    requests = delta["isl"].count
    arrived = None if new.arrived is None else new.arrived - (old.arrived or 0.0)
    mean = lambda h: h.total / h.count if h.count > 0 else None  # noqa: E731
    rate_per_s = (requests if arrived is None else arrived) / span_s
    window = Window(span_s=span_s, num_requests=int(requests), rate_per_s=rate_per_s,
                    mean_isl=mean(delta["isl"]), mean_osl=mean(delta["osl"]),
                    ttft=_percentiles(delta["ttft"]), itl=_percentiles(delta["itl"]), isl_mix=isl_mix_of(delta["isl"]),
                    num_arrived=None if arrived is None else int(arrived))
    if not new.series["remote_isl"].bounds or new.remote_cached is None:
        return window  # an older router: no remote-prefill series, every request priced at full length
    return with_remote(window, delta["remote_isl"], new.remote_cached - (old.remote_cached or 0.0))


def with_remote(window: Window, prompts: Histogram, cached_tokens: float) -> Window:
    """``window`` with the prefill pool's traffic: ``prompts`` the prompt tokens of the requests prefilled on a
    prefill worker in it, ``cached_tokens`` those found cached there. Its rate: the window's (arrival) rate times
    the remote share of the requests that finished; the remote count over the span when arrivals are not counted.
    No remote request: rate 0, every prompt at the window's mean."""
    finished, remote = window.num_requests, prompts.count
    share = min(remote / finished, 1.0) if finished > 0 else 1.0
    rate = window.rate_per_s * share if window.num_arrived is not None and finished > 0 else remote / window.span_s
    if remote <= 0 or prompts.total <= 0:
        pool = planner.RemotePrefill(rate_per_s=rate, mean_isl=max(window.mean_isl or 1.0, 1.0))
    else:
        pool = planner.RemotePrefill(rate_per_s=rate, mean_isl=max(prompts.total / remote, 1.0),
                                     isl_mix=isl_mix_of(prompts),
                                     cached_fraction=min(max(cached_tokens / prompts.total, 0.0), 0.99))
    return replace(window, remote=pool, num_remote=int(remote))


def traffic_of(window: Window) -> planner.Traffic:
    """The planner's traffic from a window with finished requests (the Admin servicer's and the simulator's)."""
    assert window.mean_isl is not None and window.mean_osl is not None
    return planner.Traffic(rate_per_s=window.rate_per_s, mean_isl=max(window.mean_isl, 1.0),
                           mean_osl=max(window.mean_osl, 1.0), isl_mix=window.isl_mix, remote=window.remote)


def histogram_of(values: list[float], bounds: tuple[float, ...]) -> Histogram:
    """``values`` observed into a cumulative histogram with these finite upper bounds (and +inf)."""
    edges = (*bounds, math.inf)
    return Histogram(edges, tuple(float(sum(v <= b for v in values)) for b in edges), float(sum(values)))


def isl_mix_of(histogram: Histogram) -> tuple[tuple[float, float], ...]:
    """The prompt lengths' mix from a histogram of them: (geometric middle of each non-empty bucket, its share),
    the middles scaled so the mix's mean equals the histogram's exact mean; () when it is empty."""
    if histogram.count <= 0:
        return ()
    mix, lower, below = [], 0.0, 0.0
    for bound, cumulative in zip(histogram.bounds, histogram.cumulative):
        inside = cumulative - below
        if inside > 0:
            upper = 2 * lower if math.isinf(bound) else bound
            mix.append((math.sqrt(max(lower, 1.0) * max(upper, 1.0)), inside / histogram.count))
        lower, below = (bound if not math.isinf(bound) else lower), cumulative
    scale = (histogram.total / histogram.count) / sum(x * w for x, w in mix)
    return tuple((x * scale, w) for x, w in mix)


def _percentiles(histogram: Histogram) -> Percentiles | None:
    if histogram.count <= 0:
        return None
    p50, p90, p99 = (histogram.quantile(q) for q in (0.5, 0.9, 0.99))
    return Percentiles(count=int(histogram.count), p50_s=p50, p90_s=p90, p99_s=p99,  # type: ignore[arg-type]
                       mean_s=histogram.total / histogram.count)


class TrafficRecorder:
    """Timestamped copies of the router's histograms; the first is the empty state at the router's start."""

    def __init__(self, registry, start_s: float, *, period_s: float = 10.0, keep_s: float = 3600.0) -> None:
        self._registry, self.period_s, self.keep_s = registry, period_s, keep_s
        first = read_snapshot(registry, start_s)
        empty = {key: Histogram(h.bounds, tuple(0.0 for _ in h.cumulative), 0.0) for key, h in first.series.items()}
        zero = lambda counted: None if counted is None else 0.0  # noqa: E731
        self._snapshots: deque[Snapshot] = deque([Snapshot(start_s, empty, zero(first.arrived),
                                                           zero(first.remote_cached))])

    def record(self, now_s: float) -> Snapshot:
        current = read_snapshot(self._registry, now_s)
        if now_s - self._snapshots[-1].at_s >= self.period_s:
            self._snapshots.append(current)
        while len(self._snapshots) > 1 and now_s - self._snapshots[1].at_s > self.keep_s:
            self._snapshots.popleft()
        return current

    def window(self, now_s: float, window_s: float) -> Window:
        current = self.record(now_s)
        base = self._snapshots[0]
        for snapshot in self._snapshots:
            if now_s - snapshot.at_s >= window_s:
                base = snapshot
        return window_between(current, base)


def corrections(window: Window, prefill: planner.PrefillProfile, decode: planner.DecodeProfile, *,
                prefill_workers: int, decode_workers: int,
                dispatch: Dispatch = "pooled") -> tuple[planner.Corrections, list[planner.Term]]:
    """Measured / predicted latency for each pool (1.0 and a note saying why, when it cannot be measured);
    ``dispatch``: the router's, so the prefill prediction is the queue the planner then sizes."""
    p, p_note = _prefill_correction(window, prefill, prefill_workers, dispatch)
    d, d_mean, d_note = _decode_correction(window, decode, decode_workers)
    terms = [planner.Term(pool="prefill", name="measured correction", value=p, unit="x", note=p_note),
             planner.Term(pool="decode", name="measured correction", value=d, unit="x", note=d_note)]
    if d_mean is not None:
        terms.append(planner.Term(pool="decode", name="measured mean correction", value=d_mean, unit="x",
                                  note="mean ITL measured / predicted: Little's law's"))
    return planner.Corrections(prefill=p, decode=d, decode_mean=d_mean), terms


def _prefill_correction(window: Window, profile: planner.PrefillProfile, workers: int,
                        dispatch: Dispatch) -> tuple[float, str]:
    if window.ttft is None or window.num_requests < MIN_REQUESTS or window.mean_isl is None:
        return 1.0, f"fewer than {MIN_REQUESTS} requests in the window"
    if workers < 1:
        return 1.0, "no prefill workers: TTFT came from local prefill"
    if window.num_remote is not None and window.num_remote < MIN_REQUESTS:
        return 1.0, f"fewer than {MIN_REQUESTS} requests prefilled on a prefill worker in the window"
    remote = traffic_of(window).prefill_side()
    services = planner.service_mix(profile, remote.mean_isl, remote.isl_mix, remote.cached_fraction)
    _, predicted_s = planner.prefill_ttft_p90_s(remote.rate_per_s, services, workers, dispatch)
    if not math.isfinite(predicted_s) or predicted_s <= 0:
        return 1.0, f"the model predicts an unstable queue at {workers} workers"
    return window.ttft.p90_s / predicted_s, (f"TTFT p90 {window.ttft.p90_s * 1e3:.1f} ms measured / "
                                             f"{predicted_s * 1e3:.1f} ms predicted at {workers} workers, {dispatch}")


def _decode_correction(window: Window, profile: planner.DecodeProfile,
                       workers: int) -> tuple[float, float | None, str]:
    """(ITL p90 correction, mean ITL correction or None, note): each measured over the profile's ITL at the batch
    each worker runs by Little's law (rate * osl * mean ITL / workers)."""
    if window.num_requests < MIN_REQUESTS or window.mean_osl is None:
        return 1.0, None, f"fewer than {MIN_REQUESTS} requests in the window"
    if window.itl is None or window.itl.count < MIN_GAPS:
        return 1.0, None, f"fewer than {MIN_GAPS} inter-token gaps in the window"
    if workers < 1:
        return 1.0, None, "no decode workers"
    typical_s = window.itl.mean_s if window.itl.mean_s is not None else window.itl.p50_s
    batch = max(1.0, window.rate_per_s * window.mean_osl * typical_s / workers)
    predicted_s = planner.interpolate(profile.batch_sizes, profile.itl_s, batch)
    mean = None if window.itl.mean_s is None else window.itl.mean_s / predicted_s
    return window.itl.p90_s / predicted_s, mean, (f"ITL p90 {window.itl.p90_s * 1e3:.2f} ms measured / "
                                                  f"{predicted_s * 1e3:.2f} ms predicted at batch {batch:.1f}")
