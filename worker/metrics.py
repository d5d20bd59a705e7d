"""A worker's Prometheus series (DESIGN.md "Observability"), each labelled with ``worker_id``.

Gauges follow the engine's ``SchedulerStats`` (sampled by the node's housekeeping loop); the KV transfer
series are recorded by the decode worker that pulls. Request-level latencies are the router's (counted
once per request there). Each ``WorkerMetrics`` owns its ``CollectorRegistry``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.core.outputs import SchedulerStats


TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics:
    def __init__(self, worker_id: str, registry: CollectorRegistry | None = None) -> None:
        self.worker_id = worker_id
        self.transfer_bytes_total, self.transfer_seconds_total = 0, 0.0  # for Stats (admin status)
        self.registry = registry if registry is not None else CollectorRegistry()
        r, w = self.registry, ["worker_id"]
        self._running = Gauge("baton:num_requests_running", "Requests in the engine's running batch", w, registry=r)
        self._waiting = Gauge("baton:num_requests_waiting", "Requests queued in the engine", w, registry=r)
        self._kv_usage = Gauge("baton:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", w,
                               registry=r)
        self._hit_rate = Gauge("baton:prefix_cache_hit_rate", "Prefix cache hits / queries since start (0-1)", w,
                               registry=r)
        self._queries = Counter("baton:prefix_cache_queries", "Prefix cache lookups (blocks)", w,
                                registry=r)
        self._hits = Counter("baton:prefix_cache_hits", "Prefix cache hits (blocks)", w, registry=r)
        self._preemptions = Counter("baton:num_preemptions", "Requests preempted for KV blocks", w, registry=r)
        self._transfer_bytes = Counter("baton:kv_transfer_bytes_total", "KV bytes pulled from prefill workers", w,
                                       registry=r)
        self._transfer_s = Histogram("baton:kv_transfer_seconds", "Time of one request's KV pull", w,
                                     buckets=TRANSFER_BUCKETS_S, registry=r)
        self._transfers = Counter("baton:kv_transfers_total", "KV pulls, by the transport chosen for the pair",
                                  ["worker_id", "transport"], registry=r)
        self.pull_fallbacks_total = 0  # for Stats
        self._fallbacks = Counter("baton:kv_pull_fallbacks_total",
                                  "Requests handed KV (or a prefix) to import that this worker prefilled itself instead, "
                                  "by why", ["worker_id", "reason"], registry=r)
        self._fallthroughs = Counter("baton:kv_transport_fallthroughs_total",
                                     "Worker pairs whose preferred KV transport could not work, seen at their "
                                     "first handshake (counted once per pair; its pulls use the next transport), "
                                     "by transport and why", ["worker_id", "transport", "reason"], registry=r)
        self._errors = Counter("baton:request_errors_total", "Worker calls that ended in an error status",
                               ["worker_id", "code"], registry=r)
        self._spec_drafts = Counter("baton:spec_decode_num_drafts", "Speculative steps that drafted (request, step)",
                                    w, registry=r)
        self._spec_draft_tokens = Counter("baton:spec_decode_num_draft_tokens", "Speculative draft tokens proposed",
                                          w, registry=r)
        self._spec_accepted = Counter("baton:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted",
                                      w, registry=r)
        self._host_blocks = Gauge("baton:kv_host_tier_blocks", "Blocks held in the host-memory tier", w, registry=r)
        self._host_saved = Counter("baton:kv_host_tier_saved", "Blocks the KV cache evicted into the host tier", w,
                                   registry=r)
        self._host_loaded = Counter("baton:kv_host_tier_loaded", "Prefix blocks copied back up from the host tier "
                                    "instead of recomputed", w, registry=r)
        self._store_written = Counter("baton:kv_store_blocks_written_total", "Blocks this worker wrote to the shared "
                                      "store", w, registry=r)
        self._store_write_failures = Counter("baton:kv_store_write_failures_total", "Blocks this worker could not "
                                             "write to the store (refused, failed or timed out)", w, registry=r)
        self._store_dropped = Counter("baton:kv_store_writes_dropped_total", "Blocks leaving this worker that were "
                                      "not written to the store: every write slot was busy", w, registry=r)
        self._store_fetched = Counter("baton:kv_store_blocks_fetched_total", "Prefix blocks read from the store "
                                      "(verified) instead of recomputed", w, registry=r)
        self._store_fetch_failures = Counter(
            "baton:kv_store_fetch_failures_total", "Prefix blocks the store listed that were recomputed instead, by "
            "why: missing, corrupt, failed, timeout, no_free_blocks", ["worker_id", "reason"], registry=r)
        self._store_lookups = Counter(
            "baton:kv_store_lookups_total", "Requests whose prefix past this worker's own was looked for in the store, "
            "by who said what it holds: index (the router's hint, no store call) or store (a batch_is_exist call)",
            ["worker_id", "source"], registry=r)
        self._store_stuck = Gauge("baton:kv_store_stuck_calls", "Store client threads (reads; the rest) running a "
                                  "call past its deadline: new calls on them are refused until it returns", w,
                                  registry=r)
        self.store_dropped_total = 0
        for series in (self._running, self._waiting, self._kv_usage, self._hit_rate, self._queries, self._hits,
                       self._preemptions, self._transfer_bytes, self._transfer_s):
            series.labels(worker_id)  # exported at zero from the start, not from the first event
        self._last = SchedulerStats(num_running=0, num_waiting=0, num_free_blocks=0, num_total_blocks=0,
                                    kv_cache_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
                                    num_preemptions=0)

    def scheduler_stats(self, stats: SchedulerStats) -> None:
        """Set the gauges; the engine's cumulative counts advance the counters by what is new."""
        w, last = self.worker_id, self._last
        self._running.labels(w).set(stats.num_running)
        self._waiting.labels(w).set(stats.num_waiting)
        self._kv_usage.labels(w).set(stats.kv_cache_usage)
        if stats.prefix_cache_queries:
            self._hit_rate.labels(w).set(stats.prefix_cache_hits / stats.prefix_cache_queries)
        self._queries.labels(w).inc(max(stats.prefix_cache_queries - last.prefix_cache_queries, 0))
        self._hits.labels(w).inc(max(stats.prefix_cache_hits - last.prefix_cache_hits, 0))
        self._preemptions.labels(w).inc(max(stats.num_preemptions - last.num_preemptions, 0))
        self._spec_drafts.labels(w).inc(max(stats.spec_steps - last.spec_steps, 0))
        self._spec_draft_tokens.labels(w).inc(max(stats.spec_draft_tokens - last.spec_draft_tokens, 0))
        self._spec_accepted.labels(w).inc(max(stats.spec_accepted_tokens - last.spec_accepted_tokens, 0))
        self._host_blocks.labels(w).set(stats.host_tier_blocks)
        self._host_saved.labels(w).inc(max(stats.host_tier_saved - last.host_tier_saved, 0))
        self._host_loaded.labels(w).inc(max(stats.host_tier_loaded - last.host_tier_loaded, 0))
        self._last = stats

    def kv_transfer(self, num_bytes: int, seconds: float, transport: str = "tcp") -> None:
        self.transfer_bytes_total += num_bytes
        self.transfer_seconds_total += seconds
        self._transfer_bytes.labels(self.worker_id).inc(num_bytes)
        self._transfer_s.labels(self.worker_id).observe(seconds)
        self._transfers.labels(worker_id=self.worker_id, transport=transport).inc()

    def kv_pull_fallback(self, reason: str) -> None:
        """A silent fallback: the output is the same, only slower, so it is counted (``PULL_FALLBACKS``)."""
        self.pull_fallbacks_total += 1
        self._fallbacks.labels(worker_id=self.worker_id, reason=reason).inc()

    def kv_transport_fallthrough(self, transport: str, reason: str) -> None:
        self._fallthroughs.labels(worker_id=self.worker_id, transport=transport, reason=reason).inc()

    def kv_store_written(self, num_stored: int, num_refused: int) -> None:
        self._store_written.labels(self.worker_id).inc(num_stored)
        self._store_write_failures.labels(self.worker_id).inc(num_refused)

    def kv_store_write_failed(self, num_blocks: int) -> None:
        self._store_write_failures.labels(self.worker_id).inc(num_blocks)

    def kv_store_dropped(self, total: int) -> None:
        """The engine's count of dropped writes since start."""
        self._store_dropped.labels(self.worker_id).inc(max(total - self.store_dropped_total, 0))
        self.store_dropped_total = total

    def kv_store_stuck(self, num_threads: int) -> None:
        self._store_stuck.labels(self.worker_id).set(num_threads)

    def kv_store_fetched(self, num_blocks: int) -> None:
        self._store_fetched.labels(self.worker_id).inc(num_blocks)

    def kv_store_lookup(self, source: str) -> None:
        self._store_lookups.labels(worker_id=self.worker_id, source=source).inc()

    def kv_store_fetch_failed(self, reason: str, num_blocks: int) -> None:
        self._store_fetch_failures.labels(worker_id=self.worker_id, reason=reason).inc(num_blocks)

    def request_error(self, code: str) -> None:
        self._errors.labels(worker_id=self.worker_id, code=code).inc()
