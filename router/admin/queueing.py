"""The prefill pool as a queue (``router.admin.planner``'s model; pure math): M/G/n with Erlang C's probability of
waiting and Allen-Cunneen's wait, TTFT = a prompt's own service time + its wait, the p90 solved over the mix of
service times (the planner's module docstring states the model).

Why not n separate M/D/1 queues at the mean prompt (the planner until issue 23): on Mooncake's conversation trace
(prompts' service cv2 4.2 on an H200: attention grows with the square of the prompt) that predicted a TTFT p90 of
1.1 s on 2 prefill workers where the simulator, running the real router, measured 6.0 s (this model: 6.9 s), and
it sized 2 workers where 3 are the fewest that meet the SLO (``baton simulate pools``, docs/benchmarks.md)."""

from __future__ import annotations

import math

__all__ = ["erlang_c", "prefill_ttft_p90_s"]


def erlang_c(workers: int, offered: float) -> float:
    """Probability that a request waits in an M/M/n queue offered ``offered`` Erlangs (< workers), through Erlang
    B's recurrence (no factorials: stable at any pool size)."""
    blocked = 1.0
    for k in range(1, workers + 1):
        blocked = offered * blocked / (k + offered * blocked)
    return workers * blocked / (workers - offered * (1 - blocked))


def prefill_ttft_p90_s(rate_per_s: float, services: tuple[tuple[float, float], ...],
                       workers: int) -> tuple[float, float]:
    """(rho, p90 TTFT in s) of ``workers`` prefill workers fed Poisson traffic through one queue, each prompt
    taking the (seconds, share) of ``services``: M/G/n as the module says; inf when unstable."""
    mean_s = sum(s * w for s, w in services)
    cs2 = max(sum(s * s * w for s, w in services) / mean_s ** 2 - 1.0, 0.0)
    rho = rate_per_s * mean_s / workers
    if rho >= 1.0:
        return rho, math.inf
    waits = erlang_c(workers, rate_per_s * mean_s)
    wait_mean_s = mean_s * (1 + cs2) / (2 * workers * (1 - rho))  # once waiting

    def above(t: float) -> float:  # P(service + wait > t)
        return sum(w * (1.0 if t < s else waits * math.exp(-(t - s) / wait_mean_s)) for s, w in services)

    if len(services) == 1:  # closed form: the service time, plus the wait when over 10% of requests wait
        service_s = services[0][0]
        return rho, service_s + (wait_mean_s * math.log(10 * waits) if waits > 0.1 else 0.0)
    low, high = 0.0, max(s for s, _ in services) + (wait_mean_s * math.log(10 * waits) if waits > 0.1 else 0.0)
    high += 1e-9
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if above(mid) > 0.1 else (low, mid)
    return rho, high
