"""``baton bench <name>``: run one benchmark (throughput, kv-transfer, ..., compare, faults, soak, sampler, trace)."""

from __future__ import annotations

import importlib
import sys

_BENCHMARKS = {
    "throughput": "bench.throughput",
    "kv-transfer": "bench.kv_transfer",
    "kv-staging": "bench.kv_staging",
    "router-overhead": "bench.router_overhead",
    "decision-latency": "bench.decision_latency",
    "index-lookup": "bench.index_lookup",
    "routing": "bench.routing",
    "routing-sweep": "bench.routing_sweep",
    "routers": "bench.routers",
    "books-cost": "bench.books_cost",
    "serve": "bench.serve",
    "compare": "bench.compare",
    "faults": "bench.faults",
    "hosts": "bench.hosts",
    "soak": "bench.soak",
    "layerwise": "bench.layerwise",
    "layerwise-serving": "bench.layerwise_serving",
    "planner": "bench.planner",
    "sampler": "bench.sampler",
    "decode-sampling": "bench.decode_sampling",
    "speculative": "bench.speculative",
    "kv-quant": "bench.kv_quant",
    "preemption": "bench.preemption",
    "step-prep": "bench.step_prep",
    "kv-store": "bench.kv_store",
    "tensor-parallel": "bench.tensor_parallel",
    "trace": "bench.trace_replay",
    "relay": "bench.relay",
    "vllm-serving": "bench.vllm_serving",
    "vllm-transfer": "bench.vllm_transfer",
    "engines": "bench.engines",
    "linear-forms": "bench.linear_forms",
    "weight-agreement": "bench.weight_agreement",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in _BENCHMARKS:
        print(f"usage: baton bench {{{'|'.join(_BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    return int(importlib.import_module(_BENCHMARKS[argv[0]]).main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
