"""The router's Prometheus series (DESIGN.md "Observability"): what clients saw, and how requests were routed.

Names follow vLLM's with a ``baton:`` prefix. Request-level latencies and token counts are recorded here,
once per request, not on the workers, so dashboards that sum over every process count each request once.
Each ``RouterMetrics`` owns its ``CollectorRegistry``: two routers in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.trace import RequestTrace


# vLLM's buckets (seconds / tokens), so existing dashboards' thresholds read the same
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# (substring, category) checked in order: the bounded label set of router_decisions_total{reason}
_REASON_CATEGORIES = (
    ("fallback", "fallback"), ("prefilled locally", "fallback"), ("cost", "cost"),
    ("no prefill workers", "no_prefill"), ("saturated", "saturated"), ("threshold", "threshold"),
)


def reason_category(reason: str) -> str:
    """A short category of a policy's free-text reason (``threshold``, ``cost``, ``fallback``, ...)."""
    lowered = reason.lower()
    for needle, category in _REASON_CATEGORIES:
        if needle in lowered:
            return category
    return "other"


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ttft_s = Histogram("baton:time_to_first_token_seconds", "Time to first token, as the client saw it",
                                buckets=TTFT_BUCKETS_S, registry=r)
        self.itl_s = Histogram("baton:inter_token_latency_seconds", "Time between tokens sent to the client",
                               buckets=ITL_BUCKETS_S, registry=r)
        self.e2e_s = Histogram("baton:e2e_request_latency_seconds", "Request latency, first byte in to last out",
                               buckets=E2E_BUCKETS_S, registry=r)
        self.prompt_tokens = Histogram("baton:request_prompt_tokens", "Prompt tokens per finished request",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("baton:request_generation_tokens", "Generated tokens per finished request",
                                           buckets=TOKEN_BUCKETS, registry=r)
        self.running = Gauge("baton:num_requests_running", "Requests the router is relaying now", registry=r)
        self.received = Counter("baton:requests_received_total", "Generate requests the router took in (arrivals: "
                                "the planner's traffic rate, which finished requests understate under overload)",
                                registry=r)
        self.remote_prompt_tokens = Histogram(
            "baton:remote_prefill_prompt_tokens", "Prompt tokens of each request prefilled on a prefill worker (the "
            "planner's prefill pool traffic: its count the remote requests, its buckets their mix)",
            buckets=TOKEN_BUCKETS, registry=r)
        self.remote_cached_tokens = Counter("baton:remote_prefill_cached_tokens_total", "Of those prompt tokens, the "
                                            "ones the prefill worker found cached", registry=r)
        self.decisions = Counter("baton:router_decisions_total", "Routing decisions (a fallback is one more)",
                                 ["kind", "reason"], registry=r)
        self.errors = Counter("baton:request_errors_total", "Generate requests that ended in an error status",
                              ["code"], registry=r)
        self.success = Counter("baton:request_success_total", "Requests that finished normally",
                               ["finished_reason"], registry=r)
        self.migrations = Counter("baton:request_migrations_total", "Requests moved to another decode worker after "
                                  "theirs failed with tokens streamed, by the failure's status", ["code"], registry=r)

    def decision(self, kind: str, reason: str) -> None:
        self.decisions.labels(kind=kind, reason=reason_category(reason)).inc()

    def request_finished(self, trace: RequestTrace, *, num_prompt_tokens: int, num_output_tokens: int,
                         finished_reason: str) -> None:
        self.e2e_s.observe(trace.elapsed_ms() * 1e-3)
        if trace.first_token_s is not None:
            self.ttft_s.observe(trace.first_token_s - trace.start_s)
        for gap_s in trace.token_gaps_s:
            self.itl_s.observe(gap_s)
        self.prompt_tokens.observe(num_prompt_tokens)
        self.generation_tokens.observe(num_output_tokens)
        self.success.labels(finished_reason=finished_reason).inc()

    def remote_prefill(self, *, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A prefill worker answered a request's prefill (the planner's prefill pool traffic)."""
        self.remote_prompt_tokens.observe(num_prompt_tokens)
        self.remote_cached_tokens.inc(max(num_cached_tokens, 0))

    def migration(self, code: str) -> None:
        self.migrations.labels(code=code).inc()

    def request_error(self, code: str) -> None:
        self.errors.labels(code=code).inc()
