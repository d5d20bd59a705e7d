"""``baton bench serve``: exact statistics on hand-made samples, workloads, and one tiny real run."""

from __future__ import annotations

import json
import math

import pytest

from bench import serve
from bench.serve import Planned, Result


def _result(ttft_s: float, e2e_s: float, output_tokens: int, ok: bool = True) -> Result:
    itl = (e2e_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else 0.0
    return Result(ok=ok, prompt_tokens=10, output_tokens=output_tokens, ttft_s=ttft_s, e2e_s=e2e_s,
                  itl_s=(itl,) * (output_tokens - 1))


def test_percentile_interpolates_linearly():
    values = [4.0, 1.0, 3.0, 2.0]
    assert serve.percentile(values, 0) == 1.0
    assert serve.percentile(values, 100) == 4.0
    assert serve.percentile(values, 50) == 2.5
    assert serve.percentile(values, 90) == pytest.approx(3.7)
    assert serve.percentile(list(range(101)), 99) == 99.0
    assert serve.percentile([7.0], 99) == 7.0
    assert math.isnan(serve.percentile([], 50))


def test_tpot_excludes_the_first_token():
    assert serve.tpot_s(_result(0.1, 0.5, 5)) == pytest.approx(0.1)
    assert serve.tpot_s(_result(0.1, 0.1, 1)) is None


def test_goodput_counts_requests_meeting_both_slos():
    results = [
        _result(0.1, 0.5, 5),  # ttft 100 ms, tpot 100 ms: meets both
        _result(0.3, 0.7, 5),  # ttft 300 ms: misses TTFT
        _result(0.1, 0.9, 5),  # tpot 200 ms: misses TPOT
        _result(0.05, 0.05, 1),  # one token: no TPOT, meets TTFT
        _result(0.0, 0.0, 0, ok=False),  # failed never counts
    ]
    assert serve.goodput(results, 2.0, slo_ttft_ms=200, slo_tpot_ms=100) == 1.0
    assert serve.goodput(results, 2.0, slo_ttft_ms=300, slo_tpot_ms=200) == 2.0
    assert serve.goodput(results, 0.0, slo_ttft_ms=300, slo_tpot_ms=200) == 0.0


def test_summarize_reports_counts_throughput_and_distributions():
    results = [_result(0.1, 0.5, 5), _result(0.3, 0.7, 5), _result(0.0, 0.0, 0, ok=False)]
    s = serve.summarize(results, 2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert (s["input_tokens"], s["output_tokens"]) == (20, 10)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 5.0
    assert s["goodput"] == 0.5 and s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["ttft_ms"] == pytest.approx({"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0})
    assert s["tpot_ms"] == pytest.approx({"mean": 100.0, "p50": 100.0, "p90": 100.0, "p99": 100.0})
    assert s["e2e_ms"]["mean"] == pytest.approx(600.0)


def test_arrivals_are_seeded_and_have_the_requested_mean_rate():
    a = serve.arrival_offsets(4000, rate=8.0, burstiness=1.0, seed=3)
    assert a == serve.arrival_offsets(4000, rate=8.0, burstiness=1.0, seed=3)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert 4000 / a[-1] == pytest.approx(8.0, rel=0.05)
    bursty = serve.arrival_offsets(4000, rate=8.0, burstiness=0.25, seed=3)
    assert 4000 / bursty[-1] == pytest.approx(8.0, rel=0.15)
    assert serve.arrival_offsets(3, rate=math.inf, burstiness=1.0, seed=0) == [0.0, 0.0, 0.0]


def test_workloads_fit_the_context_and_share_prefixes():
    chats = serve.shared_prefix(12, vocab_size=384, seed=0, system_tokens=32, systems=2)
    assert len(chats) == 12
    assert sum(c.prompt[:32] == chats[0].prompt[:32] for c in chats) >= 6
    mixed = serve.long_prompt(200, vocab_size=384, seed=0, long_tokens=900)
    assert sum(len(p.prompt) == 900 for p in mixed) == 20  # exactly 10%, at seeded positions
    assert [len(p.prompt) == 900 for p in mixed] != [len(p.prompt) == 900 for p in serve.long_prompt(
        200, vocab_size=384, seed=1, long_tokens=900)]
    fitted = serve.fit(mixed, max_model_len=512, max_prompt=None, max_output=8)
    assert all(len(p.prompt) + p.max_tokens <= 512 and p.max_tokens <= 8 for p in fitted)
    assert all(4 <= t < 384 for p in fitted for t in p.prompt)


def test_trace_times_are_used_unless_a_rate_is_given(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_token_ids": [5, 6], "max_tokens": 3, "arrival_s": 0.5}\n\n'
                     '{"prompt": "hello", "max_tokens": 2, "arrival_s": 0.25}\n')
    planned = serve.load_trace(trace, None)
    assert planned == [Planned(0.5, [5, 6], 3), Planned(0.25, "hello", 2)]
    assert serve.schedule(planned, serve.default_rate(planned, None), 1.0, 0) == [0.5, 0.25]
    assert serve.default_rate(planned, 4.0) == 4.0
    assert serve.default_rate([Planned(None, [5], 1)], None) == 1.0


_COMMON = ["--num-requests", "6", "--rate", "20", "--max-prompt-len", "48", "--max-output-len", "8"]


def _check_report(out_dir, rc: int) -> None:
    report = json.loads((out_dir / "serve.json").read_text())
    (run,) = report["runs"]
    assert rc == 0
    assert (run["num_requests"], run["completed"], run["failed"]) == (6, 6, 0)
    assert len(run["requests"]) == 6
    assert run["output_tokens"] == sum(r["output_tokens"] for r in run["requests"])
    assert all(r["output_tokens"] == p.max_tokens for r, p in zip(run["requests"], _planned()))
    assert all(r["prompt_tokens"] == len(p.prompt) for r, p in zip(run["requests"], _planned()))
    assert run["ttft_ms"]["p50"] > 0 and run["e2e_ms"]["p50"] >= run["ttft_ms"]["p50"]
    assert (out_dir / "serve_cdf.png").stat().st_size > 0


def _planned() -> list[Planned]:
    """What the tiny runs below send (the tiny preset: vocabulary 4096, context 2048)."""
    args = serve._parse(["--router", "x", *_COMMON])
    return serve.build(args, serve.pb.ModelInfoResponse(vocab_size=4096, max_model_len=2048))


def test_tiny_run_writes_json_whose_counts_match_the_requests_sent_grpc_and_http(tmp_path, tmp_path_factory):
    from tests.tiny_model import shared_tiny
    from tests.integration.cluster import free_port
    from tests.integration.test_e2e import start_cluster

    model_dir = shared_tiny(tmp_path_factory)
    (tmp_path / "logs").mkdir()
    http_port = free_port()
    cluster, redis = start_cluster(model_dir, tmp_path / "logs", prefill=1, decode=1,
                                   router_args=("--http-port", str(http_port)))
    common = [*_COMMON, "--warmup", "1"]
    try:
        rc_grpc = serve.main(["--router", cluster.router.address, *common, "--out", str(tmp_path / "grpc")])
        rc_http = serve.main(["--router", f"127.0.0.1:{http_port}", "--protocol", "http", *common,
                              "--out", str(tmp_path / "http")])
    finally:
        cluster.stop_all()
        redis.stop()
    _check_report(tmp_path / "grpc", rc_grpc)
    _check_report(tmp_path / "http", rc_http)
    http = json.loads((tmp_path / "http" / "serve.json").read_text())
    assert http["config"]["protocol"] == "http"
