"""``baton simulate`` end to end on the committed slice of Mooncake's conversation trace: the same seed gives the same
run; every request finishes or is refused, every block comes back and every token is accounted for; the objects
that decide are the router's own (not copies); idle time costs no events; the command line writes its report."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import router.routing.policy as policy_module
from workload.trace import Scale, load_trace
from kv_transfer.hashing import root_hash
from router.admin.planner import Plan
from router.routing.in_progress import InflightPrefills, PendingPrefixes
from router.routing.index_mirror import IndexMirror
from router.routing.policy import PolicyConfig, RoutingState
from router.routing.rates import Rates
from sim import cli
from sim.cluster import ClusterConfig
from sim.hardware import GPUS, MODELS, WorkerShape
from sim.simulation import Simulation, SimulationError, simulate
from sim.workload import SimRequest, from_trace, synthetic

ROOT = Path(__file__).resolve().parents[2]
SLICE = ROOT / "tests" / "data" / "conversation_trace_head300.jsonl"
MODEL = MODELS["llama-3-8b"]
SHAPE = WorkerShape(gpu=GPUS["H200"], model=MODEL, tp=1, block_size=512)
# ~60 blocks of 512 tokens per worker: pools that evict, requests that wait for blocks, some that never fit
TIGHT = dataclasses.replace(SHAPE, memory_utilization=(MODEL.weight_bytes + 60 * 512 * 131_072) / 141e9)


@pytest.fixture(scope="module")
def trace_requests() -> list[SimRequest]:
    root = root_hash(MODEL.fingerprint, 512)
    return from_trace(load_trace(SLICE, limit=150), Scale(time_scale=0.25), block_size=512, root=root,
                      vocab_size=MODEL.vocab_size)


def config(shape: WorkerShape = SHAPE, policy: str = "cost", **kw) -> ClusterConfig:
    return ClusterConfig(shape=shape, num_prefill=kw.pop("num_prefill", 3), num_decode=kw.pop("num_decode", 3),
                         policy=PolicyConfig(policy=policy), **kw)


def oracle_hit_rate(requests: list[SimRequest]) -> float:
    """Prompt tokens whose block some earlier request had (an unbounded cache shared by all): no routing beats it."""
    seen, hit = set(), 0
    for r in sorted(requests, key=lambda r: r.arrival_s):
        n = 0
        while n < len(r.hashes) and n < (r.prompt_tokens - 1) // 512 and r.hashes[n] in seen:
            n += 1
        hit += n * 512
        seen.update(r.hashes)
    return hit / sum(r.prompt_tokens for r in requests)


def assert_conserved(result) -> None:
    for record in result.records:
        assert (record.finished_s is not None) != bool(record.refused), record
    result.cluster.check_drained()  # pools balanced and empty, index == pools, router books empty
    decode_tokens = sum(r.output_tokens - 1 for r in result.records if r.finished_s is not None)
    assert sum(result.cluster.itl.values()) == decode_tokens  # one inter-token gap per token after the first


@pytest.mark.parametrize("policy", ["cost", "random"])  # cost reads the heartbeats' loads, random its RNG
def test_the_same_seed_gives_the_same_run(trace_requests, policy):
    first = simulate(config(policy=policy, seed=7), trace_requests)
    again = simulate(config(policy=policy, seed=7), trace_requests)
    assert first.records == again.records and first.summary == again.summary
    assert first.cluster.itl == again.cluster.itl
    if policy != "random":
        return
    other = simulate(config(policy="random", seed=8), trace_requests)
    assert [r.decode_id for r in other.records] != [r.decode_id for r in first.records]


@pytest.mark.parametrize("policy", ["cost", "least_loaded", "round_robin", "random", "prefix_overlap"])
def test_every_request_finishes_and_every_block_comes_back(trace_requests, policy):
    result = simulate(config(policy=policy), trace_requests)
    assert result.summary["finished"] == len(trace_requests)
    assert_conserved(result)
    assert 0 < result.summary["cache_hit_rate"] <= oracle_hit_rate(trace_requests)


def test_conservation_holds_on_pools_too_small_for_the_trace(trace_requests):
    result = simulate(config(TIGHT, num_prefill=2, num_decode=2), trace_requests)
    refused = result.summary["refused_why"]
    assert refused and set(refused) <= {"CapacityExceeded", "prompt larger than a prefill worker's KV pool",
                                        "request larger than a decode worker's KV pool"}
    assert result.summary["finished"] > len(trace_requests) // 2
    assert_conserved(result)


def test_the_simulated_router_is_the_real_one(trace_requests, monkeypatch):
    calls = []
    real = policy_module.route_by_cost
    monkeypatch.setattr(policy_module, "route_by_cost", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    sim = Simulation(config(), trace_requests)
    router = sim.router
    assert type(router.routing) is RoutingState and type(router.routing.rates) is Rates
    assert type(router.inflight_prefills) is InflightPrefills and type(router.pending_prefixes) is PendingPrefixes
    assert type(router.index) is IndexMirror
    result = sim.run()
    assert len(calls) == len(trace_requests)  # each decision went through the real cost policy
    assert [c.num_prompt_tokens for c in calls] == [r.prompt_tokens for r in trace_requests]
    rates = router.routing.rates  # learned on the simulated clock from the simulated timings
    assert rates._prefill and all(e.updated_s <= sim.events.now_s for e in rates._prefill.values())
    assert result.summary["route_kinds"]["remote"] > 0


def test_routing_sees_heartbeat_loads_and_its_own_books(trace_requests, monkeypatch):
    seen = []
    real = policy_module.route_by_cost
    monkeypatch.setattr(policy_module, "route_by_cost", lambda r, c, *a, **k: seen.append(c) or real(r, c, *a, **k))
    sim = Simulation(config(), trace_requests)
    sim.run()
    reported = [c.load for cands in seen for c in cands]
    assert any(load.running > 0 or load.queued_prefill_tokens > 0 for load in reported)  # heartbeats arrive
    assert any(c.inflight > (c.load.running + c.load.waiting) for cands in seen for c in cands)  # and lag a burst
    assert any(c.pending_blocks > c.cached_blocks for cands in seen for c in cands)  # prefixes being computed
    for info, load in sim.router.snapshot().workers:  # the last heartbeat of each worker says it is idle
        assert (load.running, load.waiting, load.free_blocks) == (0, 0, info.total_blocks), info.worker_id


def test_idle_time_costs_no_events():
    root = root_hash(MODEL.fingerprint, 512)
    hashes = tuple(root + bytes([i]) for i in range(4))
    requests = [SimRequest("a", 0.0, 2048, 8, hashes), SimRequest("b", 3600.0, 2048, 8, hashes)]
    result = simulate(config(num_prefill=500, num_decode=500), requests)
    assert result.events < 60  # an hour apart, on 1,000 workers
    assert result.records[1].finished_s > 3600.0
    assert_conserved(result)


def test_a_request_longer_than_the_context_is_refused():
    smol = WorkerShape(gpu=GPUS["H100"], model=MODELS["smollm2-135m"], tp=1, block_size=16)
    requests = [SimRequest("long", 0.0, 9000, 10, ()), SimRequest("ok", 0.0, 100, 10, ())]
    result = simulate(config(smol, num_prefill=0, num_decode=1), requests)
    assert [r.refused for r in result.records] == ["longer than the model's context", ""]
    assert_conserved(result)


def test_the_event_bound_ends_a_run_that_would_not():
    requests = [SimRequest("a", 0.0, 2048, 1000, ())]
    with pytest.raises(SimulationError, match="no end after 5 events"):
        simulate(config(), requests, max_events=5)


def test_a_shared_prefix_workload_hits_the_cache():
    root = root_hash(MODEL.fingerprint, 16)
    requests = synthetic("shared-prefix", 40, rate_per_s=5.0, seed=1, block_size=16, root=root,
                         vocab_size=MODEL.vocab_size, prompt_median=256, output_median=16)
    result = simulate(config(dataclasses.replace(SHAPE, block_size=16), num_prefill=1, num_decode=2), requests)
    assert result.summary["cache_hit_rate"] > 0.2
    assert_conserved(result)


def test_the_command_line_prints_a_table_and_writes_json_and_a_plot(tmp_path, capsys):
    out = tmp_path / "sim.json"
    code = cli.main(["--trace", str(SLICE), "--limit", "40", "--prefill-workers", "2", "--decode-workers", "2",
                     "--policy", "cost,round_robin", "--time-scale", "1,0.25", "--explain", "--json", str(out),
                     "--plot", str(tmp_path / "sim.png")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "round_robin" in printed and "plan:" in printed and "bound memory" in printed
    doc = json.loads(out.read_text())
    assert [(r["policy"], r["time_scale"]) for r in doc["runs"]] == [
        ("cost", 1.0), ("round_robin", 1.0), ("cost", 0.25), ("round_robin", 0.25)]
    assert doc["runs"][0]["summary"]["finished"] == 40 and set(doc["distserve_goodput"]) == {"cost", "round_robin"}
    assert doc["config"]["num_blocks"] == SHAPE.num_blocks and doc["planner"]["prefill"] >= 1
    assert "M/G/n (pooled" in doc["planner"]["explain"]  # the first policy's queue: cost prices the workers' queues
    assert cli.main(["--trace", str(SLICE), "--limit", "40", "--prefill-workers", "1", "--decode-workers", "1",
                     "--policy", "round_robin", "--json", str(out)]) == 0
    assert "n x M/G/1 (split" in json.loads(out.read_text())["planner"]["explain"]
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("flags", "why"), [
    (["--policy", "best"], "unknown policy"),
    (["--time-scale", "1,-2"], "--time-scale"),
    (["--decode-workers", "0"], "decode workers"),
    (["--model", "llama-3-70b", "--gpu", "H100", "--tp", "1"], "raise --tp"),
    (["--profile", "/nonexistent/curves.json"], "curves.json"),
    (["--block-size", "100"], "must divide"),
])
def test_bad_flags_say_why_and_exit_2(flags, why, capsys):
    base = {"--trace": str(SLICE), "--limit": "5", "--prefill-workers": "1", "--decode-workers": "1"}
    for flag, value in zip(flags[::2], flags[1::2]):
        base[flag] = value
    assert cli.main([x for pair in base.items() for x in pair]) == 2
    assert why in capsys.readouterr().err


def test_baton_simulate_is_a_subcommand_and_never_loads_torch(tmp_path):
    script = ("import sys; from deploy.cli import main; "
              f"code = main(['simulate', '--trace', {str(SLICE)!r}, '--limit', '10', '--prefill-workers', '1', "
              "'--decode-workers', '1']); assert code == 0, code; assert 'torch' not in sys.modules")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "TTFT p50" in run.stdout


def test_the_planner_in_the_report_is_the_real_planner(trace_requests):
    from sim.plan import plan_for
    from sim.metrics import Slo

    plan, _ = plan_for(trace_requests, config().build_time_model(), Slo(), kv_tokens=SHAPE.num_blocks * 512)
    assert type(plan) is Plan


def test_placement_decides_which_pairs_share_a_host():
    from sim.cluster import Cluster
    from sim.events import EventQueue

    split = Cluster(config(num_prefill=3, num_decode=3, gpus_per_host=2), EventQueue())
    assert split.host == {"p0": 0, "p1": 0, "p2": 1, "d0": 2, "d1": 2, "d2": 3}  # decode starts on a fresh host
    assert split.link("p0", "d0").name == "rdma" and split.link("p0", "p1").name == "nvlink"
    mixed = Cluster(config(num_prefill=3, num_decode=3, gpus_per_host=2, placement="mixed"), EventQueue())
    assert mixed.host == {"p0": 0, "d0": 0, "p1": 1, "d1": 1, "p2": 2, "d2": 2}
    assert mixed.link("p1", "d1").name == "nvlink" and mixed.link("p1", "d0").name == "rdma"


def test_measured_curves_replace_the_roofline(tmp_path, capsys):
    from sim.timing import profiles_of

    prefill, decode = profiles_of(config().build_time_model(), prompt_lens=(256, 4096, 65536),
                                  batch_sizes=(1, 16, 128), context=12_000, kv_tokens=None)
    curves = {"prefill": {"prompt_lens": list(prefill.prompt_lens), "tokens_per_s": list(prefill.tokens_per_s)},
              "decode": {"batch_sizes": list(decode.batch_sizes), "itl_ms": [x * 1e3 for x in decode.itl_s]}}
    path = tmp_path / "curves.json"
    path.write_text(json.dumps(curves))
    out = tmp_path / "sim.json"
    assert cli.main(["--trace", str(SLICE), "--limit", "30", "--prefill-workers", "2", "--decode-workers", "2",
                     "--profile", str(path), "--explain", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["time_model"] == f"curves from {path}"
    assert "decode_curve_s" in json.dumps(doc["explain"]) and doc["runs"][0]["summary"]["finished"] == 30


def test_the_same_seed_gives_the_same_run_in_another_process(tmp_path):
    """Nothing depends on set or dict order of hashed values (PYTHONHASHSEED differs between the two runs)."""
    summaries = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"run{hash_seed}.json"
        run = subprocess.run([sys.executable, "-m", "deploy.cli", "simulate", "--trace", str(SLICE), "--limit", "80",
                              "--prefill-workers", "2", "--decode-workers", "2", "--time-scale", "0.3", "--json",
                              str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert run.returncode == 0, run.stderr
        summaries.append(json.loads(out.read_text())["runs"][0]["summary"])
    assert summaries[0] == summaries[1]


def test_the_router_learns_the_modelled_links(trace_requests):
    result = simulate(config(), trace_requests)
    links = result.learned["link_gb_per_s"]
    assert links["count"] >= 3 and 45 <= links["min"] and links["max"] <= 450  # RDMA 50 GB/s, NVLink 450
    assert set(result.learned) == {"prefill_tokens_per_s", "local_prefill_tokens_per_s", "link_gb_per_s",
                                   "overhead_ms"}
