"""``python -m bench trace`` (``baton bench trace``): replay a Mooncake-format trace against a real Baton platform,
once per KV tier configuration, and report what the tiers reuse.

    python -m bench trace --trace conversation_trace.jsonl --limit 1000 --length-scale 32 --time-scale 0.25 \\
        [--model tiny] [--num-blocks 1024] [--host-blocks 4096] [--store-memory "1 GB"] \\
        [--configs none,host,host+store,oracle] [--passes N] [--client grpc|aiperf] [--out DIR]

The slice (``--start``, ``--limit``) is scaled to this machine with ``workload/trace.py``, the loader the simulator
uses: every length divided by ``--length-scale`` (32 makes one 512-token trace block one 16-token KV block; a
trace's partial last block stays partial, so it is never cached), arrival times multiplied by ``--time-scale``,
and each block's token ids generated from its hash id alone, so equal ids give equal tokens and a prefix cache
sees exactly the trace's sharing. A prompt longer than the model's context is cut at its end (its leading blocks,
what a cache can reuse, are kept); how many were cut is reported.

For each configuration a fresh platform is started with ``baton up`` (its own Redis, router, ``--prefill``
prefill and ``--decode`` decode workers; for ``host+store`` a Mooncake Store on loopback), the whole slice is
sent open-loop at its scaled arrival times, the workers' tier counters are read from their ``/metrics``, and the
platform is stopped (every process of it, by its process group):

- ``none``: each worker's KV pool only (``--num-blocks``, too small for the slice's working set);
- ``host``: the same pool plus a host-memory tier (``--kv-host-blocks``);
- ``host+store``: pool, host tier, and a shared Mooncake Store (``--kv-store``, ``--store-memory``);
- ``oracle``: a KV pool that holds the whole slice (its distinct blocks plus room for the longest requests in
  flight): the unbounded cache, measured on the same slice at the same load.

The cache hit rate is what the workers report, never what the trace predicts: per request, the prompt tokens
the worker that computed the prompt did not compute (``Usage.cached_prompt_tokens`` over gRPC; the OpenAI
front's ``usage.prompt_tokens_details.cached_tokens`` under aiperf), summed over the slice and divided by its
prompt tokens. It counts tokens served from any tier (the KV pool, the host tier, the store, another worker's
pool). The ceiling an unbounded cache can reach on the slice is computed beside it from the hash ids (leading
full blocks seen before, at most ``(prompt - 1) // block`` blocks, as the engine caps a hit). TTFT p50/p90 are
reported over every request and over the requests the trace lets reuse more than their first block (the same
ones in every configuration: the median request of a conversation trace reuses little, so its TTFT is the
machine's compute floor whatever the tiers do); throughput is completed requests and output tokens per second
from the first send to the last token (open loop: the offered load, unless the platform falls behind).
``--passes N`` runs the configurations N times, every other pass in reverse order; each run's row names the
machine's load average at its start and end.

Clients (``--client``): ``grpc`` (ours, the default) sends each prompt's exact token ids over Baton's gRPC
``Generate`` and reads each request's cached tokens and route from its final message; ``aiperf`` runs NVIDIA's
``aiperf profile --custom-dataset-type mooncake_trace`` against the OpenAI front on a trace file this package
writes already scaled (aiperf 0.13 has no length scale, and its ``--replay-speedup`` is for baseten traces only),
with the served model's tokenizer; aiperf sends text it generates per hash id, which the router tokenizes again,
so its prompts are close to, not exactly, the scaled lengths, and prompts past the context are refused (400)
rather than cut. What aiperf does not do, and this package does: exact token ids, a platform started per tier
configuration and an oracle pool sized from the slice, lengths scaled and over-long prompts cut, the workers' tier
counters, the ceiling from the hash ids. aiperf is not a dependency: ``make aiperf`` installs it into
``.venv-aiperf`` (it pulls ~1 GB, and pins of its own that conflict with Baton's). ``--router`` replays once against
a platform already running instead (whatever its configuration; no tier counters).

Every request has a deadline (``--request-timeout-s``), every configuration a bound (``--max-run-s``: requests
still running then are cancelled and counted as failed), and every process started is stopped on the way out.
"""

from bench.trace_replay.aiperf_client import (aiperf_binary, aiperf_outcomes, hf_cache_for, replay_aiperf,
                                              scaled_trace_lines)
from bench.trace_replay.cli import CLIENTS, _model_info, main, run
from bench.trace_replay.counters import TIER_COUNTERS, parse_counters, scrape
from bench.trace_replay.grpc_client import WARMUP_HASH_BASE, replay_grpc
from bench.trace_replay.outcomes import Outcome, percentile, store_tokens_of, summarize
from bench.trace_replay.report import label, line_of, loadavg, plot, table
from bench.trace_replay.slice import (ReplayRequest, oracle_pool_blocks, reusable_blocks, scaled_requests,
                                      working_set_blocks)
from bench.trace_replay.up import CONFIGS, ROOT, Up, config_flags, free_port

__all__ = [
    "CLIENTS", "CONFIGS", "ROOT", "TIER_COUNTERS", "WARMUP_HASH_BASE", "Outcome", "ReplayRequest", "Up",
    "aiperf_binary", "aiperf_outcomes", "config_flags", "free_port", "hf_cache_for", "label", "line_of", "loadavg",
    "main", "oracle_pool_blocks", "parse_counters", "percentile", "plot", "replay_aiperf", "replay_grpc",
    "reusable_blocks", "run", "scaled_requests", "scaled_trace_lines", "scrape", "store_tokens_of", "summarize",
    "table", "working_set_blocks",
    "_model_info",  # private, but the unit tests check it
]
