"""Pools the planner resizes while a simulation runs (``sim/elastic.py``): the traffic window it reads, workers that
start late and cost GPU-seconds from the ask, pools that shrink by draining their newest worker, and a whole run
under a burst that grows then shrinks the pools with every request served and every block back."""

from __future__ import annotations

import pytest

import router.admin.planner as planner_module
import router.admin.traffic as traffic_module
import sim.elastic as elastic_module
from kv_transfer.hashing import hash_blocks, root_hash
from router.admin.planner import PlannerConfig
from router.routing.policy import PolicyConfig
from sim.cluster import ClusterConfig
from sim.elastic import ElasticConfig, ElasticSimulation, window_of
from sim.hardware import GPUS, MODELS, WorkerShape
from sim.metrics import RequestRecord, Slo
from sim.plan import profiles_for
from sim.workload import SimRequest

MODEL = MODELS["llama-3-8b"]
SHAPE = WorkerShape(gpu=GPUS["H200"], model=MODEL, tp=1, block_size=512)
SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def burst() -> list[SimRequest]:
    """1 req/s of 8k-token prompts, 12 req/s from 60 s to 120 s, 1 req/s again until 240 s; nothing shared."""
    root, out, t, i = root_hash(MODEL.fingerprint, 512), [], 0.0, 0
    while t < 240:
        prompt = [7 + i % 1000] + [11] * 8191
        out.append(SimRequest(f"r{i}", t, 8192, 64, tuple(hash_blocks(prompt, 512, root))))
        t, i = t + (1 / 12 if 60 <= t < 120 else 1.0), i + 1
    return out


def elastic_run(requests: list[SimRequest]):
    config = ClusterConfig(shape=SHAPE, num_prefill=1, num_decode=1, policy=PolicyConfig(policy="least_loaded"))
    elastic = ElasticConfig(interval_s=10, window_s=20, startup_s=5,
                            planner=PlannerConfig(max_workers=16, down_cooldown_s=30))
    profiles = profiles_for(requests, config.build_time_model(), kv_tokens=SHAPE.num_blocks * 512)
    return ElasticSimulation(config, requests, SLO, elastic, profiles=profiles).run()


def test_the_window_holds_the_requests_that_finished_in_it():
    records = [RequestRecord(f"r{i}", float(i), 100 * (i + 1), 11, first_token_s=i + 0.5, finished_s=i + 1.5)
               for i in range(10)]
    window = window_of(records, 10.0, 4.0)  # finished in (6, 10]: r5 .. r8; arrived in it: r7 .. r9
    assert window.num_requests == 4 and window.span_s == 4.0
    assert window.num_arrived == 3 and window.rate_per_s == 0.75  # the rate is what arrived
    assert window.mean_isl == pytest.approx((600 + 700 + 800 + 900) / 4) and window.mean_osl == 11
    assert window.ttft.p50_s == pytest.approx(0.5) and window.itl.p90_s == pytest.approx(0.1)
    assert window.itl.count == 40 and window.itl.mean_s == pytest.approx(0.1)  # 10 gaps each
    assert sum(w for _, w in window.isl_mix) == pytest.approx(1.0)
    assert sum(x * w for x, w in window.isl_mix) == pytest.approx(window.mean_isl)  # the histogram's mix
    assert window_of(records, 2.0, 300.0).span_s == 2.0  # younger than the window: the span it covers


def test_the_window_reports_the_prefill_pools_own_traffic():
    # 10 requests arrive at 1/s; even ones prefilled on P (a quarter of their tokens cached there), odd ones on D
    records = [RequestRecord(f"r{i}", float(i), 2000 if i % 2 == 0 else 40, 11, first_token_s=i + 0.5,
                             finished_s=i + 1.5, route_kind="remote" if i % 2 == 0 else "local",
                             cached_tokens=500 if i % 2 == 0 else 32) for i in range(10)]
    window = window_of(records, 10.0, 4.0)  # finished in (6, 10]: r5 .. r8; first tokens in it: r6 .. r9
    assert window.num_remote == 2  # r6 and r8, answered by P in the window
    assert window.remote.rate_per_s == pytest.approx(0.75 * 2 / 4)  # the arrivals' rate x remote share (r6, r8)
    assert window.remote.mean_isl == 2000 and window.remote.cached_fraction == pytest.approx(0.25)
    assert window.remote.isl_mix == ((pytest.approx(2000.0), 1.0),)
    assert window_of(records[1::2], 10.0, 4.0).remote.rate_per_s == 0.0  # every request local: nothing on P


def test_the_planner_plans_with_the_simulated_policys_queue():
    requests = burst()[:5]
    for policy, dispatch in (("least_loaded", "pooled"), ("round_robin", "split")):
        config = ClusterConfig(shape=SHAPE, num_prefill=1, num_decode=1, policy=PolicyConfig(policy=policy))
        sim = ElasticSimulation(config, requests, SLO, ElasticConfig(), profiles=profiles_for(
            requests, config.build_time_model(), kv_tokens=1 << 20))
        assert sim.planner.dispatch == dispatch


def test_the_planner_and_its_traffic_reading_are_the_routers_own():
    assert elastic_module.plan_pools is planner_module.plan_pools
    assert elastic_module.traffic_mod.corrections is traffic_module.corrections


def test_the_pools_grow_for_a_burst_then_drain_back_with_every_request_served():
    requests = burst()
    result = elastic_run(requests)
    assert all(r.finished_s is not None for r in result.records)
    result.cluster.check_drained()  # pools empty and balanced, index == pools, no request left in the books
    desired = [h["desired"]["prefill"] for h in result.plan_history]
    assert max(desired) > 1  # the burst asked for more prefill workers
    assert desired[-1] < max(desired) and result.cluster.retired  # and they were drained and left after it
    live = [h["live"]["prefill"] for h in result.plan_history]
    assert live[desired.index(max(desired))] < max(desired)  # a worker asked for serves only after its start-up
    span = result.summary["span_s"]
    provisioned = result.summary["gpu_seconds"]["provisioned"]
    assert 2 * span < provisioned < 2 * span + 16 * span  # more than the first pools, less than the cap all along
    lifetimes = result.cluster.lifetimes
    assert sum(stop - start for start, stop in ((a, b if b is not None else span) for a, b in lifetimes.values())) \
        == pytest.approx(provisioned)


def test_a_planner_driven_run_is_deterministic():
    requests = burst()[:150]
    first, again = elastic_run(requests), elastic_run(requests)
    assert first.records == again.records and first.plan_history == again.plan_history


def test_shrinking_cancels_a_start_before_draining_a_worker():
    requests = burst()[:5]
    sim = ElasticSimulation(ClusterConfig(shape=SHAPE, num_prefill=2, num_decode=1), requests, SLO,
                            ElasticConfig(startup_s=30), profiles=profiles_for(requests, ClusterConfig(
                                shape=SHAPE, num_prefill=1, num_decode=1).build_time_model(), kv_tokens=1 << 20))
    planner = sim.planner
    planner.desired["prefill"] = 4
    asks = planner._reconcile("prefill", 0.0)
    assert len(asks) == 2 and len(planner.starting["prefill"]) == 2
    planner.desired["prefill"] = 2
    assert planner._reconcile("prefill", 10.0) == [] and not planner.starting["prefill"]  # both starts cancelled
    assert sim.cluster.draining == set()
    assert planner.worker_up(asks[0], 30.0) is None  # a cancelled start never registers
    planner.desired["prefill"] = 1
    planner._reconcile("prefill", 40.0)
    assert sim.cluster.draining == {"p1"}  # the newest worker drains
    sim.cluster.retire_idle()
    assert "p1" not in sim.cluster.prefill and sim.cluster.lifetimes["p1"] == [0.0, 0.0]
    cancelled = [v for k, v in sim.cluster.lifetimes.items() if k.startswith("cancelled")]
    assert cancelled == [[0.0, 10.0], [0.0, 10.0]]  # each start cost GPU-seconds until it was cancelled
