"""The simulator's calibration to this machine (``baton simulate check``), on hand-made numbers: a step's fixed cost
fitted from a prefill curve and paid once per step, workers sharing cores, the router's time in TTFT, the fits from
probes, the tiny model's KV layout as the engine lays it out, and the comparison's errors and rankings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.trace_replay.slice import ReplayRequest
from kv_transfer.hashing import hash_blocks, root_hash
from kv_transfer.layout import KVLayout
from router.admin.planner import DecodeProfile, PrefillProfile
from router.routing.policy import PolicyConfig
from sim.calibration import (CPU, Probe, Served, calibrate, compare, fit_link, fit_loaded_hops, fit_per_stream_s,
                             fit_router_s, in_flight_at_send, pairs_in_order, ranking)
from bench.sim_check import sim_requests
from sim.cluster import ClusterConfig
from sim.contention import SharedCores
from sim.hardware import LINKS, MODELS, WorkerShape
from sim.plan import curves_from_profile
from sim.simulation import simulate
from sim.timing import Chunk, CurveTimeModel, fit_step_overhead_s
from sim.workload import SimRequest

LENS = (16, 64, 256, 1024, 2000)


def quadratic(a: float, b: float, c: float) -> PrefillProfile:
    """A prefill curve whose prompt of n tokens takes exactly a + b n + c n^2 seconds."""
    return PrefillProfile(prompt_lens=LENS, tokens_per_s=tuple(n / (a + b * n + c * n * n) for n in LENS))


FLAT_DECODE = DecodeProfile(batch_sizes=(1, 8), itl_s=(0.001, 0.002))


def test_the_fitted_overhead_is_the_curves_intercept():
    assert fit_step_overhead_s(quadratic(0.003, 1e-5, 5e-8)) == pytest.approx(0.003, rel=1e-6)
    assert fit_step_overhead_s(quadratic(0.0, 1e-5, 0.0)) == pytest.approx(0.0, abs=1e-9)
    two = PrefillProfile(prompt_lens=(16, 64), tokens_per_s=(1000.0, 2000.0))
    assert fit_step_overhead_s(two) == 0.0  # too few points to fit three terms
    # an intercept above the shortest prompt's time is impossible: kept within it
    noisy = PrefillProfile(prompt_lens=(16, 64, 256), tokens_per_s=(16 / 0.001, 64 / 0.01, 256 / 0.011))
    assert fit_step_overhead_s(noisy) <= 0.001


def test_a_step_pays_its_fixed_cost_once_however_many_prompts_it_holds():
    curve = quadratic(0.003, 1e-5, 0.0)
    model = CurveTimeModel(curve, FLAT_DECODE, overhead_s=0.003)
    alone = 0.003 + 1e-5 * 256
    assert model.step_s(0, 0, [Chunk(256, 0)]) == pytest.approx(alone)  # a prompt alone: the profile's point
    assert model.step_s(0, 0, [Chunk(256, 0), Chunk(256, 0)]) == pytest.approx(0.003 + 2 * 1e-5 * 256)
    # with a decode batch the ITL holds the step's cost: the chunk adds its compute only
    assert model.step_s(1, 100, [Chunk(256, 0)]) == pytest.approx(0.001 + 1e-5 * 256)
    unfitted = CurveTimeModel(curve, FLAT_DECODE)  # each prompt at its curve: the cost counted twice
    assert unfitted.step_s(0, 0, [Chunk(256, 0), Chunk(256, 0)]) == pytest.approx(2 * alone)
    assert model.explain(0, 0, [Chunk(256, 0)])["overhead_s"] == 0.003


def test_shared_cores_slow_a_step_by_the_workers_busy_beside_it():
    busy = {"p0": True, "p1": True, "d0": False, "d1": True}
    host = {"p0": 0, "p1": 0, "d0": 0, "d1": 1}
    shared = SharedCores(2, host, busy.__getitem__)
    assert shared.factor("d0") == 1.5  # p0 and p1 busy on its host, itself: 3 on 2 cores
    assert shared.factor("p0") == 1.0  # p1 beside it: 2 on 2 cores
    assert shared.factor("d1") == 1.0  # alone on its host
    with pytest.raises(ValueError):
        SharedCores(0, host, busy.__getitem__)
    # three runnable tasks of other programs beside them: d1 alone on its 2 cores now runs at 2 / 4
    loaded = SharedCores(2, host, busy.__getitem__, background=3.0)
    assert loaded.factor("d1") == 2.0 and loaded.factor("d0") == 3.0


def _two_prompts_at_once(**kw) -> list[float]:
    model = CurveTimeModel(quadratic(0.0, 1e-3, 0.0), FLAT_DECODE)  # 1 ms per prompt token
    shape = WorkerShape(gpu=CPU, model=MODELS["tiny"], tp=1, block_size=16, kv_blocks=512)
    config = ClusterConfig(shape=shape, num_prefill=2, num_decode=1, policy=PolicyConfig(policy="round_robin"),
                           time_model=model, gpus_per_host=4, placement="mixed", rpc_s=0.0, **kw)
    root = root_hash(MODELS["tiny"].fingerprint, 16)
    requests = [SimRequest(f"r{i}", 0.0, 200, 2, tuple(hash_blocks([i + 10] * 200, 16, root))) for i in range(2)]
    return sorted(r.ttft_s for r in simulate(config, requests).records)


def test_two_prefill_workers_on_one_core_take_turns():
    assert _two_prompts_at_once() == pytest.approx([0.2, 0.2])  # a device each
    assert _two_prompts_at_once(cores_per_host=1) == pytest.approx([0.2, 0.4])  # the second shares the core
    assert _two_prompts_at_once(cores_per_host=2) == pytest.approx([0.2, 0.2])


def test_a_loaded_machine_slows_every_step_and_the_router():
    assert _two_prompts_at_once(cores_per_host=2, background_load=2.0) == pytest.approx([0.3, 0.4])
    calibration = calibrate({"prefill": {"prompt_lens": [16], "tokens_per_s": [1000.0]},
                             "decode": {"batch_sizes": [1], "itl_ms": [1.0]}}, [], context_tokens=64, cores=2)
    calibration = replace(calibration, router_s=0.004)
    assert replace(calibration, background=3.0).loaded_router_s() == pytest.approx(0.008)  # (1 + 3) / 2
    assert replace(calibration, background=0.5).loaded_router_s() == 0.004  # room on the cores: as idle
    assert replace(calibration, cores=None, background=3.0).loaded_router_s() == 0.004


def test_the_routers_time_is_in_every_ttft():
    base = _two_prompts_at_once()
    assert _two_prompts_at_once(router_s=0.05) == pytest.approx([t + 0.05 for t in base])


def test_a_router_on_the_workers_cores_waits_for_them_when_they_are_busy():
    # 1 core: a request sent while a prefill runs gets a half share for the router's 50 ms: 100 ms
    model = CurveTimeModel(quadratic(0.0, 1e-3, 0.0), FLAT_DECODE)  # 1 ms per prompt token
    shape = WorkerShape(gpu=CPU, model=MODELS["tiny"], tp=1, block_size=16, kv_blocks=512)
    root = root_hash(MODELS["tiny"].fingerprint, 16)
    requests = [SimRequest(f"r{i}", at, 200, 2, tuple(hash_blocks([i + 10] * 200, 16, root)))
                for i, at in enumerate((0.0, 0.1))]

    def ttfts(**kw) -> list[float]:
        config = ClusterConfig(shape=shape, num_prefill=2, num_decode=1, policy=PolicyConfig(policy="round_robin"),
                               time_model=model, gpus_per_host=4, placement="mixed", rpc_s=0.0, router_s=0.05,
                               cores_per_host=1, **kw)
        return [r.ttft_s for r in sorted(simulate(config, requests).records, key=lambda r: r.arrival_s)]

    # the first: router 50 ms on an idle core, then its prefill (200 ms); the second, sent at 100 ms while that
    # prefill runs, gets half the core for its router time: 100 ms instead of 50
    beside, alone = ttfts(router_host=0), ttfts()
    assert beside[0] == alone[0] == pytest.approx(0.25)
    assert beside[1] - alone[1] == pytest.approx(0.05)
    with pytest.raises(ValueError):
        ClusterConfig(shape=shape, num_prefill=1, num_decode=1, router_host=0)  # no cores to share


def test_the_routers_time_grows_with_the_requests_in_flight():
    # both sent at 0: the first finds no stream in flight, the second one (the first's)
    assert _two_prompts_at_once(router_per_stream_s=0.03) == pytest.approx([0.2, 0.23])
    samples = [(n, 0.005 + 0.002 * n) for n in (0, 2, 4, 8)]
    assert fit_per_stream_s(samples) == pytest.approx(0.002)
    assert fit_per_stream_s([(0, 0.01), (4, 0.005), (8, 0.001)]) == 0.0  # faster when busy: no term
    assert fit_per_stream_s(samples[:2]) == 0.0  # too few to fit
    assert in_flight_at_send([(0.0, 1.0), (0.5, 2.0), (1.5, 3.0)]) == [0, 1, 1]


def _one_local_one_remote(**kw) -> dict[str, object]:
    """A 32-token prompt (local: under the threshold) and a 200-token one (remote), apart, on 1 ms per token."""
    model = CurveTimeModel(quadratic(0.0, 1e-3, 0.0), FLAT_DECODE)
    shape = WorkerShape(gpu=CPU, model=MODELS["tiny"], tp=1, block_size=16, kv_blocks=512)
    config = ClusterConfig(shape=shape, num_prefill=1, num_decode=1, policy=PolicyConfig(policy="round_robin"),
                           time_model=model, gpus_per_host=2, placement="mixed", rpc_s=0.0, **kw)
    root = root_hash(MODELS["tiny"].fingerprint, 16)
    requests = [SimRequest("local", 0.0, 32, 3, tuple(hash_blocks([1] * 32, 16, root))),
                SimRequest("remote", 5.0, 200, 3, tuple(hash_blocks([2] * 200, 16, root)))]
    result = simulate(config, requests)
    return {"records": {r.request_id: r for r in result.records}, "learned": result.learned}


def test_the_loaded_hops_delay_what_the_client_sees_per_route_kind():
    base = _one_local_one_remote()["records"]
    loaded = _one_local_one_remote(local_return_s=0.02, remote_return_s=0.005, local_handoff_s=0.01)
    hops = loaded["records"]
    assert (base["local"].route_kind, base["remote"].route_kind) == ("local", "remote")
    # local: its tokens reach the client 20 ms later, and D's engine takes the prompt 10 ms after its servicer
    assert hops["local"].ttft_s - base["local"].ttft_s == pytest.approx(0.03)
    assert hops["remote"].ttft_s - base["remote"].ttft_s == pytest.approx(0.005)
    for name in ("local", "remote"):  # every token later by the same: the gaps between them are unchanged
        assert hops[name].tpot_s == pytest.approx(base[name].tpot_s)
    with pytest.raises(ValueError):
        _one_local_one_remote(local_return_s=-0.001)


def test_loaded_hops_are_fitted_per_route_kind_from_the_training_replay():
    model = CurveTimeModel(quadratic(0.0, 1e-4, 0.0), FLAT_DECODE)  # 0.1 ms per prompt token
    router_s, rpc_s = 0.002, 0.0005
    local = [Served(route_kind="local", prompt_tokens=n, cached_tokens=0, ttft_s=0.003 + 0.015 + t + 0.008 + 1e-4 * n,
                    prefill_ms=(0.008 + 1e-4 * n) * 1e3) for n, t in ((40, 0.0), (64, 0.001), (256, 0.003))]
    remote = [Served(route_kind="remote", prompt_tokens=n, cached_tokens=16, ttft_s=0.003 + 0.004 + 0.05,
                     prefill_ms=50.0) for n in (300, 400, 500)]
    local_return_s, remote_return_s, handoff_s = fit_loaded_hops(local + remote, model, router_s, rpc_s)
    # outside D's servicer: 3 ms (router + 2 hops) + 15 ms + the median spread 1 ms -> 16 ms beyond what is priced
    assert local_return_s == pytest.approx(0.016)
    assert remote_return_s == pytest.approx(0.004)
    assert handoff_s == pytest.approx(0.008)  # D's prefill_ms beyond the curve's time for its tokens
    assert fit_loaded_hops(remote, model, router_s, rpc_s)[0::2] == (0.0, 0.0)  # no local request: no term
    calibration = calibrate({"prefill": {"prompt_lens": [16], "tokens_per_s": [1000.0]},
                             "decode": {"batch_sizes": [1], "itl_ms": [1.0]}}, [], context_tokens=64, cores=2)
    assert (calibration.local_return_s, calibration.remote_return_s, calibration.local_handoff_s) == (0, 0, 0)


def test_router_time_and_pull_latency_are_fitted_from_probes():
    model = CurveTimeModel(quadratic(0.002, 1e-5, 0.0), FLAT_DECODE, overhead_s=0.002)
    probes = [Probe(prompt_tokens=n, ttft_s=0.008 + 2 * 0.0005 + 0.002 + 1e-5 * n, route_kind="remote",
                    prefill_ms=1.0, transfer_ms=1.5 + n / 16 * 8192 / 2.8e6, transfer_bytes=n // 16 * 8192)
              for n in (64, 256, 1024)]  # profiled lengths: the curve is exact there
    assert fit_router_s(probes, model, rpc_s=0.0005) == pytest.approx(0.008)
    assert fit_link(probes).latency_s == pytest.approx(0.0015)
    assert fit_link([]) == LINKS["loopback"]  # no pull probed: the preset


def test_calibrate_reads_the_profile_file_at_the_workloads_context():
    doc = {"prefill": {"prompt_lens": list(LENS), "tokens_per_s": list(quadratic(0.002, 1e-5, 0.0).tokens_per_s)},
           "decode": {"batch_sizes": [1, 2], "itl_ms": [3.0, 4.0], "context_lens": [64, 1024],
                      "itl_ms_grid": [1.0, 2.0, 3.0, 4.0]}}
    assert curves_from_profile(doc)[1].itl_s == (0.003, 0.004)  # no context: the curve's own row
    assert curves_from_profile(doc, context_tokens=544)[1].itl_s == pytest.approx((0.002, 0.003))  # halfway
    calibration = calibrate(doc, [], context_tokens=64, cores=2)
    assert calibration.step_overhead_s == pytest.approx(0.002) and calibration.router_s == 0.0
    assert calibration.time_model().overhead_s == calibration.step_overhead_s


def test_the_tiny_models_kv_is_what_the_engine_lays_out():
    tiny = MODELS["tiny"]
    engine = KVLayout(model_fingerprint=b"x" * 16, dtype="float32", block_size=16, num_layers=2, num_kv_heads=2,
                      head_dim=16)
    assert tiny.kv_layout(16).bytes_per_block == engine.bytes_per_block == 8192  # NOTES: 8 KiB per block


def test_the_simulated_requests_are_the_replays_token_ids():
    prompt = list(range(10, 10 + 40))  # two full blocks and a partial one
    replay = [ReplayRequest(index=3, arrival_s=1.5, prompt=prompt, max_tokens=7, hash_ids=(1, 2, 3))]
    (request,) = sim_requests(replay)
    assert (request.request_id, request.arrival_s, request.prompt_tokens, request.output_tokens) == ("r3", 1.5, 40, 7)
    assert request.hashes == tuple(hash_blocks(prompt, 16, root_hash(MODELS["tiny"].fingerprint, 16)))
    assert len(request.hashes) == 2


def test_the_comparison_says_the_error_and_whether_policies_rank_alike():
    real = {"cost": {"ttft_p50_ms": 100.0, "ttft_p90_ms": 300.0, "hit_rate": 0.1},
            "random": {"ttft_p50_ms": 200.0, "ttft_p90_ms": 400.0, "hit_rate": 0.05}}
    sim = {"cost": {"ttft_p50_ms": 110.0, "ttft_p90_ms": 240.0, "hit_rate": 0.1},
           "random": {"ttft_p50_ms": 90.0, "ttft_p90_ms": 500.0, "hit_rate": 0.04}}
    result = compare(real, sim)
    assert result["policies"]["cost"]["ttft_p50_ms"]["error"] == pytest.approx(0.1)
    assert result["policies"]["cost"]["ttft_p90_ms"]["error"] == pytest.approx(-0.2)
    assert result["worst_ttft_p50_error"] == pytest.approx(0.55)
    assert result["rankings"]["ttft_p50_ms"]["same"] is False  # sim puts random first
    assert result["rankings"]["hit_rate"]["real"] == ["cost", "random"] and result["rankings"]["hit_rate"]["same"]
    assert ranking({"a": 1.0, "b": 3.0, "c": 2.0}, higher_is_better=True) == ["b", "c", "a"]
    assert pairs_in_order(["a", "b", "c"], ["a", "c", "b"]) == pytest.approx(2 / 3)
