"""RequestTrace: the final Timings from token send times and the workers' reports (fake clock)."""

from __future__ import annotations

from proto import baton_pb2 as pb
from router.trace import RequestTrace


class Clock:
    def __init__(self) -> None:
        self.now_s = 10.0

    def __call__(self) -> float:
        return self.now_s


def test_final_timings_combine_router_and_worker_figures():
    clock = Clock()
    trace = RequestTrace(clock)
    trace.route("remote", "80 uncached prompt tokens > threshold 64")
    clock.now_s += 0.050
    trace.merge(pb.Timings(prefill_ms=40.0, prefill_worker="p0", ttft_ms=999.0))
    trace.tokens_sent(1)  # first token at +50 ms
    trace.merge(pb.Timings(transfer_bytes=2_000_000, transfer_ms=4.0, transfer_blocks=5, transport="tcp",
                           route_reason="KV pull failed; prefilled locally"))
    for _ in range(4):
        clock.now_s += 0.010
        trace.tokens_sent(2)
    clock.now_s += 0.005
    t = trace.final(prefill_worker="p0", decode_worker="d1")
    assert round(t.ttft_ms, 6) == 50.0 and round(t.e2e_ms, 6) == 95.0  # the router's TTFT, not a worker's
    assert (t.prefill_ms, t.transfer_bytes, t.transfer_blocks, t.transport) == (40.0, 2_000_000, 5, "tcp")
    assert round(t.transfer_gbps, 9) == 0.5  # derived when the worker left it out
    assert round(t.decode_tokens_per_s, 6) == 200.0  # 8 tokens after the first in 40 ms
    assert (t.route_kind, t.prefill_worker, t.decode_worker) == ("remote", "p0", "d1")
    assert t.route_reason == "80 uncached prompt tokens > threshold 64; KV pull failed; prefilled locally"


def test_single_token_has_no_decode_rate():
    clock = Clock()
    trace = RequestTrace(clock)
    clock.now_s += 0.02
    trace.tokens_sent(1)
    t = trace.final(prefill_worker="", decode_worker="d0")
    assert t.decode_tokens_per_s == 0.0 and round(t.ttft_ms, 6) == 20.0 and t.transfer_gbps == 0.0


def test_queue_ms_of_the_worker_reaches_the_final_timings_and_the_cli_line():
    from router.generate_cli import format_timings

    clock = Clock()
    trace = RequestTrace(clock)
    trace.route("remote", "cost")
    trace.merge(pb.Timings(prefill_ms=40.0, queue_ms=12.5, prefill_worker="p0"))
    clock.now_s += 0.05
    trace.tokens_sent(1)
    trace.merge(pb.Timings(decode_worker="d0"))  # D pulled the KV: no queue_ms of its own
    t = trace.final(prefill_worker="p0", decode_worker="d0")
    assert t.queue_ms == 12.5
    final = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH, timings=t,
                                usage=pb.Usage(prompt_tokens=80, completion_tokens=1))
    assert format_timings(final).startswith("[TTFT 50.0 ms | queue 12.5 ms | prefill p0 | decode d0 | route remote")


def test_the_workers_instants_say_how_far_ahead_of_ps_compute_the_first_layer_landed():
    from router.generate_cli import format_timings

    trace = RequestTrace(Clock())
    trace.route("remote", "cost")
    trace.merge(pb.Timings(prefill_worker="p0", prefill_end_unix_ms=1_000_400.0))  # P's final message
    trace.merge(pb.Timings(decode_worker="d0", kv_layerwise=True, transport="tcp", transfer_blocks=3,
                           transfer_bytes=3 << 10, transfer_ms=2.0, kv_first_layer_unix_ms=1_000_012.5))
    t = trace.final(prefill_worker="p0", decode_worker="d0")
    assert (t.prefill_end_unix_ms, t.kv_first_layer_unix_ms) == (1_000_400.0, 1_000_012.5)
    line = format_timings(pb.GenerateResponse(timings=t))
    assert "streamed by layer, first layer in 387.5 ms before P finished" in line
    t.kv_first_layer_unix_ms = 1_000_401.0  # it landed after P finished: nothing hid behind the compute
    assert "before P finished" not in format_timings(pb.GenerateResponse(timings=t))


def test_a_migrated_requests_new_worker_adds_its_note_not_its_figures_and_the_cli_line_says_it():
    from router.generate_cli import format_timings

    trace = RequestTrace(Clock())
    trace.route("local", "cost")
    trace.merge(pb.Timings(prefill_ms=40.0, queue_ms=2.0, transfer_bytes=4096, transfer_ms=1.0, decode_worker="d0"))
    trace.note("migrated: decode worker d0 failed after 3 tokens were streamed: UNAVAILABLE: reset; resumed on d1")
    trace.merge(pb.Timings(prefill_ms=900.0, queue_ms=50.0, transfer_bytes=1, route_reason="imported 32 prefix tokens",
                           spec_draft_tokens=6, spec_accepted_tokens=4), migrated=True)
    t = trace.final(prefill_worker="", decode_worker="d1")
    assert (t.prefill_ms, t.queue_ms, t.transfer_bytes) == (40.0, 2.0, 4096)  # the route's, not d1's
    assert (t.spec_draft_tokens, t.spec_accepted_tokens) == (6, 4)  # the finishing worker's
    assert t.route_reason == ("cost; migrated: decode worker d0 failed after 3 tokens were streamed: UNAVAILABLE: "
                              "reset; resumed on d1; imported 32 prefix tokens")
    t.migrations, t.migration_ms = 1, 812.4
    assert "| migrated 1x (waited 812 ms) |" in format_timings(pb.GenerateResponse(timings=t))
