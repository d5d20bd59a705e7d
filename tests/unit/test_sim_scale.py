"""The simulator at the issue's scale: 1,000 workers (500 prefill + 500 decode H200s) and the whole conversation trace
(12,031 requests, one hour), with the real cost policy. A benchmark (``slow``, left out of the default run): it
prints how long the run took and what each decision cost, and checks that every request ended and every block came
back. It needs the whole trace, which the repository does not carry (``tests/data`` holds 300 lines of it): set
``BATON_CONVERSATION_TRACE`` to its path; it is looked for beside the checkout's parent (``../shared/traces``) too.

    BATON_CONVERSATION_TRACE=path/to/conversation_trace.jsonl .venv/bin/python -m pytest -q -m slow -s \\
        tests/unit/test_sim_scale.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from workload.trace import Scale, load_trace
from kv_transfer.hashing import root_hash
from sim.cluster import ClusterConfig
from sim.hardware import GPUS, MODELS, WorkerShape
from sim.simulation import simulate
from sim.workload import from_trace

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = [os.environ.get("BATON_CONVERSATION_TRACE", ""),
              str(ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl")]


def _trace() -> Path:
    for candidate in CANDIDATES:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    pytest.skip("the whole conversation trace is not here (set BATON_CONVERSATION_TRACE)")


@pytest.mark.timeout(900)
def test_a_thousand_workers_replay_the_whole_conversation_trace():
    model = MODELS["llama-3-8b"]
    started = time.perf_counter()
    requests = from_trace(load_trace(_trace()), Scale(), block_size=512, root=root_hash(model.fingerprint, 512),
                          vocab_size=model.vocab_size)
    loaded_s = time.perf_counter() - started
    shape = WorkerShape(gpu=GPUS["H200"], model=model, tp=1, block_size=512)
    result = simulate(ClusterConfig(shape=shape, num_prefill=500, num_decode=500), requests)
    summary = result.summary
    print(f"\n1,000 workers, {len(requests):,} requests: trace loaded and hashed in {loaded_s:.1f} s, simulated in "
          f"{result.wall_s:.1f} s ({result.events:,} events, {summary['span_s']:,.0f} simulated seconds); decision "
          f"p50 {result.decision_ms['p50']:.2f} ms p99 {result.decision_ms['p99']:.2f} ms, of which route() p50 "
          f"{result.policy_ms['p50']:.2f} ms; TTFT p50 {summary['ttft_ms']['p50']:.0f} ms, hit rate "
          f"{summary['cache_hit_rate']:.1%}")
    assert len(requests) == 12_031 and summary["finished"] + summary["refused"] == len(requests)
    result.cluster.check_drained()
