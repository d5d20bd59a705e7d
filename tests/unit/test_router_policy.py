"""Routing policy on hand-built cluster states: exact choices and reasons."""

from __future__ import annotations

import pytest

from engine.errors import CapacityExceeded
from kv_transfer.workers import WorkerInfo, WorkerLoad
from router.errors import WorkerUnavailable
from router.routing.rates import RatesConfig
from router.routing.policy import Candidate, PolicyConfig, RouteKind, RouteRequest, pick_decode, pick_prefill, route

BS = 16
CONFIG = PolicyConfig(disagg_threshold_tokens=64, policy="least_loaded")  # the simple policy (cost: its own file)


def worker(
    worker_id: str, role: str = "decode", *, running: int = 0, waiting: int = 0, free: int = 100,
    queued: int = 0, cached: int = 0, total: int = 100, draining: bool = False, load: bool = True,
) -> Candidate:
    info = WorkerInfo(worker_id=worker_id, role=role, grpc_address=f"{worker_id}:1", kv_uri="tcp://x:2",
                      model_fingerprint="ab", layout_json='{"block_size": 16}', total_blocks=total)
    report = WorkerLoad(running=running, waiting=waiting, free_blocks=free, queued_prefill_tokens=queued)
    return Candidate(info=info, load=report if load else None, cached_blocks=cached, draining=draining)


def req(num_prompt_tokens: int) -> RouteRequest:
    return RouteRequest(num_prompt_tokens=num_prompt_tokens, block_size=BS)


def test_decode_is_least_loaded_running_plus_waiting():
    cands = [worker("d0", running=3), worker("d1", running=1, waiting=1), worker("d2", waiting=1)]
    assert pick_decode(req(10), cands)[0].worker_id == "d2"


def test_decode_tie_breaks_on_prefix_overlap_then_id():
    cands = [worker("d0", running=1, cached=1), worker("d1", running=1, cached=3), worker("d2", running=1, cached=3)]
    assert pick_decode(req(100), cands)[0].worker_id == "d1"
    cands = [worker("d1", running=1), worker("d0", running=1)]
    assert pick_decode(req(100), cands)[0].worker_id == "d0"


def test_router_inflight_counts_when_the_report_lags_a_burst():
    stale = [worker("d0"), worker("d1")]  # both reported idle at the last heartbeat
    burst = [Candidate(info=c.info, load=c.load, inflight=n) for c, n in zip(stale, (3, 1))]
    assert pick_decode(req(10), burst)[0].worker_id == "d1"
    # a report above the router's own count wins (other routers' requests are in it)
    reported = [Candidate(info=worker("d0", running=5).info, load=worker("d0", running=5).load, inflight=1),
                Candidate(info=stale[1].info, load=stale[1].load, inflight=3)]
    assert pick_decode(req(10), reported)[0].worker_id == "d1"


def test_load_beats_prefix_overlap():
    cands = [worker("d0", running=2, cached=6), worker("d1", running=1)]
    assert pick_decode(req(100), cands)[0].worker_id == "d1"


def test_decode_without_free_blocks_is_excluded():
    # 100 tokens + 1 output -> 7 blocks. d0 has 6 free and nothing cached; d1 is busier but has room.
    cands = [worker("d0", free=6), worker("d1", running=5, free=7)]
    assert pick_decode(req(100), cands) == (cands[1], "")


def test_cached_blocks_count_toward_the_room_needed():
    # d0 holds 3 of the prompt's blocks, so it needs only 7 - 3 = 4 free blocks.
    cands = [worker("d0", free=4, cached=3), worker("d1", running=5)]
    assert pick_decode(req(100), cands)[0].worker_id == "d0"


def test_all_short_of_free_blocks_queues_on_least_loaded_that_can_ever_hold_it():
    cands = [worker("d0", running=1, free=0), worker("d1", running=4, free=0), worker("d2", free=0, total=5)]
    chosen, note = pick_decode(req(100), cands)
    assert chosen.worker_id == "d0" and "short of free blocks" in note


def test_prompt_larger_than_every_decode_worker_is_capacity_exceeded():
    with pytest.raises(CapacityExceeded, match="needs 7 KV blocks; the largest decode worker has 6"):
        pick_decode(req(100), [worker("d0", total=6, free=6), worker("d1", total=4, free=4)])


def test_no_decode_workers():
    with pytest.raises(WorkerUnavailable, match="^no decode workers registered$"):
        route(req(10), [worker("p0", "prefill")], CONFIG)
    with pytest.raises(WorkerUnavailable, match=r"no decode workers \(1 draining\)"):
        route(req(10), [worker("d0", draining=True)], CONFIG)
    with pytest.raises(WorkerUnavailable, match=r"no decode workers \(1 failed\)"):
        route(req(10), [worker("d0")], CONFIG, exclude={"d0"})


def test_draining_workers_are_never_chosen():
    cands = [worker("d0", draining=True), worker("d1", running=9), worker("p0", "prefill", draining=True),
             worker("p1", "prefill", queued=5000)]
    decision = route(req(200), cands, CONFIG)
    assert (decision.decode_id, decision.prefill_id) == ("d1", "p1")


def test_short_prompt_prefills_locally():
    decision = route(req(64), [worker("d0"), worker("p0", "prefill")], CONFIG)
    assert decision.kind is RouteKind.LOCAL and decision.prefill_id is None
    assert decision.reason == "64 uncached prompt tokens <= threshold 64"


def test_long_prompt_prefills_remotely_on_least_queued_prefill_worker():
    cands = [worker("d0"), worker("p0", "prefill", queued=300), worker("p1", "prefill", queued=100),
             worker("p2", "prefill", queued=200)]
    decision = route(req(65), cands, CONFIG)
    assert (decision.kind, decision.decode_id, decision.prefill_id) == (RouteKind.REMOTE, "d0", "p1")
    assert decision.reason == "65 uncached prompt tokens > threshold 64"


def test_a_remote_decision_carries_what_the_prefill_worker_must_compute():
    # p1 holds 10 of the prompt's blocks: it queues only the 40-token tail, which the router counts as in flight
    cands = [worker("d0"), worker("p0", "prefill", queued=50), worker("p1", "prefill", queued=50, cached=10)]
    for config in (CONFIG, PolicyConfig(disagg_threshold_tokens=64, policy="prefix_overlap")):
        decision = route(req(200), cands, config)
        assert (decision.kind, decision.prefill_id, decision.computed_tokens) == (RouteKind.REMOTE, "p1", 40)
    local = route(req(200), [worker("d0", cached=4)], CONFIG)  # local: D computes what it lacks
    assert (local.kind, local.computed_tokens) == (RouteKind.LOCAL, 136)


def test_decode_prefix_cache_makes_a_long_prompt_local():
    # 200 tokens, d0 holds 9 blocks (144 tokens): 56 uncached <= 64.
    decision = route(req(200), [worker("d0", cached=9), worker("p0", "prefill")], CONFIG)
    assert decision.kind is RouteKind.LOCAL and decision.decode_cached_tokens == 144
    assert decision.reason.startswith("56 uncached")


def test_prefill_tie_breaks_on_prefix_overlap_then_id():
    cands = [worker("p1", "prefill", queued=10, cached=2), worker("p0", "prefill", queued=10, cached=2),
             worker("p2", "prefill", queued=10, cached=1)]
    assert pick_prefill(cands, CONFIG)[0].worker_id == "p0"
    cands.append(worker("p3", "prefill", queued=10, cached=4))
    assert pick_prefill(cands, CONFIG)[0].worker_id == "p3"


def test_no_prefill_worker_means_local():
    decision = route(req(500), [worker("d0")], CONFIG)
    assert decision.kind is RouteKind.LOCAL and decision.reason == "no prefill workers"


def test_saturated_prefill_pool_means_local():
    config = PolicyConfig(disagg_threshold_tokens=64, max_queued_prefill_tokens=1000, policy="least_loaded")
    cands = [worker("d0"), worker("p0", "prefill", queued=1001), worker("p1", "prefill", queued=5000)]
    decision = route(req(500), cands, config)
    assert decision.kind is RouteKind.LOCAL and "saturated" in decision.reason
    cands.append(worker("p2", "prefill", queued=1000))
    assert route(req(500), cands, config).prefill_id == "p2"


def test_worker_without_load_report_counts_as_idle_with_all_blocks_free():
    cands = [worker("d0", running=1), worker("d1", load=False, total=20)]
    assert pick_decode(req(100), cands)[0].worker_id == "d1"
    assert pick_decode(req(400), cands)[0].worker_id == "d0"  # 26 blocks never fit in d1's 20


def test_exclude_skips_a_failed_worker():
    cands = [worker("d0"), worker("d1", running=3)]
    assert route(req(10), cands, CONFIG, exclude={"d0"}).decode_id == "d1"


def test_fully_cached_prompt_has_no_uncached_tokens():
    decision = route(req(160), [worker("d0", cached=10), worker("p0", "prefill")], CONFIG)
    assert decision.kind is RouteKind.LOCAL and decision.reason.startswith("0 uncached")


def test_threshold_zero_disaggregates_everything_uncached():
    config = PolicyConfig(disagg_threshold_tokens=0, rates=RatesConfig(remote_overhead_s=0.0, local_overhead_s=0.0))
    assert route(req(1), [worker("d0"), worker("p0", "prefill")], config).kind is RouteKind.REMOTE


def test_config_rejects_negative_values():
    with pytest.raises(ValueError, match="disagg_threshold_tokens"):
        PolicyConfig(disagg_threshold_tokens=-1)
