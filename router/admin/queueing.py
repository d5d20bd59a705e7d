"""The prefill pool as a queue (``router.admin.planner``'s model; pure math). How the router feeds the pool decides
the model (``dispatch_of``: the routing policy's name -> its dispatch):

- **pooled** (``cost``, ``least_loaded``, ``prefix_overlap``: each prices the prefill workers' queued tokens, so a
  prompt goes to the worker that frees first): the ``n`` workers are one M/G/n queue, Erlang C's probability of
  waiting and Allen-Cunneen's wait;
- **split** (``round_robin``, ``random``: a worker is picked blind to its queue): each worker is its own M/G/1 queue
  fed ``rate / n`` over the same mix of service times, waiting with probability ``rho`` and on average
  Pollaczek-Khinchine's ``rho E[S] (1 + cs2) / (2 (1 - rho))``. A prompt can wait behind a long one while another
  worker idles, so the same utilization waits longer: on Mooncake's conversation trace round_robin measured TTFT p90
  9.6 / 4.9 / 3.2 / 2.0 s at 2 / 3 / 4 / 6 prefill workers in the simulator, about twice the workers the pooled
  model asks for (docs/benchmarks.md, "Planner at scale").

Either way TTFT is a prompt's own service time plus its wait, and the p90 is solved over the mix of service times.
Once waiting, the pooled wait is exponential with Allen-Cunneen's mean. The split wait has exact first two moments
(M/G/1: ``E[W] = lambda E[S^2] / (2 (1 - rho))``, ``E[W^2] = 2 E[W]^2 + lambda E[S^3] / (3 (1 - rho))``, Takacs);
when the wait once waiting varies more than an exponential (cv2 > 1: heavy-tailed prompts) it is a two-phase
hyperexponential with those two moments (balanced means), else the exponential of its mean. An exponential of the
mean alone put too much of a heavy-tailed wait near the p90: on the conversation trace it predicted 3.74 / 2.83 s
at 4 / 6 round_robin workers where the simulator measured 3.20 / 1.97 s.

Why not n separate M/D/1 queues at the mean prompt (the planner until issue 23): on that trace (prompts' service
cv2 4.2 on an H200: attention grows with the square of the prompt) it predicted a TTFT p90 of 1.1 s on 2 prefill
workers where the simulator, running the real router, measured 6.0 s with least_loaded (the pooled model: 6.9 s),
and it sized 2 workers where 3 are the fewest that meet the SLO (``baton simulate pools``)."""

from __future__ import annotations

import math
from typing import Literal

from engine.errors import InvalidRequest

__all__ = ["DISPATCH", "Dispatch", "dispatch_of", "erlang_c", "model_name", "moments", "prefill_ttft_p90_s",
           "wait_phases", "waiting"]

Dispatch = Literal["pooled", "split"]
# every routing policy (router.routing.policy.POLICIES) and how it picks a prefill worker
DISPATCH: dict[str, Dispatch] = {"cost": "pooled", "least_loaded": "pooled", "prefix_overlap": "pooled",
                                 "round_robin": "split", "random": "split"}


def dispatch_of(policy: str) -> Dispatch:
    """How the routing policy ``policy`` feeds the prefill pool: ``pooled`` when it prices the workers' queues."""
    if policy not in DISPATCH:
        raise InvalidRequest(f"no prefill dispatch known for routing policy {policy!r}: one of {', '.join(DISPATCH)}")
    return DISPATCH[policy]


def model_name(dispatch: Dispatch) -> str:
    """The queue model of ``dispatch`` and the policies that dispatch so, as the plan's terms say it."""
    policies = ", ".join(name for name, d in DISPATCH.items() if d == dispatch)
    return f"M/G/n (pooled: {policies})" if dispatch == "pooled" else f"n x M/G/1 (split: {policies})"


def erlang_c(workers: int, offered: float) -> float:
    """Probability that a request waits in an M/M/n queue offered ``offered`` Erlangs (< workers), through Erlang
    B's recurrence (no factorials: stable at any pool size)."""
    blocked = 1.0
    for k in range(1, workers + 1):
        blocked = offered * blocked / (k + offered * blocked)
    return workers * blocked / (workers - offered * (1 - blocked))


def moments(services: tuple[tuple[float, float], ...]) -> tuple[float, float]:
    """(mean, squared coefficient of variation) of a mix of (seconds, share) service times."""
    mean_s = sum(s * w for s, w in services)
    return mean_s, max(sum(s * s * w for s, w in services) / mean_s ** 2 - 1.0, 0.0)


def wait_phases(rate_per_s: float, services: tuple[tuple[float, float], ...], workers: int,
                dispatch: Dispatch) -> tuple[tuple[float, float], ...]:
    """The wait as (probability, mean) phases: ``P(wait > t) = sum p_i exp(-t / mean_i)`` (rho < 1); see the module."""
    mean_s, cs2 = moments(services)
    waits, once_s = waiting(rate_per_s, mean_s, cs2, workers, dispatch)
    if dispatch != "split" or waits <= 0:
        return ((waits, once_s),)
    rho = waits  # split: a prompt waits with probability rho, and E[W] = rho x the mean once waiting (P-K)
    wait_s = rho * once_s
    wait2 = 2 * wait_s ** 2 + rate_per_s / workers * sum(s ** 3 * w for s, w in services) / (3 * (1 - rho))
    cv2 = (wait2 / rho) / once_s ** 2 - 1.0  # once waiting: mean E[W] / rho, second moment E[W^2] / rho
    if cv2 <= 1.0:
        return ((waits, once_s),)
    p = (1 + math.sqrt((cv2 - 1) / (cv2 + 1))) / 2  # balanced means: p / rate_1 = (1 - p) / rate_2
    return ((waits * p, once_s / (2 * p)), (waits * (1 - p), once_s / (2 * (1 - p))))


def waiting(rate_per_s: float, mean_s: float, cs2: float, workers: int, dispatch: Dispatch) -> tuple[float, float]:
    """(probability that a prompt waits, mean wait once it waits) at utilization ``rho = rate E[S] / n`` < 1."""
    rho = rate_per_s * mean_s / workers
    if dispatch == "split":  # M/G/1 at rate / n: P-K's mean wait rho E[S] (1 + cs2) / (2 (1 - rho)), over P(wait) rho
        return rho, mean_s * (1 + cs2) / (2 * (1 - rho))
    return erlang_c(workers, rate_per_s * mean_s), mean_s * (1 + cs2) / (2 * workers * (1 - rho))


def prefill_ttft_p90_s(rate_per_s: float, services: tuple[tuple[float, float], ...], workers: int,
                       dispatch: Dispatch = "pooled") -> tuple[float, float]:
    """(rho, p90 TTFT in s) of ``workers`` prefill workers fed Poisson traffic as ``dispatch`` feeds them, each
    prompt taking the (seconds, share) of ``services``: the module's models; inf when unstable."""
    rho = rate_per_s * sum(s * w for s, w in services) / workers
    if rho >= 1.0:
        return rho, math.inf
    phases = wait_phases(rate_per_s, services, workers, dispatch)

    def above(t: float) -> float:  # P(service + wait > t)
        return sum(w * (1.0 if t < s else sum(p * math.exp(-(t - s) / m) for p, m in phases)) for s, w in services)

    if len(services) == 1 and len(phases) == 1:  # closed form: the service time, plus the wait past 10% waiting
        (waits, wait_mean_s), service_s = phases[0], services[0][0]
        return rho, service_s + (wait_mean_s * math.log(10 * waits) if waits > 0.1 else 0.0)
    waits, longest_s = sum(p for p, _ in phases), max(m for _, m in phases)
    low, high = 0.0, max(s for s, _ in services) + (longest_s * math.log(10 * waits) if waits > 0.1 else 0.0)
    high += 1e-9
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if above(mid) > 0.1 else (low, mid)
    return rho, high
