"""``baton bench trace`` (bench/trace_replay/): the replay's plumbing on exact, hand-made inputs — the slice
scaled and cut to the context, the ceiling an unbounded cache reaches, the tier configurations, the accounting
(hits as the workers report them), the gRPC client against a fake router (cached tokens from each request's
usage, failures and the run bound), aiperf's records and the scaled trace file it replays. The replay against a
real platform is ``tests/integration/test_trace_replay.py`` (slow)."""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import pytest

from bench import trace_replay as tr
from workload.trace import Scale, TraceRequest, prompt_token_ids

SCALE = Scale(length_scale=32)  # one trace block = one 16-token KV block


def _req(ts: int, blocks: list[int], *, tail: int = 0, out: int = 64) -> TraceRequest:
    """A trace request of ``blocks`` full 512-token blocks, or the last one partial (``tail`` tokens)."""
    length = 512 * len(blocks) - (512 - tail if tail else 0)
    return TraceRequest(timestamp_ms=ts, input_length=length, output_length=out, hash_ids=tuple(blocks))


def _replay(prompt_blocks: list[tuple[int, ...]], tails: list[int] | None = None) -> list[tr.ReplayRequest]:
    tails = tails or [0] * len(prompt_blocks)
    trace = [_req(1000 * i, list(b), tail=t) for i, (b, t) in enumerate(zip(prompt_blocks, tails))]
    return tr.scaled_requests(trace, SCALE, vocab_size=1000, max_model_len=4096)


def test_the_slice_is_scaled_made_relative_and_cut_at_its_end():
    trace = [_req(5000, [1, 2, 3], tail=100, out=100), _req(7000, [1, 2, 4, 5, 6, 7, 8, 9])]
    out = tr.scaled_requests(trace, Scale(length_scale=32, time_scale=0.5), vocab_size=1000, max_model_len=120)
    first, second = out
    assert (first.arrival_s, second.arrival_s) == (0.0, 1.0)  # 2 s apart, times 0.5, from the first
    assert len(first.prompt) == 32 + 4 and first.max_tokens == 4 and not first.cut  # ceil(100 / 32) = 4
    assert first.prompt == prompt_token_ids(trace[0], Scale(length_scale=32), 1000)
    assert second.cut and len(second.prompt) == 120 - 2  # 8 blocks = 128 tokens + 2 out > 120: the end goes
    assert second.prompt == prompt_token_ids(trace[1], Scale(length_scale=32), 1000)[:118]
    assert second.prompt[:32] == first.prompt[:32]  # the shared leading blocks survive the cut
    assert tr.scaled_requests([], SCALE, vocab_size=1000, max_model_len=100) == []


def test_the_ceiling_counts_leading_blocks_seen_before_capped_like_the_engine():
    requests = _replay([(1, 2, 3), (1, 2, 4), (1, 2, 3, 5), (9, 2, 3), (1, 2, 3)], tails=[0, 0, 7, 0, 0])
    # #1 shares [1, 2]; #2 shares [1, 2, 3] and its partial last block is never cached; #3 shares nothing (its
    # chain starts elsewhere, though 2, 3 follow); #4 is all cached but must compute its last token: 2 of 3
    assert tr.reusable_blocks(requests, 16) == [0, 2, 3, 0, 2]
    # an LRU of 3 blocks for everything: #1 uses 1, 1-2 and adds 1-2-4, evicting 1-2-3 before #2 asks for it;
    # #3's three new blocks evict everything #4 could use
    assert tr.reusable_blocks(requests, 16, capacity=3) == [0, 2, 2, 0, 0]
    # full blocks: 1, 1-2, 1-2-3, 1-2-4, 9, 9-2, 9-2-3 (#2's partial last block is not one)
    assert tr.working_set_blocks(requests, 16) == 7
    # the working set + the two longest requests (50 or 51 tokens with their 2 output tokens: 4 blocks) + slack
    assert tr.oracle_pool_blocks(requests, 16, in_flight=2) == 7 + 2 * 4 + 64


def test_each_configuration_is_the_flags_baton_up_takes():
    kwargs = dict(num_blocks=100, host_blocks=400, store_memory="256 MB", oracle_blocks=9999, store_buffer_blocks=32)
    assert tr.config_flags("none", **kwargs) == ["--num-blocks", "100"]
    assert tr.config_flags("host", **kwargs) == ["--num-blocks", "100", "--kv-host-blocks", "400"]
    assert tr.config_flags("host+store", **kwargs) == [
        "--num-blocks", "100", "--kv-host-blocks", "400", "--kv-store", "--kv-store-memory", "256 MB",
        "--kv-store-buffer-blocks", "32"]
    assert tr.config_flags("oracle", **kwargs) == ["--num-blocks", "9999"]
    with pytest.raises(ValueError, match="unknown configuration"):
        tr.config_flags("ssd", **kwargs)


def test_the_summary_counts_what_the_workers_reported_on_completed_requests():
    outcomes = [
        tr.Outcome(index=0, ok=True, prompt_tokens=100, cached_tokens=0, output_tokens=4, ttft_s=0.010,
                   route_kind="remote"),
        tr.Outcome(index=1, ok=True, prompt_tokens=100, cached_tokens=64, output_tokens=4, ttft_s=0.020,
                   route_kind="local"),
        tr.Outcome(index=2, ok=True, prompt_tokens=200, cached_tokens=96, output_tokens=2, ttft_s=0.030,
                   route_kind="local"),
        tr.Outcome(index=3, ok=False, prompt_tokens=500, error="run bound"),
        tr.Outcome(index=4, ok=False, prompt_tokens=500, error="run bound"),
    ]
    s = tr.summarize(outcomes, duration_s=2.0, reusable={1, 2, 3})
    assert (s["requests"], s["completed"], s["errors"]) == (5, 3, {"run bound": 2})
    assert s["ttft_reusable_ms"] == {"p50": pytest.approx(25.0), "p90": pytest.approx(29.0), "requests": 2}
    assert (s["prompt_tokens"], s["cached_tokens"]) == (400, 160) and s["hit_rate"] == 0.4
    assert s["ttft_ms"]["p50"] == pytest.approx(20.0) and s["ttft_ms"]["p90"] == pytest.approx(28.0)
    assert s["requests_per_s"] == 1.5 and s["output_tokens_per_s"] == 5.0 and s["prompt_tokens_per_s"] == 200.0
    assert s["routes"] == {"remote": 1, "local": 2}
    assert math.isnan(tr.summarize([], 0.0)["hit_rate"])


def test_store_tokens_and_tier_counters_are_read_from_what_workers_say():
    assert tr.store_tokens_of("fetched 48 prefix tokens from the store; recomputed 2 blocks past them") == 48
    assert tr.store_tokens_of("cost: 3 of 9 prompt tokens cached") == 0
    text = "\n".join([
        "# HELP baton:kv_host_tier_loaded_total Prefix blocks copied back up",
        'baton:kv_host_tier_loaded_total{worker_id="decode-0"} 7.0',
        'baton:kv_host_tier_loaded_created{worker_id="decode-0"} 1.7e+09',
        'baton:kv_store_fetch_failures_total{reason="missing",worker_id="decode-0"} 2.0',
        'baton:kv_store_fetch_failures_total{reason="timeout",worker_id="decode-0"} 1.0',
        'baton:prefix_cache_hits_total{worker_id="decode-0"} 12.0',
        'baton:num_requests_running{worker_id="decode-0"} 3.0',
    ])
    assert tr.parse_counters(text) == {"kv_host_tier_loaded": 7.0, "kv_store_fetch_failures": 3.0,
                                       "prefix_cache_hits": 12.0}


def test_the_table_compares_each_configuration_with_none_and_the_oracle():
    def run(config, hit, p50, pass_=1, passes=1):
        return {"config": config, "hit_rate": hit, "ttft_ms": {"p50": p50, "p90": 2 * p50}, "requests": 10,
                "ttft_reusable_ms": {"p50": p50 / 2}, "completed": 10, "requests_per_s": 1.0,
                "output_tokens_per_s": 10.0, "loadavg_before": "1 1 1", "loadavg_after": "2 2 2", "pass_": pass_,
                "passes": passes}
    text = tr.table({"runs": [run("none", 0.05, 30.0), run("host+store", 0.18, 33.0), run("oracle", 0.2, 30.0)]})
    rows = text.splitlines()
    assert rows[2].startswith("| none | 5.0% | 1.00x | 0.25x | 30.0 | 60.0 | 1.00x | 15.0 | 1.00x |")
    assert rows[3].startswith("| host+store | 18.0% | 3.60x | 0.90x | 33.0 | 66.0 | 1.10x | 16.5 | 1.10x |")
    # two passes (ABBA): each run is compared with (a) and the oracle of its own pass
    runs = [run("none", 0.05, 30.0, 1, 2), run("oracle", 0.2, 30.0, 1, 2), run("oracle", 0.2, 60.0, 2, 2),
            run("none", 0.04, 90.0, 2, 2)]
    rows = tr.table({"runs": runs}).splitlines()
    assert rows[4].startswith("| oracle #2 | 20.0% | 5.00x | 1.00x | 60.0 |")
    assert rows[5].startswith("| none #2 | 4.0% | 1.00x | 0.20x | 90.0 | 180.0 | 1.50x |")


# ---- the gRPC client against a fake router ------------------------------------------------------
class _FakeRouter:
    """Answers Generate like the router: ``max_tokens`` tokens, then usage with cached tokens the test chose
    (by prompt length), the route reason of a store fetch for long prompts; a prompt starting with 5 fails; one
    starting with 6 never ends."""

    def __init__(self) -> None:
        from proto import baton_pb2_grpc as pb_grpc

        class Servicer(pb_grpc.GenerationServicer):
            async def Generate(s, request, context):  # noqa: N802, N805
                from proto import baton_pb2 as pb

                ids = list(request.token_ids.ids)
                if ids[0] == 5:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
                if ids[0] == 6:
                    await asyncio.sleep(3600)
                n = request.sampling.max_tokens
                for i in range(n - 1):
                    yield pb.GenerateResponse(token_ids=[7 + i])
                reason = "fetched 32 prefix tokens from the store" if len(ids) >= 64 else "local"
                yield pb.GenerateResponse(
                    token_ids=[99], usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=n,
                                                   cached_prompt_tokens=len(ids) // 32 * 16),
                    timings=pb.Timings(route_kind="local", route_reason=reason, decode_worker="decode-0",
                                       queue_ms=1.5, prefill_ms=4.0))

        self.servicer = Servicer()

    async def __aenter__(self) -> str:
        from proto import baton_pb2_grpc as pb_grpc

        self.server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(0)


def _planned(first: int, n: int, at: float, max_tokens: int = 3) -> tr.ReplayRequest:
    return tr.ReplayRequest(index=first, arrival_s=at, prompt=[first] + [9] * (n - 1), max_tokens=max_tokens,
                            hash_ids=())


def test_the_grpc_client_records_what_the_router_reported_and_bounds_the_run():
    requests = [_planned(10, 64, 0.0), _planned(11, 40, 0.05, 1), _planned(5, 20, 0.0), _planned(6, 20, 0.0)]

    async def go():
        async with _FakeRouter() as address:
            return await tr.replay_grpc(address, requests, vocab_size=1000, request_timeout_s=30, max_run_s=4.0,
                                        warmup=1, label="t")

    outcomes, duration = asyncio.run(go())
    ok, short, failed, hung = outcomes
    assert [o.index for o in outcomes] == [10, 11, 5, 6]
    assert (ok.ok, ok.prompt_tokens, ok.cached_tokens, ok.output_tokens, ok.store_tokens) == (True, 64, 32, 3, 32)
    assert ok.route_kind == "local" and ok.decode_worker == "decode-0" and 0 < ok.ttft_s <= ok.e2e_s
    assert (ok.queue_ms, ok.prefill_ms, ok.transfer_ms) == (1.5, 4.0, 0.0)
    assert (short.cached_tokens, short.output_tokens, short.store_tokens) == (16, 1, 0)
    assert (failed.ok, failed.error, failed.prompt_tokens) == (False, "INVALID_ARGUMENT", 20)
    assert (hung.ok, hung.error) == (False, "run bound")
    assert duration == pytest.approx(4.0)  # a request cancelled at the bound ends the run there (not measured)
    s = tr.summarize(outcomes, duration)
    assert s["hit_rate"] == (32 + 16) / (64 + 40)


# ---- aiperf -------------------------------------------------------------------------------------
def test_the_scaled_trace_for_aiperf_is_what_our_replay_sends():
    requests = _replay([(1, 2, 3), (1, 2, 4, 5), (1, 2, 3), (1, 2, 3, 9)], tails=[100, 0, 100, 0])
    lines = [json.loads(line) for line in tr.scaled_trace_lines(requests, SCALE)]
    # a partial last block (4 tokens of block 3) gets an id of its own past the trace's (9), the same one wherever
    # it is that size, never the id of the full block 3 of the last request (aiperf wants one size per id)
    assert lines == [{"timestamp": 0, "input_length": 36, "output_length": 2, "hash_ids": [1, 2, 10]},
                     {"timestamp": 1000, "input_length": 64, "output_length": 2, "hash_ids": [1, 2, 4, 5]},
                     {"timestamp": 2000, "input_length": 36, "output_length": 2, "hash_ids": [1, 2, 10]},
                     {"timestamp": 3000, "input_length": 64, "output_length": 2, "hash_ids": [1, 2, 3, 9]}]
    # one hash id per 16 tokens (aiperf's --prompt-input-tokens-block-size 16), the last one partial
    assert all(len(line["hash_ids"]) == -(-line["input_length"] // 16) for line in lines)


def test_a_cut_prompt_keeps_only_the_hash_ids_it_still_spans():
    trace = [_req(0, list(range(1, 9)))]  # 8 blocks, 128 tokens scaled
    requests = tr.scaled_requests(trace, SCALE, vocab_size=1000, max_model_len=100)
    line = json.loads(tr.scaled_trace_lines(requests, SCALE)[0])
    assert line["input_length"] == 98 and line["hash_ids"] == [1, 2, 3, 4, 5, 6, 9]  # 6 blocks, then 2 tokens


def test_aiperf_records_become_outcomes():
    def record(start, end, **metrics):
        return {"metadata": {"benchmark_phase": "profiling", "request_start_ns": start, "request_end_ns": end},
                "metrics": {k: {"value": v} for k, v in metrics.items()}}
    records = [
        record(1_000_000_000, 1_500_000_000, time_to_first_token=20.0, request_latency=50.0, usage_prompt_tokens=100,
               usage_prompt_cache_read_tokens=32, usage_completion_tokens=4, inter_token_latency=10.0),
        record(1_200_000_000, 3_000_000_000, time_to_first_token=40.0, request_latency=90.0, usage_prompt_tokens=50,
               usage_prompt_cache_read_tokens=0, usage_completion_tokens=2),
        {"metadata": {"benchmark_phase": "warmup", "request_start_ns": 0, "request_end_ns": 1},
         "metrics": {"time_to_first_token": {"value": 1.0}}},
        {**record(1_100_000_000, 1_200_000_000, error_isl=3000),  # as aiperf 0.13 writes a refused request
         "error": {"code": 400, "type": "Bad Request", "message": "prompt has 3000 tokens; ..."}},
    ]
    outcomes, duration = tr.aiperf_outcomes(records)
    assert duration == pytest.approx(2.0)
    assert [(o.ok, o.prompt_tokens, o.cached_tokens, o.output_tokens) for o in outcomes] == [
        (True, 100, 32, 4), (True, 50, 0, 2), (False, 3000, 0, 0)]
    assert outcomes[0].ttft_s == pytest.approx(0.020) and outcomes[2].error == "HTTP 400"
    assert outcomes[0].itl_ms == pytest.approx(10.0) and outcomes[1].itl_ms == 0.0  # not measured: 0


def test_the_tokenizer_is_put_where_aiperf_looks_for_it_offline(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "config.json").write_text('{"vocab_size": 4096}')
    repo = tr.hf_cache_for(model, tmp_path / "hf")
    snapshot = tmp_path / "hf" / "hub" / "models--baton--model" / "snapshots" / "local"
    assert repo == "baton/model" and (snapshot / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "hf" / "hub" / "models--baton--model" / "refs" / "main").read_text() == "local"
    with pytest.raises(ValueError, match="tokenizer.json"):
        tr.hf_cache_for(tmp_path / "model.gguf", tmp_path / "hf2")


def test_the_served_shape_follows_the_checkpoint_and_the_extra_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 4096,
                                                      "max_position_embeddings": 2048}))
    assert tr._model_info(tmp_path, []) == (4096, 2048, 16)
    assert tr._model_info(tmp_path, ["--max-model-len", "1024", "--block-size", "32"]) == (4096, 1024, 32)
    assert tr._model_info(tmp_path, ["--max-model-len", "9999"]) == (4096, 2048, 16)  # never past the model's


def test_registered_as_a_bench_command():
    from bench.__main__ import _BENCHMARKS

    assert _BENCHMARKS["trace"] == "bench.trace_replay"
    with pytest.raises(SystemExit) as done:
        tr.main(["--help"])
    assert done.value.code == 0
