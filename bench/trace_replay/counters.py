"""The workers' KV tier counters, read from their ``/metrics``."""

from __future__ import annotations

import urllib.request

TIER_COUNTERS = ("baton:prefix_cache_queries_total", "baton:prefix_cache_hits_total",
                 "baton:kv_host_tier_saved_total", "baton:kv_host_tier_loaded_total",
                 "baton:kv_store_blocks_written_total", "baton:kv_store_blocks_fetched_total",
                 "baton:kv_store_writes_dropped_total", "baton:kv_store_fetch_failures_total",
                 "baton:num_preemptions_total")


def parse_counters(text: str) -> dict[str, float]:
    """The tier counters of one worker's Prometheus text (labels summed away)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in TIER_COUNTERS:
            out[name.removeprefix("baton:").removesuffix("_total")] = (
                out.get(name.removeprefix("baton:").removesuffix("_total"), 0.0) + float(line.rsplit(" ", 1)[1]))
    return out


def scrape(port: int, timeout_s: float = 5.0) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
            return parse_counters(resp.read().decode())
    except OSError as exc:
        return {"error": str(exc)}  # type: ignore[dict-item]
