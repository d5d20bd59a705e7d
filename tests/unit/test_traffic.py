"""`plan --from-traffic`: windows over the router's own request histograms, percentiles as PromQL computes
them, the prefill pool's own traffic (remote share, prompt mix, cached tokens), correction factors from measured vs
predicted latency, and known windows -> known plans (pure), then through a real in-process router's Admin service
(GetTraffic, Plan(from_traffic) with the router's policy, `baton admin status`)."""

from __future__ import annotations

import io
import math
import time
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram as PromHistogram

from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.admin import cli as admin_cli, planner
from router.admin.convert import traffic_terms
from router.metrics import TOKEN_BUCKETS, RouterMetrics
from router.trace import RequestTrace
from router.admin.traffic import (Histogram, Percentiles, TrafficRecorder, Window, corrections, histogram_of,
                                  isl_mix_of)
from router.config import RouterConfig
from router.routing.policy import PolicyConfig
from router.server import start_router
from tests.redis_server import RedisServer, require_redis_server
from tests.unit.test_admin_server import NS, register, start, worker
from tests.unit.test_router_server import LoopThread, make_model_folder

PREFILL = planner.PrefillProfile(prompt_lens=(128, 4096), tokens_per_s=(1e4, 1e4))  # D = 100 ms at isl 1000
DECODE = planner.DecodeProfile(batch_sizes=(1, 8, 32, 64), itl_s=(0.010, 0.012, 0.020, 0.036))


def finish(metrics: RouterMetrics, *, ttft_s: float, gaps_s: list[float], isl: int, osl: int,
           cached_on_p: int | None = None) -> None:
    """One request taken in and finished, recorded the way the relay records it; with ``cached_on_p``, prefilled on
    a prefill worker that found that many of its prompt tokens cached (else on the decode worker)."""
    metrics.received.inc()
    if cached_on_p is not None:
        metrics.remote_prefill(num_prompt_tokens=isl, num_cached_tokens=cached_on_p)
    trace = RequestTrace(clock=lambda: 0.0)
    trace.first_token_s, trace.token_gaps_s = ttft_s, gaps_s
    metrics.request_finished(trace, num_prompt_tokens=isl, num_output_tokens=osl, finished_reason="length")


def test_histogram_quantile_interpolates_inside_the_bucket_like_promql():
    h = Histogram(bounds=(1.0, 2.0, 4.0, math.inf), cumulative=(0.0, 10.0, 10.0, 12.0), total=0.0)
    assert h.quantile(0.5) == pytest.approx(1.6)  # rank 6 of 12: 6 of the 10 inside (1, 2]
    assert h.quantile(0.99) == 4.0  # in the +Inf bucket: the last finite bound
    assert Histogram((1.0, math.inf), (0.0, 0.0), 0.0).quantile(0.5) is None


def test_a_window_counts_the_requests_it_covers_and_their_means():
    metrics = RouterMetrics()
    recorder = TrafficRecorder(metrics.registry, start_s=0.0, period_s=10.0)
    for _ in range(10):
        finish(metrics, ttft_s=0.05, gaps_s=[0.02] * 19, isl=100, osl=20)
    window = recorder.window(now_s=60.0, window_s=300.0)  # the router is younger than the window
    assert (window.span_s, window.num_requests, window.mean_isl, window.mean_osl) == (60.0, 10, 100.0, 20.0)
    assert window.rate_per_s == pytest.approx(10 / 60)
    assert 0.04 < window.ttft.p50_s <= 0.06 and window.ttft.count == 10  # the (0.04, 0.06] bucket
    assert 0.01 < window.itl.p90_s <= 0.025 and window.itl.count == 190
    for _ in range(5):
        finish(metrics, ttft_s=2.0, gaps_s=[0.02], isl=300, osl=2)
    recent = recorder.window(now_s=90.0, window_s=30.0)  # from the copy taken at 60 s
    assert (recent.span_s, recent.num_requests, recent.mean_isl, recent.mean_osl) == (30.0, 5, 300.0, 2.0)
    assert 1.0 < recent.ttft.p50_s <= 2.5
    assert recorder.window(now_s=200.0, window_s=60.0).num_requests == 0  # nothing since 90 s


def test_the_rate_is_what_arrives_not_what_finishes():
    # an overload: 30 requests arrive in 60 s, 10 of them finish; the planner must read 0.5/s, not 0.17/s
    metrics = RouterMetrics()
    recorder = TrafficRecorder(metrics.registry, start_s=0.0, period_s=10.0)
    for _ in range(10):
        finish(metrics, ttft_s=0.05, gaps_s=[0.02] * 19, isl=100, osl=20)
    metrics.received.inc(20)  # still queued or refused at the admission limit
    window = recorder.window(now_s=60.0, window_s=300.0)
    assert (window.num_requests, window.num_arrived, window.mean_isl) == (10, 30, 100.0)
    assert window.rate_per_s == pytest.approx(0.5)
    assert "30 requests arrived" in {t.name: t.note for t in traffic_terms(window)}["rate"]
    later = recorder.window(now_s=90.0, window_s=30.0)  # from the copy taken at 60 s: nothing since
    assert (later.num_arrived, later.rate_per_s) == (0, 0.0)


def test_the_window_reports_the_prefill_pools_own_traffic():
    # 20 requests arrive in 60 s, 10 finish: 4 prefilled on D (short), 6 on P, which found 1,200 of their 12,000
    # prompt tokens cached
    metrics = RouterMetrics()
    recorder = TrafficRecorder(metrics.registry, start_s=0.0, period_s=10.0)
    for _ in range(4):
        finish(metrics, ttft_s=0.05, gaps_s=[0.02], isl=40, osl=2)
    for isl, cached in ((1000, 0), (1000, 200), (1000, 0), (3000, 1000), (3000, 0), (3000, 0)):
        finish(metrics, ttft_s=0.3, gaps_s=[0.02], isl=isl, osl=2, cached_on_p=cached)
    metrics.received.inc(10)
    window = recorder.window(now_s=60.0, window_s=300.0)
    assert (window.num_requests, window.num_arrived, window.num_remote) == (10, 20, 6)
    assert window.remote.rate_per_s == pytest.approx(20 / 60 * 6 / 10)  # the arrivals' rate x the remote share
    assert window.remote.mean_isl == 2000 and window.remote.cached_fraction == pytest.approx(0.1)
    middles = (math.sqrt(500 * 1000), math.sqrt(2000 * 5000))  # buckets (500, 1000], (2000, 5000]
    scale = 2000 / (0.5 * middles[0] + 0.5 * middles[1])
    assert [x for pair in window.remote.isl_mix for x in pair] == pytest.approx(
        [middles[0] * scale, 0.5, middles[1] * scale, 0.5])
    assert window.mean_isl == pytest.approx((4 * 40 + 12_000) / 10)  # the decode side still sees every request
    traffic = planner.Traffic(rate_per_s=window.rate_per_s, mean_isl=window.mean_isl, mean_osl=2.0,
                              remote=window.remote)
    assert traffic.prefill_side() is window.remote
    assert {t.name: t.value for t in traffic_terms(window)}["remote prefills"] == 6


def test_an_older_registry_without_the_remote_series_plans_as_before():
    registry = CollectorRegistry()
    prompt = PromHistogram("baton:request_prompt_tokens", "", buckets=TOKEN_BUCKETS, registry=registry)
    output = PromHistogram("baton:request_generation_tokens", "", buckets=TOKEN_BUCKETS, registry=registry)
    ttft = PromHistogram("baton:time_to_first_token_seconds", "", registry=registry)
    received = Counter("baton:requests_received_total", "", registry=registry)
    recorder = TrafficRecorder(registry, start_s=0.0)
    for _ in range(6):
        received.inc(), prompt.observe(1000), output.observe(200), ttft.observe(0.3)
    window = recorder.window(now_s=60.0, window_s=300.0)
    assert window.num_requests == 6 and window.remote is None and window.num_remote is None
    found, _ = corrections(window, PREFILL, DECODE, prefill_workers=1, decode_workers=1)
    services = planner.service_mix(PREFILL, 1000.0, window.isl_mix)
    assert found.prefill == pytest.approx(window.ttft.p90_s / planner.prefill_ttft_p90_s(0.1, services, 1)[1])


def window(**overrides) -> Window:
    fields = dict(span_s=60.0, num_requests=600, rate_per_s=10.0, mean_isl=1000.0, mean_osl=200.0,
                  ttft=Percentiles(count=600, p50_s=0.3, p90_s=0.52, p99_s=0.9),
                  itl=Percentiles(count=10_000, p50_s=0.012, p90_s=0.016, p99_s=0.03))
    return Window(**{**fields, **overrides})


def test_corrections_are_measured_over_predicted_latency():
    found, terms = corrections(window(), PREFILL, DECODE, prefill_workers=2, decode_workers=2)
    # prefill: 2 workers behind one queue at rho 0.5, D 100 ms: Erlang C 1/3, 100 + 50 ln(10/3) = 160.2 ms predicted
    assert found.prefill == pytest.approx(0.52 / (0.1 + 0.05 * math.log(10 / 3)))
    # decode: Little gives 10 * 200 * 12 ms / 2 = 12 seqs per worker; the profile's ITL there is 13.33 ms
    assert found.decode == pytest.approx(0.016 / 0.0133333333)
    assert [t.name for t in terms] == ["measured correction", "measured correction"]


def test_the_prefill_correction_predicts_the_queue_the_planner_sizes():
    # half the requests prefilled on P with 20% of their tokens cached, routed round-robin: the prediction the
    # measured TTFT p90 divides is n x M/G/1 at 5/s of 80 ms prompts
    remote = planner.RemotePrefill(rate_per_s=5.0, mean_isl=1000.0, cached_fraction=0.2)
    found, terms = corrections(window(remote=remote, num_remote=300), PREFILL, DECODE, prefill_workers=2,
                               decode_workers=2, dispatch="split")
    _, split_s = planner.prefill_ttft_p90_s(5.0, ((0.08, 1.0),), 2, "split")
    assert split_s == pytest.approx(0.08 + 0.08 / (2 * 0.8) * math.log(10 * 0.2))  # rho 0.2 per worker
    assert found.prefill == pytest.approx(0.52 / split_s) and "split" in terms[0].note
    few, terms = corrections(window(remote=remote, num_remote=3), PREFILL, DECODE, prefill_workers=2,
                             decode_workers=2)
    assert few.prefill == 1.0 and "prefilled on a prefill worker" in terms[0].note


def test_the_prompt_mix_comes_from_the_histogram_with_the_exact_mean():
    lengths = [300.0] * 6 + [3000.0] * 3 + [30_000.0]  # buckets (200, 500], (2000, 5000], (20000, 50000]
    histogram = histogram_of(lengths, TOKEN_BUCKETS)
    mix = isl_mix_of(histogram)
    middles = (math.sqrt(200 * 500), math.sqrt(2000 * 5000), math.sqrt(20_000 * 50_000))
    scale = (sum(lengths) / 10) / (0.6 * middles[0] + 0.3 * middles[1] + 0.1 * middles[2])
    expected = [(m * scale, w) for m, w in zip(middles, (0.6, 0.3, 0.1))]
    assert [x for pair in mix for x in pair] == pytest.approx([x for pair in expected for x in pair])
    assert sum(x * w for x, w in mix) == pytest.approx(sum(lengths) / 10)  # the mean is exact
    assert isl_mix_of(histogram_of([], TOKEN_BUCKETS)) == ()
    past = isl_mix_of(histogram_of([200_000.0], TOKEN_BUCKETS))  # above the last bound: its double, scaled
    assert past[0] == pytest.approx((200_000.0, 1.0))


def test_littles_law_takes_the_mean_gap_and_the_batch_bound_the_p90():
    # gaps: mean 12 ms (the profile's at the batch Little gives), p90 2x the profile: a tail, not a slower worker
    itl = Percentiles(count=10_000, p50_s=0.011, p90_s=0.024, p99_s=0.05, mean_s=0.012)
    found, terms = corrections(window(itl=itl), PREFILL, DECODE, prefill_workers=2, decode_workers=2)
    # Little with the mean: 10 * 200 * 12 ms / 2 = 12 seqs per worker, where the profile says 13.33 ms
    assert found.decode == pytest.approx(0.024 / 0.0133333333)
    assert found.decode_mean == pytest.approx(0.012 / 0.0133333333)
    assert terms[-1].name == "measured mean correction"
    slo = planner.Slo(ttft_p90_s=0.5, itl_p90_s=0.036)
    traffic = planner.Traffic(rate_per_s=10.0, mean_isl=1000.0, mean_osl=200.0)
    p90_only = planner.plan_pools(slo, traffic, PREFILL, DECODE,
                                  corrections=planner.Corrections(decode=found.decode))
    both = planner.plan_pools(slo, traffic, PREFILL, DECODE, corrections=found)
    # the p90 bounds the batch (ITL x 1.8 <= 36 ms: 20 ms of profile, batch 32) in both; sequences live 200 mean
    # gaps (0.9 x 20 ms = 18 ms): 10 * 200 * 18 ms = 36 of them, 2 workers -- not 200 p90 gaps (72 -> 3 workers)
    assert (both.decode, p90_only.decode) == (2, 3)


def test_too_little_data_or_no_pool_means_no_correction():
    few, _ = corrections(window(num_requests=3), PREFILL, DECODE, prefill_workers=2, decode_workers=2)
    assert few == planner.Corrections(prefill=1.0, decode=1.0)
    local, terms = corrections(window(), PREFILL, DECODE, prefill_workers=0, decode_workers=2)
    assert local.prefill == 1.0 and "local prefill" in terms[0].note
    unstable, terms = corrections(window(), PREFILL, DECODE, prefill_workers=1, decode_workers=2)
    assert unstable.prefill == 1.0 and "unstable" in terms[0].note


def test_a_known_window_gives_a_known_plan():
    slo = planner.Slo(ttft_p90_s=0.5, itl_p90_s=0.018)
    traffic = planner.Traffic(rate_per_s=10.0, mean_isl=1000.0, mean_osl=200.0)
    trusting = planner.plan_pools(slo, traffic, PREFILL, DECODE)
    assert (trusting.prefill, trusting.decode) == (2, 2)
    measured, _ = corrections(window(), PREFILL, DECODE, prefill_workers=2, decode_workers=2)
    corrected = planner.plan_pools(slo, traffic, PREFILL, DECODE, corrections=measured)
    # TTFT runs 3.2x the model: 2 workers now predict 520 ms > 500; decode's ITL 1.2x: 17 seqs fit, 36 run
    assert (corrected.prefill, corrected.decode) == (3, 3)


# ---- through a real router's Admin service ----------------------------------------------------------------

@pytest.fixture(scope="module")
def router(tmp_path_factory) -> Iterator[tuple]:
    require_redis_server()
    loop = LoopThread()
    with RedisServer.start() as server:
        running = start(loop, server, make_model_folder(tmp_path_factory.mktemp("m") / "tiny"), NS, None)
        try:
            yield running, server, loop
        finally:
            loop.run(running.stop(0.5))
            loop.close()


def test_plan_from_traffic_through_the_admin_service(router):
    running, server, loop = router
    register(loop, server, (worker("d1", "decode"), None))  # a registry entry: one decode worker is live
    stub = pb_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{running.port}"))
    request = pb.PlanRequest(ttft_p90_ms=500, itl_p90_ms=18, from_traffic=True, traffic_window_s=600,
                             prefill_curve=pb.PrefillCurve(prompt_lens=[128, 4096], tokens_per_s=[1e4, 1e4]),
                             decode_curve=pb.DecodeCurve(batch_sizes=[1, 8, 32, 64], itl_ms=[10, 12, 20, 36]))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Plan(request, timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no finished requests" in refused.value.details()
    for _ in range(8):
        finish(running.relay.metrics, ttft_s=0.05, gaps_s=[0.012] * 30, isl=1000, osl=31)
    seen = stub.GetTraffic(pb.GetTrafficRequest(window_s=600), timeout=5)
    assert (seen.num_requests, seen.mean_isl, seen.mean_osl, seen.ttft.count, seen.itl.count) == (8, 1000, 31, 8, 240)
    plan = stub.Plan(request, timeout=5)
    assert plan.traffic.num_requests == 8 and plan.traffic.rate == pytest.approx(8 / plan.traffic.window_s, rel=0.05)
    terms = {(t.pool, t.name): t for t in plan.terms}
    assert terms[("traffic", "mean isl")].value == 1000 and terms[("traffic", "rate")].value == plan.traffic.rate
    assert terms[("prefill", "measured correction")].value == 1.0  # no prefill workers registered: local TTFT
    assert "no prefill workers" in terms[("prefill", "measured correction")].note
    decode_correction = terms[("decode", "measured correction")].value
    assert decode_correction != 1.0 and "ITL p90" in terms[("decode", "measured correction")].note
    mean_correction = terms[("decode", "measured mean correction")].value  # the ITL histogram's sum / count
    local = planner.RemotePrefill(rate_per_s=0.0, mean_isl=1000)  # every request prefilled on D: none on P
    traffic = planner.Traffic(rate_per_s=plan.traffic.rate, mean_isl=1000, mean_osl=31, remote=local)
    expected = planner.plan_pools(planner.Slo(ttft_p90_s=0.5, itl_p90_s=0.018), traffic,
                                  PREFILL, DECODE, corrections=planner.Corrections(decode=decode_correction,
                                                                                   decode_mean=mean_correction))
    assert (plan.prefill_raw, plan.decode_raw) == (expected.prefill_plan.raw, expected.decode_plan.raw)
    assert plan.prefill_raw == 1 and terms[("traffic", "remote prefills")].value == 0
    out = io.StringIO()
    assert admin_cli.main(["--router", f"127.0.0.1:{running.port}", "--json", "plan", "--ttft-p90", "500",
                           "--itl-p90", "18", "--from-traffic", "--window", "600", "--prefill-correction", "3"],
                          out=out, err=io.StringIO()) == 1  # no profile stored in Redis and none given
    status = io.StringIO()
    assert admin_cli.main(["--router", f"127.0.0.1:{running.port}", "status"], out=status) == 0
    text = status.getvalue()
    assert "8 requests" in text and "mean isl 1000, osl 31" in text
    ttft_row = next(line.split() for line in text.splitlines() if line.startswith("TTFT ms"))
    assert ttft_row[2] == "8" and 40 < float(ttft_row[3]) <= 60


def test_plan_without_traffic_flags_needs_rate_isl_osl(router):
    running, _, _ = router
    err = io.StringIO()
    code = admin_cli.main(["--router", f"127.0.0.1:{running.port}", "plan", "--ttft-p90", "500", "--itl-p90",
                           "18", "--rate", "1"], out=io.StringIO(), err=err)
    assert code == 2 and "--rate, --isl and --osl, or --from-traffic" in err.getvalue()


def test_the_admin_service_plans_with_its_routers_policy(tmp_path):
    require_redis_server()
    loop = LoopThread()
    with RedisServer.start() as server:
        config = RouterConfig(model_path=make_model_folder(tmp_path / "tiny"), redis_url=server.url, ns="rr",
                              host="127.0.0.1", port=0, worker_list_ttl_s=0.0,
                              policy=PolicyConfig(policy="round_robin"))
        running = loop.run(start_router(config))
        try:
            time.sleep(1.0)  # a window of at least a second: 8 requests in it are a rate of 8/s or less
            for cached in (0, 1000) * 4:  # every request prefilled on P, 25% of the tokens cached
                finish(running.relay.metrics, ttft_s=0.05, gaps_s=[0.012] * 30, isl=2000, osl=31, cached_on_p=cached)
            stub = pb_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{running.port}"))
            plan = stub.Plan(pb.PlanRequest(
                ttft_p90_ms=500, itl_p90_ms=18, from_traffic=True, traffic_window_s=600, prefill_correction=1.0,
                prefill_curve=pb.PrefillCurve(prompt_lens=[128, 4096], tokens_per_s=[1e4, 1e4]),
                decode_curve=pb.DecodeCurve(batch_sizes=[1, 8, 32, 64], itl_ms=[10, 12, 20, 36])), timeout=5)
        finally:
            loop.run(running.stop(0.5))
            loop.close()
    terms = {(t.pool, t.name): t for t in plan.terms}
    assert "n x M/G/1 (split: round_robin, random)" in terms[("prefill", "predicted TTFT p90")].note
    assert "25.0% of tokens cached" in terms[("prefill", "service time D")].note
    remote = planner.RemotePrefill(rate_per_s=plan.traffic.rate, mean_isl=2000.0, isl_mix=((2000.0, 1.0),),
                                   cached_fraction=0.25)
    traffic = planner.Traffic(rate_per_s=plan.traffic.rate, mean_isl=2000, mean_osl=31, remote=remote)
    split = planner.size_prefill(planner.Slo(ttft_p90_s=0.5, itl_p90_s=0.018), traffic, PREFILL, 1.0,
                                 planner.PlannerConfig(), dispatch="split")
    pooled = planner.size_prefill(planner.Slo(ttft_p90_s=0.5, itl_p90_s=0.018), traffic, PREFILL, 1.0,
                                  planner.PlannerConfig())
    assert plan.prefill_raw == split.raw >= pooled.raw
